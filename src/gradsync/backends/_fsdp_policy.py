"""FSDP helpers: which submodules become sharded units, what deferring costs in memory, and
which level of deferral a policy and a budget pick.

Used by the fsdp adapter; kept apart so the adapter reads as the sync logic alone.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import nn

from gradsync._util import human_bytes
from gradsync.backends._fsdp_compat import unsharded_numel
from gradsync.backends._memory import AUTO_BUDGET_FRACTION, Budget, available_memory, extra_text
from gradsync.config import RequestedPolicy, SyncPolicy
from gradsync.errors import ConfigError

__all__ = ["AUTO_BUDGET_FRACTION", "Keep", "available_memory", "decide", "deferral_cost",
           "select_units"]

#: How long a deferred window keeps the parameters gathered: "no" (FSDP2's default: gathered
#: for forward, again for backward), "after_backward" (the deprecated
#: fsdp_reshard_after_backward=False: from backward to the next forward) or "window" (from the
#: window's first forward to its boundary backward: one all-gather per window).
Keep = Literal["no", "after_backward", "window"]


def select_units(model: nn.Module, wrap: Any = None) -> list[nn.Module]:
    """The submodules to shard as their own unit (outermost first; never the root).

    ``wrap`` is None (the children of every ModuleList / Sequential container), a list of
    module class names or classes, or a callable ``module -> bool``.
    """
    if wrap is None:
        def pick(parent: nn.Module, child: nn.Module) -> bool:
            return isinstance(parent, nn.ModuleList | nn.Sequential)
    elif callable(wrap) and not isinstance(wrap, type):
        def pick(parent: nn.Module, child: nn.Module) -> bool:
            return bool(wrap(child))
    else:
        wanted = [wrap] if isinstance(wrap, str | type) else list(wrap)
        names = {w if isinstance(w, str) else w.__name__ for w in wanted}
        present = {type(m).__name__ for m in model.modules()}
        if not names & present:
            raise ConfigError(
                f"fsdp_wrap={sorted(names)} names no module class of this model; use class "
                f"names from: {', '.join(sorted(present))}, a callable, or None for the default"
            )

        def pick(parent: nn.Module, child: nn.Module) -> bool:
            return type(child).__name__ in names

    units: list[nn.Module] = []

    def walk(parent: nn.Module) -> None:
        for child in parent.children():
            if pick(parent, child) and any(True for _ in child.parameters()):
                units.append(child)  # a unit is sharded whole: do not descend into it
            else:
                walk(child)

    walk(model)
    return units


def deferral_cost(model: nn.Module, world: int, *, grad_bytes: int | None, keep_params: bool) -> int:
    """Extra bytes per rank that deferring holds: the unsharded gradients minus their shard
    (in the gradient dtype), plus the unsharded parameters when they stay gathered."""
    # FSDP2 parameters are DTensors (numel is the full size); FSDP1's are local flat shards.
    sizes = [(unsharded_numel(p), p.element_size()) for p in model.parameters()]
    full = sum(n * (grad_bytes or size) for n, size in sizes)
    if keep_params:
        full += sum(n * size for n, size in sizes)
    return full - full // world


def decide(asked: RequestedPolicy, keep: bool | None, legacy_keep: bool, *, grads: int, full: int,
           budget: Budget | None, world: int) -> tuple[SyncPolicy, Keep, int, str]:
    """Pick the deferral level. ``grads`` / ``full``: extra bytes per rank that deferring
    holds for the gradients alone / for gradients and parameters. ``keep``: the option
    fsdp_keep_params_in_window (None: auto decides by the budget; explicit policies do not
    consult it). ``legacy_keep``: the deprecated fsdp_reshard_after_backward=False."""
    g_text = extra_text(grads, "unsharded gradients", world)
    f_text = extra_text(full, "unsharded gradients and parameters", world)
    if asked == "every_step":
        return "every_step", "no", 0, f"every_step (requested): {g_text} when deferring"
    if asked == "defer":
        if keep:
            return "defer", "window", full, f"defer (requested), parameters kept gathered in the window: {f_text}"
        if legacy_keep:
            return "defer", "after_backward", full, f"defer (requested): {f_text}"
        return "defer", "no", grads, f"defer (requested): {g_text}"
    assert budget is not None
    b = budget.describe()
    texts = {"window": f_text, "after_backward": f_text, "no": g_text}
    options: list[tuple[Keep, int]] = (
        [("after_backward", full)] if legacy_keep and keep is None
        else [("window", full)] if keep else [("no", grads)] if keep is False
        else [("window", full), ("no", grads)]
    )
    for i, (level, extra) in enumerate(options):
        if extra <= budget.nbytes:
            how = {"window": ", parameters kept gathered in the window",
                   "after_backward": ", parameters kept gathered after backward",
                   "no": " (gradients only)" if keep is None else ""}[level]
            also = (f"; keeping the parameters gathered too would hold {human_bytes(full)} "
                    f"({full} bytes), which exceeds it") if i > 0 else ""
            return "defer", level, extra, f"auto -> defer{how}: {texts[level]}, which fits the budget {b}{also}"
    level, _ = options[-1]
    return "every_step", "no", 0, f"auto -> every_step: {texts[level]}, which exceeds the budget {b}"
