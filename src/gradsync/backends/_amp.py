"""Mixed precision for the adapters without their own machinery (single, ddp, fsdp).

Two parts: which autocast a micro-step runs under (checked against the device once, at
setup), and ``WindowScaler``, a GradScaler driven by the accumulation window: every
micro-step's loss is scaled, each optimizer's gradients are unscaled ONCE per window (by
``clip_grad_norm_`` or by the step, whichever comes first), an inf/NaN on any rank skips
the step on every rank, and the scale is updated once after the window's steps.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from gradsync._support import torch_compat as _torch_compat
from gradsync.config import Config
from gradsync.errors import ConfigError, UsageError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_autocast(device: torch.device, setting: str) -> torch.dtype:
    """The autocast dtype of ``mixed_precision=setting``, or a one-line ConfigError when the
    device cannot autocast to it."""
    dtype = DTYPES[setting]
    if not torch.amp.is_autocast_available(device.type):
        raise ConfigError(
            f"mixed_precision={setting!r} needs autocast, which the {device.type!r} device does "
            "not have; use mixed_precision='no' on this device"
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.autocast(device.type, dtype=dtype)
    if any("not supported" in str(w.message) for w in caught):
        raise ConfigError(
            f"mixed_precision={setting!r}: the {device.type!r} device cannot autocast to "
            f"{dtype}; use {'bf16' if setting == 'fp16' else 'fp16'!r} or 'no' on this device"
        )
    return dtype


def autocast_dtype(config: Config, device: torch.device) -> torch.dtype | None:
    """The dtype the micro-steps autocast to (None: no autocast)."""
    if config.mixed_precision == "no":
        return None
    return check_autocast(device, config.mixed_precision)


def autocast(
    device: torch.device, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager[Any]:
    """The autocast a micro-step runs under (a no-op context when ``dtype`` is None)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def make_scaler(config: Config, device: torch.device, *, sharded: bool) -> WindowScaler | None:
    """A window scaler when ``mixed_precision="fp16"``, else None. ``sharded``: the ranks
    hold different gradients at the boundary (shards), so the inf/NaN check is all-reduced."""
    if config.mixed_precision != "fp16":
        return None
    return WindowScaler(device, sharded=sharded, settings=config.grad_scaler or {})


class WindowScaler:
    """A GradScaler whose unscale, step and update follow the accumulation window.

    Where ranks hold different gradients at the boundary (FSDP's shards) it is torch's
    ShardedGradScaler, which all-reduces the inf/NaN flag over the process group after
    unscaling, so an overflow in one rank's shard makes every rank skip. Where every rank
    holds the same all-reduced gradients (DDP) the plain GradScaler sees the same flag on
    every rank: the all-reduce has already carried any rank's inf/NaN to all of them.
    """

    def __init__(self, device: torch.device, *, sharded: bool, settings: dict[str, Any]) -> None:
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler: torch.amp.GradScaler = ShardedGradScaler(device.type, **settings)
        else:
            self.scaler = torch.amp.GradScaler(device.type, **settings)
        self._unscaled: set[int] = set()  # optimizers unscaled in this window
        self._stepped: set[int] = set()  # optimizers stepped (or skipped) in this window

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        self.update()  # a new window's first backward: the last window's steps are done
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the optimizer's gradients and check them on every rank (once per window)."""
        if id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step unless a rank found inf/NaN; return whether the step was applied."""
        if id(optimizer) in self._stepped:
            raise UsageError(
                "optimizer.step() was called twice in one accumulation window with "
                "mixed_precision='fp16'; the gradients were already unscaled and applied: "
                "call step() once per window"
            )
        self.unscale_(optimizer)
        self.scaler.step(optimizer)
        self._stepped.add(id(optimizer))
        return not _torch_compat.scaler_found_inf(self.scaler, optimizer)

    def update(self) -> None:
        """Update the scale once after a window whose gradients were unscaled (halved on an
        overflow, grown after ``growth_interval`` clean steps); nothing otherwise."""
        if self._unscaled:
            self.scaler.update()
            self._unscaled.clear()
            self._stepped.clear()

    # -- what accel.scaler shows ---------------------------------------------
    def get_scale(self) -> float:
        self.update()
        return float(self.scaler.get_scale())

    def state_dict(self) -> dict[str, Any]:
        self.update()
        return dict(self.scaler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.update()
        self.scaler.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"WindowScaler({type(self.scaler).__name__}, scale={self.get_scale()})"
