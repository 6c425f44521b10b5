"""DistributedDataParallel: ``no_sync()`` around forward and backward off the boundary."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync import _torch_compat
from gradsync.backends import _amp, _dist, _modules
from gradsync.backends._amp import WindowScaler
from gradsync.backends.base import SyncPolicy, clear_grads
from gradsync.batching import BatchPlan
from gradsync.config import Config
from gradsync.errors import ConfigError


class DDPBackend:
    name: ClassVar[str] = "ddp"

    def __init__(self) -> None:
        self.policy: SyncPolicy = "defer"
        self.policy_reason = ""
        self._device = torch.device("cpu")
        self.owns_group = False
        self._dtype: torch.dtype | None = None  # autocast dtype
        self.scaler: WindowScaler | None = None
        self._checkpointing: Any = None
        self._compile: dict[str, Any] | None = None
        self.ddp_kwargs: dict[str, Any] = {}

    @property
    def device(self) -> torch.device:
        return self._device

    def setup(self, config: Config) -> None:
        if config.sync_policy == "native":
            raise ConfigError(
                "sync_policy='native' is DeepSpeed's; with backend='ddp' use 'defer', "
                "'every_step' or 'auto'"
            )
        # Deferring costs DDP no memory, so "auto" defers.
        self.policy = "every_step" if config.sync_policy == "every_step" else "defer"
        if config.sync_policy == "auto":
            self.policy_reason = "auto -> defer: no_sync() costs DDP no extra memory"
        self.ddp_kwargs = dict(config.ddp_kwargs or {})
        self._checkpointing = config.activation_checkpointing
        self._compile = _modules.compile_kwargs(config)
        self._dtype = _amp.autocast_dtype(config, _dist.local_device())
        self.owns_group = _dist.ensure_process_group(self.name, want_audit=config.audit)
        self._device = _dist.local_device()
        # At the boundary every rank holds the same all-reduced gradients, which carry any
        # rank's inf/NaN: each rank's own check sees the same overflow, no extra collective.
        self.scaler = _amp.make_scaler(config, self._device, sharded=False)

    def prepare(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, plan: BatchPlan
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
        if isinstance(_torch_compat.uncompiled(model), DDP):
            _modules.refuse_wrapped(model, self.name, self._checkpointing, self._compile)
            return model, optimizer
        compiled = _torch_compat.uncompiled(model) is not model  # by the user, before prepare
        _modules.checkpoint_modules(_torch_compat.uncompiled(model), self._checkpointing)
        model = model.to(self._device)
        device_ids = [self._device.index] if self._device.type == "cuda" else None
        wrapped = DDP(model, device_ids=device_ids, **self.ddp_kwargs)
        # Compiling the wrapped model lets torch split the graph at DDP's buckets.
        _modules.compile_in_place(wrapped, None if compiled else self._compile)
        return wrapped, optimizer

    def begin_window(self, models: Sequence[torch.nn.Module]) -> None:
        return None

    @contextlib.contextmanager
    def micro_step(self, model: torch.nn.Module, *, boundary: bool) -> Iterator[None]:
        model = _torch_compat.uncompiled(model)
        if not isinstance(model, DDP):
            raise RuntimeError(
                f"accumulate() got a {type(model).__name__}, not the DistributedDataParallel model "
                "that accel.prepare() returned, so gradients would sync on every micro-step; "
                "pass the prepared model: `model = accel.prepare(model)`"
            )
        # no_sync() saves require_backward_grad_sync and puts the saved value back on exit.
        defer = not boundary and self.policy != "every_step"
        with model.no_sync() if defer else contextlib.nullcontext(), self.autocast():
            yield

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return _amp.autocast(self._device, self._dtype)

    def end_window(self, models: Sequence[torch.nn.Module]) -> None:
        return None

    def abort_window(self, models: Sequence[torch.nn.Module]) -> None:
        # Deferred gradients live on the parameters (DDP's reducer keeps no copy between
        # backward passes), so clearing them drops the window.
        clear_grads(models)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self.scaler is not None:  # skips on every rank when any rank overflowed
            return self.scaler.step(optimizer)
        optimizer.step()
        return True

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        optimizer.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(
        self, model: torch.nn.Module, parameters: Iterable[torch.Tensor], max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        # At the boundary DDP has all-reduced the gradients: the local norm is the global one.
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(
        self, model: torch.nn.Module, parameters: Iterable[torch.Tensor], clip_value: float
    ) -> None:
        torch.nn.utils.clip_grad_value_(parameters, clip_value)  # reduced: equal on all ranks

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        model = _torch_compat.uncompiled(model)  # compiled after prepare, or before it
        return _torch_compat.uncompiled(model.module if isinstance(model, DDP) else model)

    def state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        return {k: v.detach().cpu() for k, v in self.unwrap(model).state_dict().items()}

    def barrier(self) -> None:
        dist.barrier()
