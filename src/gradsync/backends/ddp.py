"""DistributedDataParallel: ``no_sync()`` around forward and backward off the boundary."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync.backends import _ddp_compat, _dist
from gradsync.backends.base import SyncPolicy, clear_grads, is_frozen
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
        self._bf16 = False
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
        self._bf16 = _dist.autocast_bf16(config, self.name)
        self.ddp_kwargs = dict(config.ddp_kwargs or {})
        if config.find_unused_parameters:
            if self.ddp_kwargs.get("find_unused_parameters", True) is not True:
                raise ConfigError(
                    "find_unused_parameters=True contradicts ddp_kwargs={'find_unused_parameters': "
                    "False}; keep one of them"
                )
            self.ddp_kwargs["find_unused_parameters"] = True
        self.owns_group = _dist.ensure_process_group(
            self.name, want_audit=config.audit, self_check=config.self_check and self.policy == "defer"
        )
        self._device = _dist.local_device()

    def prepare(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, plan: BatchPlan
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
        if isinstance(model, DDP):
            return model, optimizer
        model = model.to(self._device)
        if is_frozen(model):
            # Nothing to synchronise (a reference or teacher model): never wrapped in DDP.
            _dist.broadcast_from_rank0(model)
            return model, optimizer
        device_ids = [self._device.index] if self._device.type == "cuda" else None
        return DDP(model, device_ids=device_ids, **self.ddp_kwargs), optimizer

    def begin_window(self, models: Sequence[torch.nn.Module]) -> None:
        return None

    @contextlib.contextmanager
    def micro_step(self, model: torch.nn.Module, *, boundary: bool) -> Iterator[None]:
        cast = torch.autocast(self._device.type, dtype=torch.bfloat16) if self._bf16 else None
        if not isinstance(model, DDP):
            if is_frozen(model):  # a prepared frozen model: it has no gradient to defer
                with cast or contextlib.nullcontext():
                    yield
                return
            raise RuntimeError(
                f"accumulate() got a {type(model).__name__}, not the DistributedDataParallel model "
                "that accel.prepare() returned, so gradients would sync on every micro-step; "
                "pass the prepared model: `model = accel.prepare(model)`"
            )
        # no_sync() saves require_backward_grad_sync and puts the saved value back on exit.
        defer = not boundary and self.policy != "every_step"
        try:
            with model.no_sync() if defer else contextlib.nullcontext(), cast or contextlib.nullcontext():
                yield
        except RuntimeError as err:
            if not _ddp_compat.is_unfinished_reduction(err) or model.find_unused_parameters:
                raise  # with the flag on, torch's own advice is the one that applies
            raise RuntimeError(_unused_message(model, str(err))) from None

    def end_window(self, models: Sequence[torch.nn.Module]) -> None:
        return None

    def abort_window(self, models: Sequence[torch.nn.Module]) -> None:
        # Deferred gradients live on the parameters (DDP's reducer keeps no copy between
        # backward passes), so clearing them drops the window.
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
        # At the boundary DDP has all-reduced the gradients: the local norm is the global one.
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module if isinstance(model, DDP) else model

    def state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        return {k: v.detach().cpu() for k, v in self.unwrap(model).state_dict().items()}

    def barrier(self) -> None:
        dist.barrier()


def _unused_message(model: DDP, torch_message: str) -> str:
    """One line for DDP's "Expected to have finished reduction" error: which parameters got
    no gradient in the last synchronised backward, and the fix."""
    ignored = frozenset(getattr(model, "parameters_to_ignore", ()) or ())
    rank, names = _ddp_compat.unused_parameters(torch_message, model.module, ignored)
    if names:
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        which = f"parameter(s) {shown} got no gradient"
    else:
        which = "some parameters got no gradient (torch did not say which)"
    where = f" on rank {rank}" if rank is not None else ""
    return (
        f"DDP: {which}{where} in the last synchronised backward (used only in some micro-steps, "
        "or not at all), so DDP could not finish reducing; pass "
        "Accelerator(find_unused_parameters=True) or ddp_kwargs={'find_unused_parameters': True}"
    )
