"""Which sync policy the DeepSpeed adapter runs, and why: the requested one checked against
the ZeRO stage at setup, and ``auto`` on ZeRO 2/3 decided by the memory budget once the
engine exists. Used by the deepspeed adapter; kept apart so it reads as the sync logic alone."""

from __future__ import annotations

from typing import Any

import torch

from gradsync._support import dist
from gradsync.backends import _deepspeed_compat
from gradsync.backends._memory import agreed_budget, extra_text
from gradsync.config import RequestedPolicy, SyncPolicy
from gradsync.errors import ConfigError


def resolve(asked: RequestedPolicy, stage: int) -> tuple[SyncPolicy, str]:
    """The policy at setup (``auto`` on ZeRO 2/3 is provisional: ``decide`` settles it)."""
    if asked == "native" or (asked == "auto" and stage in (0, 1)):
        tail = ", reducing only at the boundary" if stage < 2 else ""
        return "native", f"{asked} -> native: DeepSpeed ZeRO {stage} accumulates by itself{tail}"
    if asked == "auto":
        return "native", "auto: decided at prepare by the memory budget"
    if asked == "defer":
        return "defer", "defer (requested): one coalesced reduction per window"
    if stage in (2, 3):  # every_step: what ZeRO 2/3 do natively
        return "every_step", f"every_step (requested): ZeRO {stage} reduces every micro-step"
    raise ConfigError(
        f"sync_policy='every_step' with DeepSpeed ZeRO stage {stage}: stages 0 and 1 "
        "reduce gradients only at the boundary; use 'native', 'auto' or 'defer' (or stage 2/3)"
    )


def decide(
    engine: Any, stage: int, budget: tuple[int | None, str], device: torch.device, version: str
) -> tuple[SyncPolicy, str, dict[str, int]]:
    """``auto`` on ZeRO 2/3: defer (one coalesced reduction per window) when DeepSpeed can
    coalesce and the window's unreduced gradients fit the memory budget, else native.
    Returns the policy, the reason with its numbers, and the numbers."""
    if not _deepspeed_compat.can_coalesce(engine):
        return (
            "native",
            (
                f"auto -> native: ZeRO {stage} reduces on every micro-step, because deepspeed "
                f"{version} cannot coalesce the reduction for its {type(engine.optimizer).__name__} "
                "(coalesce_grad_reduction raises NotImplementedError for the BF16/FP16 optimizer "
                "wrappers)"
            ),
            {},
        )
    world = dist.world_size()
    full = _deepspeed_compat.full_gradient_bytes(engine)
    extra = full - full // world
    b = agreed_budget(*budget, device)
    memory = {"deferral_extra_bytes": extra, "world_size": world, "budget_bytes": b.nbytes}
    text = extra_text(extra, "unreduced gradients", world)
    if extra <= b.nbytes:
        return (
            "defer",
            (
                f"auto -> defer (one coalesced reduction per window): {text}, which "
                f"fits the budget {b.describe()}"
            ),
            memory,
        )
    return (
        "native",
        (
            f"auto -> native (ZeRO {stage} reduces on every micro-step): {text}, "
            f"which exceeds the budget {b.describe()}"
        ),
        memory,
    )
