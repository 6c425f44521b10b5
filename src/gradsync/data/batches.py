"""Nested batches: one tree map over dicts, lists, tuples and namedtuples (used by the
loader's device moves and by the cross-rank metrics), row counts, splitting, item counts."""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch

from gradsync.errors import ConfigError


def tree_map(fn: Callable[[Any], Any], data: Any) -> Any:
    """``fn`` on every leaf of a nested structure (dicts, lists, tuples, namedtuples), keeping
    the structure; a leaf is anything else (a tensor, a number, a string, an object)."""
    if isinstance(data, torch.Tensor):  # the common leaf first: batches are mostly tensors
        return fn(data)
    if isinstance(data, list | tuple):
        items = []
        for value in data:
            items.append(tree_map(fn, value))
        if isinstance(data, tuple) and hasattr(data, "_fields"):  # a namedtuple
            return type(data)(*items)
        return type(data)(items)
    if isinstance(data, Mapping):
        mapped = {}
        for key, value in data.items():
            mapped[key] = tree_map(fn, value)
        try:
            return type(data)(mapped)  # type: ignore[call-arg]
        except TypeError:
            return mapped
    return fn(data)


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if hasattr(value, "to") and callable(value.to):
        return value.to(device)
    return value


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of ``batch`` (and anything else with a ``.to``) moved to ``device``."""
    return tree_map(functools.partial(_move, device=device), batch)


def batch_length(batch: Any) -> int:
    """Rows in a batch: the first dimension of its first tensor (nested structures allowed)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        for value in batch.values():
            return batch_length(value)
    if isinstance(batch, list | tuple) and batch:
        return batch_length(batch[0])
    raise ConfigError(
        f"cannot tell how many rows a {type(batch).__name__} batch holds; batches must hold "
        "tensors (or dicts / lists / tuples of them) whose first dimension is the batch"
    )


def split_batch(batch: Any, size: int) -> list[Any]:
    """``batch`` cut along the first dimension into pieces of ``size`` rows (the last may be
    smaller); every tensor of a nested structure is cut alike, other values are repeated."""
    rows = batch_length(batch)
    starts = range(0, rows, size)

    def cut(value: Any, start: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
            return value[start : start + size]
        if isinstance(value, Mapping):
            return type(value)({k: cut(v, start) for k, v in value.items()})  # type: ignore[call-arg]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(cut(v, start) for v in value))
        if isinstance(value, list | tuple):
            plain = len(value) == rows and all(isinstance(v, int | float | str) for v in value)
            if plain:  # one value per row (ids, texts): cut like a tensor
                return type(value)(value[start : start + size])
            return type(value)(cut(v, start) for v in value)
        return value

    return [cut(batch, start) for start in starts]


def checked_count(value: Any, where: str) -> int:
    """An item count as a plain int >= 0, or a ConfigError naming the value and the batch."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.is_complex():
            raise ConfigError(
                f"count_items returned {value!r} for {where}; it must return one whole number "
                "(an int or a one-element integer tensor), the items (e.g. tokens) in the batch"
            )
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(
            f"count_items returned {value!r} ({type(value).__name__}) for {where}; it must "
            "return a whole number >= 0, the items (e.g. tokens) in the batch"
        )
    if value < 0:
        raise ConfigError(f"count_items returned {value} for {where}; a count must be >= 0")
    return int(value)


def halves(batch: Any) -> list[Any]:
    """``batch`` cut into two pieces along the first dimension (the first one row longer
    when the rows are odd; one piece when it has a single row)."""
    rows = batch_length(batch)
    return split_batch(batch, max(1, -(-rows // 2)))


def pieces(batch: Any, split: int) -> list[Any]:
    """``batch`` halved ``log2(split)`` times: the micro-batches it becomes when every
    micro-batch is ``split`` times smaller (``split`` a power of 2). Halving a piece again
    gives the pieces of ``2 * split``, so a pass can be split further midway."""
    out = [batch]
    while split > 1:
        out = [half for piece in out for half in halves(piece)]
        split //= 2
    return out
