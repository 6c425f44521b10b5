"""FSDP helpers: which submodules become sharded units, and what deferring costs in memory.

Used by the fsdp adapter; kept apart so the adapter reads as the sync logic alone.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import nn

from gradsync._util import human_bytes
from gradsync.backends._fsdp_compat import unsharded_numel
from gradsync.config import SyncPolicy
from gradsync.errors import ConfigError

#: The share of free memory (device memory, or available RAM split over local ranks) that
#: "auto" lets the deferred, unsharded gradients take.
AUTO_BUDGET_FRACTION = 0.25


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


def available_memory(device: torch.device) -> tuple[int, str]:
    """Free bytes this rank may count on, and where the number came from."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device}"
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    try:
        import psutil  # optional

        avail = int(psutil.virtual_memory().available)
    except ImportError:
        avail = 0
        with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
        if not avail:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return avail // local, f"available RAM / {local} local rank(s)"


def deferral_cost(model: nn.Module, world: int, *, grad_bytes: int | None, keep_params: bool) -> int:
    """Extra bytes per rank that deferring holds: the unsharded gradients minus their shard
    (in the gradient dtype), plus the unsharded parameters when they stay gathered."""
    # FSDP2 parameters are DTensors (numel is the full size); FSDP1's are local flat shards.
    sizes = [(unsharded_numel(p), p.element_size()) for p in model.parameters()]
    full = sum(n * (grad_bytes or size) for n, size in sizes)
    if keep_params:
        full += sum(n * size for n, size in sizes)
    return full - full // world


def explain(asked: str, requested: SyncPolicy, extra: int, budget: int | None, source: str, *,
            world: int, keep_params: bool) -> tuple[SyncPolicy, str]:
    """The resolved policy and why: "auto" defers when the extra bytes fit the budget."""
    what = "unsharded gradients" + (" and parameters" if keep_params else "")
    cost = (f"deferring holds {human_bytes(extra)} ({extra} bytes) of extra {what} per rank "
            f"(full size minus this rank's 1/{world} shard)")
    if asked != "auto":
        return requested, f"{requested} (requested): {cost}"
    assert budget is not None
    policy: SyncPolicy = "defer" if extra <= budget else "every_step"
    fits = "fits" if policy == "defer" else "exceeds"
    return policy, (f"auto -> {policy}: {cost}, which {fits} the budget {human_bytes(budget)} "
                    f"({budget} bytes, {source})")
