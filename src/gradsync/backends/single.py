"""One process: nothing to synchronise, so nothing to defer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from gradsync.backends import _dist, _plain_state
from gradsync.backends.base import SyncPolicy, clear_grads
from gradsync.batching import BatchPlan
from gradsync.config import Config


class SingleBackend:
    name: ClassVar[str] = "single"
    checkpoint_format: ClassVar[str] = "plain"
    reshardable: ClassVar[bool] = True  # every rank holds everything

    def __init__(self) -> None:
        self.policy: SyncPolicy = "defer"
        self.policy_reason = ""
        self.owns_group = False
        self._device = torch.device("cpu")
        self._bf16 = False

    @property
    def device(self) -> torch.device:
        return self._device

    def setup(self, config: Config) -> None:
        self._device = _dist.local_device()
        # Nothing is synchronised; report the policy asked for ("auto" defers).
        self.policy = "defer" if config.sync_policy == "auto" else config.sync_policy
        self.policy_reason = "one process: nothing to synchronise"
        self._bf16 = _dist.autocast_bf16(config, self.name)

    def prepare(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, plan: BatchPlan
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
        return model.to(self._device), optimizer

    def begin_window(self, models: Sequence[torch.nn.Module]) -> None:
        return None

    @contextlib.contextmanager
    def micro_step(self, model: torch.nn.Module, *, boundary: bool) -> Iterator[None]:
        if not self._bf16:  # entering even a disabled autocast costs microseconds per step
            yield
            return
        with torch.autocast(self._device.type, dtype=torch.bfloat16):
            yield

    def end_window(self, models: Sequence[torch.nn.Module]) -> None:
        return None

    def abort_window(self, models: Sequence[torch.nn.Module]) -> None:
        clear_grads(models)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        optimizer.step()
        return True

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        optimizer.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(
        self, model: torch.nn.Module, parameters: Iterable[torch.Tensor], max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    def barrier(self) -> None:
        return None

    def save(self, path: Path, models: Sequence[torch.nn.Module],
             optimizers: Sequence[torch.optim.Optimizer | None], *, window_open: bool) -> None:
        _plain_state.save(path, models, optimizers, self.unwrap, 0, window_open=window_open)

    def load(self, path: Path, models: Sequence[torch.nn.Module],
             optimizers: Sequence[torch.optim.Optimizer | None], *, window_open: bool) -> None:
        _plain_state.load(path, models, optimizers, self.unwrap, 0, window_open=window_open)
