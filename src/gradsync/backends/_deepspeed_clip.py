"""Gradient clipping on DeepSpeed: the engine clips by the 2-norm inside ``step()``, with one
value (the config's ``gradient_clipping``). ``accel.clip_grad_norm_`` sets that value and
returns the norm step() will clip by; ``clip_grad_value_`` has no DeepSpeed counterpart."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from gradsync.backends import _deepspeed_compat
from gradsync.errors import ConfigError


class Clipping:
    """The one clipping value of an engine: from the config, or fixed by the first
    ``clip_grad_norm_`` call; a later call with another value is a ConfigError."""

    def __init__(self, ds_config: dict[str, Any]) -> None:
        given = "gradient_clipping" in ds_config
        self.max_norm: float | None = float(ds_config["gradient_clipping"]) if given else None

    def set(self, engine: Any, max_norm: float, norm_type: float) -> None:
        """Make ``engine.step()`` clip at ``max_norm`` (checked against the value set before)."""
        if float(norm_type) != 2.0:
            raise ConfigError(
                f"clip_grad_norm_(norm_type={norm_type}) with backend='deepspeed': DeepSpeed "
                "clips by the 2-norm inside step(); use norm_type=2.0"
            )
        max_norm = float(max_norm)
        if (
            self.max_norm is not None
            and self.max_norm > 0
            and not math.isclose(self.max_norm, max_norm)
        ):
            raise ConfigError(
                f"clip_grad_norm_(max_norm={max_norm}) contradicts DeepSpeed gradient_clipping="
                f"{self.max_norm} set earlier; DeepSpeed clips inside step() with one value, so "
                "use the same max_norm every time (or the value in deepspeed_config)"
            )
        if self.max_norm == max_norm:
            return
        self.max_norm = max_norm
        _deepspeed_compat.set_clipping(engine, max_norm)


def global_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of the reduced gradients as DeepSpeed holds them before ``step()`` (the
    norm step() clips by), equal on every rank."""
    from deepspeed.utils import safe_get_full_grad

    total = torch.zeros((), dtype=torch.float64)
    for p in parameters:
        grad = safe_get_full_grad(p)
        if grad is not None:
            total += grad.detach().double().pow(2).sum().cpu()
    return total.sqrt().float()


def refuse_clip_by_value(clip_value: float) -> ConfigError:
    """The ConfigError for ``clip_grad_value_`` on DeepSpeed."""
    return ConfigError(
        f"clip_grad_value_({clip_value}) with backend='deepspeed': DeepSpeed keeps the reduced "
        "gradients in its own partitions and clips only by norm inside step(); use "
        "accel.clip_grad_norm_(params, max_norm)"
    )
