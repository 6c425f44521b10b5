"""One process: nothing to synchronise, so nothing to defer."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

import torch

from gradsync._plan.batch_plan import BatchPlan
from gradsync._support import torch_compat as _torch_compat
from gradsync.backends import _amp, _compression, _group, _modules, _plain_state
from gradsync.backends.base import AdapterDefaults, Held
from gradsync.config import Config

_NOTHING = contextlib.nullcontext()


class SingleBackend(AdapterDefaults):
    name: ClassVar[str] = "single"
    checkpoint_format: str = "plain"
    accelerate_layout: str = "plain"
    reshardable: ClassVar[bool] = True  # every rank holds everything

    def setup(self, config: Config) -> None:
        self._device = _group.local_device()
        # Nothing is synchronised; report the policy asked for ("auto" defers).
        self.policy = "defer" if config.sync_policy == "auto" else config.sync_policy
        self.policy_reason = "one process: nothing to synchronise"
        self._dtype = _amp.autocast_dtype(config, self._device)
        self.scaler = _amp.make_scaler(config, self._device, sharded=False)
        self._checkpointing = config.activation_checkpointing
        self._compile = _modules.compile_kwargs(config)
        _compression.nothing_to_send(config)

    def prepare(
        self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], plan: BatchPlan
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        _modules.checkpoint_modules(_torch_compat.uncompiled(model), self._checkpointing)
        model = model.to(self._device)
        _modules.compile_in_place(model, self._compile)
        return model, list(optimizers)

    def micro_step(self, model: torch.nn.Module, *, boundary: bool) -> AbstractContextManager[Any]:
        # Nothing to defer: without autocast, a shared do-nothing context (entering even a
        # disabled autocast, or a generator-based context, costs microseconds per step).
        return _NOTHING if self._dtype is None else self.autocast()

    def barrier(self) -> None:
        return None  # one process: nothing to wait for

    def save(
        self,
        path: Path,
        models: Sequence[torch.nn.Module],
        optimizers: Sequence[Held],
        *,
        window_open: bool,
    ) -> None:
        _plain_state.save(path, models, optimizers, self.unwrap, 0, window_open=window_open)

    def load(
        self,
        path: Path,
        models: Sequence[torch.nn.Module],
        optimizers: Sequence[Held],
        *,
        window_open: bool,
        trusted: bool = False,
    ) -> None:
        _plain_state.load(
            path, models, optimizers, self.unwrap, 0, window_open=window_open, trusted=trusted
        )
