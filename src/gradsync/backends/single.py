"""One process: nothing to synchronise, so nothing to defer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from gradsync import _torch_compat
from gradsync.backends import _amp, _group, _modules, _plain_state
from gradsync.backends._amp import WindowScaler
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
        self._dtype: torch.dtype | None = None  # autocast dtype
        self.scaler: WindowScaler | None = None
        self._checkpointing: Any = None
        self._compile: dict[str, Any] | None = None

    @property
    def device(self) -> torch.device:
        return self._device

    def setup(self, config: Config) -> None:
        self._device = _group.local_device()
        # Nothing is synchronised; report the policy asked for ("auto" defers).
        self.policy = "defer" if config.sync_policy == "auto" else config.sync_policy
        self.policy_reason = "one process: nothing to synchronise"
        self._dtype = _amp.autocast_dtype(config, self._device)
        self.scaler = _amp.make_scaler(config, self._device, sharded=False)
        self._checkpointing = config.activation_checkpointing
        self._compile = _modules.compile_kwargs(config)

    def prepare(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, plan: BatchPlan
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
        _modules.checkpoint_modules(_torch_compat.uncompiled(model), self._checkpointing)
        model = model.to(self._device)
        _modules.compile_in_place(model, self._compile)
        return model, optimizer

    def begin_window(self, models: Sequence[torch.nn.Module]) -> None:
        clear_grads(models)

    @contextlib.contextmanager
    def micro_step(self, model: torch.nn.Module, *, boundary: bool) -> Iterator[None]:
        if self._dtype is None:  # entering even a disabled autocast costs microseconds per step
            yield
            return
        with self.autocast():
            yield

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return _amp.autocast(self._device, self._dtype)

    def end_window(self, models: Sequence[torch.nn.Module]) -> None:
        return None

    def abort_window(self, models: Sequence[torch.nn.Module]) -> None:
        clear_grads(models)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self.scaler is not None:
            return self.scaler.step(optimizer)
        optimizer.step()
        return True

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        optimizer.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(
        self, model: torch.nn.Module, parameters: Iterable[torch.Tensor], max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(
        self, model: torch.nn.Module, parameters: Iterable[torch.Tensor], clip_value: float
    ) -> None:
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return _torch_compat.uncompiled(model)

    def state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        return {k: v.detach().cpu() for k, v in self.unwrap(model).state_dict().items()}

    def barrier(self) -> None:
        return None

    def save(self, path: Path, models: Sequence[torch.nn.Module],
             optimizers: Sequence[torch.optim.Optimizer | None], *, window_open: bool) -> None:
        _plain_state.save(path, models, optimizers, self.unwrap, 0, window_open=window_open)

    def load(self, path: Path, models: Sequence[torch.nn.Module],
             optimizers: Sequence[torch.optim.Optimizer | None], *, window_open: bool) -> None:
        _plain_state.load(path, models, optimizers, self.unwrap, 0, window_open=window_open)
