"""The memory budget that ``sync_policy="auto"`` weighs deferral against, on every sharded
backend (FSDP2, DeepSpeed ZeRO 2/3): one rule, one option (``sync_memory_budget``).

Deferring the gradient reduction of a sharded backend holds each rank's full local
gradients (and, on FSDP2 when asked, its full parameters) until the boundary instead of
its shard. ``auto`` defers when those extra bytes fit the budget: the option when set,
else a share of the free memory, the smallest over the ranks (the ranks must agree).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from gradsync._support import dist
from gradsync._support.util import human_bytes

#: The share of free memory (device memory, or available RAM split over local ranks) that
#: "auto" lets the deferred, unsharded state take.
AUTO_BUDGET_FRACTION = 0.25


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


@dataclass(frozen=True)
class Budget:
    """Bytes per rank that deferral may hold, and where the number came from."""

    nbytes: int
    source: str  # "sync_memory_budget", or "25% of available RAM / 2 local rank(s), min over ranks"

    def describe(self) -> str:
        return f"{human_bytes(self.nbytes)} ({self.nbytes} bytes, {self.source})"


def agreed_budget(given: int | None, name: str, device: torch.device) -> Budget:
    """The budget: ``given`` (set by the option ``name``), else a share of the free memory,
    the smallest over the ranks (a collective: call it on every rank)."""
    if given is not None:
        return Budget(given, name)
    free, where = available_memory(device)
    share = dist.min_over_ranks(int(free * AUTO_BUDGET_FRACTION), device)
    return Budget(share, f"{AUTO_BUDGET_FRACTION:.0%} of {where}, min over ranks")


def extra_text(extra: int, what: str, world: int, *, gathered: bool = False) -> str:
    """'deferring holds 1.4 KiB (1410 bytes) of extra <what> per rank (...)'; ``gathered``:
    the parameters stay gathered too, all of their bytes beside the shard."""
    how = (
        f"the gradients' full size minus this rank's 1/{world} shard, plus the whole gathered "
        "parameters"
        if gathered
        else f"full size minus this rank's 1/{world} shard"
    )
    return f"deferring holds {human_bytes(extra)} ({extra} bytes) of extra {what} per rank ({how})"
