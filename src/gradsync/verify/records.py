"""The folder ``gradsync verify`` records into: its variables and file names, and reading
it back (the meta, the readers of each data-parallel position)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

ENV_RECORD = "GRADSYNC_VERIFY"
"""The folder this run records into (set on both runs)."""
ENV_STEPS = "GRADSYNC_VERIFY_STEPS"
"""The optimizer steps (windows) to run before stopping."""
ENV_REPLAY = "GRADSYNC_VERIFY_REPLAY"
"""The launched run's folder, whose batches the reference replays (the reference only)."""

META = "meta.json"
"""Rank 0's record of the run: the steps' losses and bytes, what was set, why it stopped."""


def batches_file(rank: int) -> str:
    """The file a rank's loader records go to.

    Args:
        rank: the rank.

    Returns:
        The file's name in the run's folder.
    """
    return f"batches-rank{rank}.pt"


def params_file(step: int) -> str:
    """The file of the trained models' state dicts after ``step`` windows (0: before any).

    Args:
        step: windows completed.

    Returns:
        The file's name in the run's folder.
    """
    return f"params-{step}.pt"


def read_meta(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """A run's ``meta.json``.

    Args:
        folder: the run's folder.

    Returns:
        Its content ({} when it was never written).
    """
    path = Path(folder) / META
    if not path.is_file():
        return {}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def readers(data_ranks: list[int], size: int) -> list[list[int]]:
    """The ranks of each data-parallel position, from each rank's place among them.

    Args:
        data_ranks: each rank's data-parallel rank, in rank order.
        size: the data-parallel size.

    Returns:
        Per data-parallel position, the ranks that read its micro-batches (a tensor-parallel
        group), in rank order.
    """
    return [[r for r, d in enumerate(data_ranks) if d == position] for position in range(size)]


def _same(a: Any, b: Any) -> bool:
    """Two recorded batches are equal: the same structure, tensors equal in dtype, shape and
    every element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    try:
        return bool(a == b)
    except Exception:  # an object without a truth value for ==
        return False


def _first_difference(
    ours: list[list[dict[str, Any]]], theirs: list[list[dict[str, Any]]]
) -> str | None:
    """Where two ranks' recorded loaders differ ("prepared loader L, pass P, batch B"), or None."""
    if len(ours) != len(theirs):
        return f"{len(ours)} and {len(theirs)} prepared loaders"
    for i, (a_passes, b_passes) in enumerate(zip(ours, theirs)):
        for p, (a, b) in enumerate(zip(a_passes, b_passes)):
            where = f"prepared loader {i + 1}, pass {p + 1}"
            for n, (x, y) in enumerate(zip(a["batches"], b["batches"])):
                if not _same(x, y):
                    return f"{where}, batch {n + 1}"
            if len(a["batches"]) != len(b["batches"]):
                return f"{where}: {len(a['batches'])} and {len(b['batches'])} batches"
    return None


def mismatched_readers(folder: str | os.PathLike[str]) -> str | None:
    """Why the launched run's batches cannot be replayed as one per data-parallel position:
    the ranks of a tensor-parallel group read different micro-batches (or left no record).

    Args:
        folder: the launched run's folder.

    Returns:
        One line saying which ranks differ where, and what to change; None when every group
        read alike (or every rank is its own data-parallel position).
    """
    groups = read_meta(folder).get("readers") or []
    if all(len(g) < 2 for g in groups):
        return None
    loaded: dict[int, list[list[dict[str, Any]]]] = {}
    for group in groups:
        for rank in group:
            path = Path(folder) / batches_file(rank)
            if not path.is_file():
                return f"the launched run left no {path.name} (rank {rank} recorded nothing)"
            loaded[rank] = torch.load(path, weights_only=False)["loaders"]
        first = group[0]
        for rank in group[1:]:
            where = _first_difference(loaded[first], loaded[rank])
            if where is not None:
                return (
                    f"ranks {first} and {rank} of one tensor-parallel group read different "
                    f"micro-batches ({where}), and they must read the same: build the same "
                    "dataset on every rank, prepare its loader with accel.prepare, and draw "
                    "no per-rank random numbers in it"
                )
    return None
