"""Rank, world and the few collectives gradsync itself needs, with or without a process group.

Every module that asks "is there a group?", "which rank am I?" or needs rank 0's value on
every rank asks here. Rank and world come from one function, :func:`rank_info`: where no
group exists yet it reads the launch environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradsync._support import environment
from gradsync._support import torch_compat as _torch_compat


def is_distributed() -> bool:
    """A process group exists in this process."""
    return dist.is_available() and dist.is_initialized()


def is_multiprocess() -> bool:
    """A process group of more than one rank exists."""
    return is_distributed() and dist.get_world_size() > 1


def rank_info() -> tuple[int, int, int]:
    """(rank, world size, local rank) of this process: the group's rank and size where there is
    one, else what the launcher or scheduler says (``gradsync._support.environment``: torchrun, SLURM,
    MPI, Kubeflow; one process when nothing says otherwise)."""
    where = environment.detect()
    if is_distributed():
        return dist.get_rank(), dist.get_world_size(), where.local_rank
    return where.rank, where.world_size, where.local_rank


def rank() -> int:
    """This process's rank (0 without a group)."""
    return rank_info()[0]


def world_size() -> int:
    """The number of processes (1 without a group)."""
    return rank_info()[1]


@dataclass(frozen=True)
class DataParallel:
    """The ranks that read distinct micro-batches: this rank's place among them (``rank``),
    how many (``size``) and their process group (``group``; None: the world's). On an N-D
    mesh they are the dp_replicate x dp_shard ranks of one tensor-parallel coordinate; the
    backend says (``Backend.data_parallel``), and the data, item counts, window loss and
    metrics read it."""

    rank: int
    size: int
    group: Any = None


def world_data_parallel() -> DataParallel:
    """Every rank reads its own micro-batches (plain data parallelism)."""
    me, world, _ = rank_info()
    return DataParallel(me, world)


def barrier() -> None:
    """Wait for every rank (nothing to wait for without a group)."""
    if is_distributed():
        dist.barrier()


def broadcast_object(value: Any) -> Any:
    """Rank 0's ``value`` (a picklable object) on every rank."""
    if not is_multiprocess():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value`` (a picklable object), in rank order (of ``group``; None: the
    world)."""
    if not is_multiprocess():
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when ``flag`` is true on any rank (one small all-reduce)."""
    if not is_multiprocess():
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest ``value`` over the ranks (one small all-reduce)."""
    if not is_multiprocess():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def missing_ranks(name: str, timeout_s: float) -> list[int]:
    """Mark this rank as arrived at ``name`` and wait up to ``timeout_s`` seconds for every
    other rank to arrive there too, through the group's key-value store: no collective, so a
    rank that never arrives costs the wait, not a hang. ``name`` must be new for each meeting.

    Returns:
        The ranks that did not arrive in time (empty when every rank did). This rank's mark
        is withdrawn then, so that the same ``name`` can be met again.
    """
    if not is_multiprocess():
        return []
    store = _torch_compat.default_store()
    me, world = dist.get_rank(), dist.get_world_size()
    key = f"gradsync/arrived/{name}/"
    store.set(f"{key}{me}", b"1")
    others = [f"{key}{r}" for r in range(world) if r != me]
    try:
        store.wait(others, timedelta(seconds=timeout_s))
        return []
    except dist.DistStoreError:
        missing = [r for r in range(world) if r != me and not store.check([f"{key}{r}"])]
        store.delete_key(f"{key}{me}")
        return missing
