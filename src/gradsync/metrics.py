"""Metrics across ranks: gather, reduce, pad, over tensors and nested dicts / lists of them.

Every function here is a collective: call it on every rank, in the same order. In one
process (no process group) each returns its input as one process would see it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from gradsync.data.batches import tree_map
from gradsync.dist import is_multiprocess
from gradsync.errors import ConfigError

if TYPE_CHECKING:
    from gradsync.data import LoaderIteration

ReduceOp = Literal["sum", "mean"]


def apply(fn: Callable[[torch.Tensor], Any], data: Any, what: str) -> Any:
    """``fn`` on every tensor of a nested structure (dicts, lists, tuples), keeping its shape;
    anything else in it is a TypeError naming ``what``."""

    def leaf(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{what} takes tensors and dicts / lists / tuples of tensors, not a "
                f"{type(value).__name__}; wrap numbers with torch.tensor(...)"
            )
        return fn(value)

    return tree_map(leaf, data)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(0) if t.dim() == 0 else t


def gather_pieces(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (a scalar counts as one row), in rank order; the first
    dimension may differ between ranks, the others must agree."""
    t = _rows(t)
    if not is_multiprocess():
        return [t]
    world = dist.get_world_size()
    sizes = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    all_sizes = [torch.zeros_like(sizes) for _ in range(world)]
    dist.all_gather(all_sizes, sizes)
    lengths = [int(s.item()) for s in all_sizes]
    longest = max(lengths)
    padded = pad_rows(t, longest) if t.shape[0] < longest else t.contiguous()
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return [piece[:n] for piece, n in zip(out, lengths)]


def gather(data: Any) -> Any:
    """Each tensor of ``data`` from every rank, concatenated along the first dimension in
    rank order (a scalar becomes one row per rank)."""
    return apply(lambda t: torch.cat(gather_pieces(t)), data, "gather")


def gather_for_metrics(data: Any, last_pass: LoaderIteration | None, world: int) -> Any:
    """``gather``, with the rows put back in the sampler's order and its end-of-pass padding
    dropped when ``data`` holds one row per sample of the batch ``last_pass`` (the pass of a
    prepared loader that yielded last) just yielded from a sample-sharded sampler."""
    layout = last_pass.owner.sample_layout(world) if last_pass is not None else None
    if last_pass is None or layout is None or world == 1:
        return gather(data)
    batch_size, total = layout
    index = last_pass.yielded - 1

    def one(t: torch.Tensor) -> torch.Tensor:
        return sampler_order(gather_pieces(t), batch_index=index, batch_size=batch_size, total=total)

    return apply(one, data, "gather_for_metrics")


def reduce(data: Any, op: str = "sum") -> Any:
    """Each tensor of ``data`` summed (``op="sum"``) or averaged (``"mean"``) over ranks."""
    if op not in ("sum", "mean"):
        raise ConfigError(f"reduce(op={op!r}) is unknown; use 'sum' or 'mean'")

    def one(t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        if op == "mean" and not (out.is_floating_point() or out.is_complex()):
            out = out.double()
        if is_multiprocess():
            dist.all_reduce(out)
            if op == "mean":
                out /= dist.get_world_size()
        return out

    return apply(one, data, "reduce")


def pad_rows(t: torch.Tensor, length: int, dim: int = 0, value: float = 0, first: bool = False) -> torch.Tensor:
    """``t`` padded with ``value`` along ``dim`` to ``length`` (at the start when ``first``)."""
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    fill = torch.full(shape, value, dtype=t.dtype, device=t.device)
    return torch.cat([fill, t] if first else [t, fill], dim=dim)


def pad_across_processes(data: Any, dim: int = 0, pad_index: float = 0, pad_first: bool = False) -> Any:
    """Each tensor of ``data`` padded along ``dim`` to the largest size any rank has there."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if not is_multiprocess() or t.dim() == 0:
            return t
        if not -t.dim() <= dim < t.dim():
            raise ConfigError(f"pad_across_processes(dim={dim}) is out of range for a {t.dim()}-d tensor")
        size = torch.tensor([t.shape[dim]], dtype=torch.int64, device=t.device)
        dist.all_reduce(size, op=dist.ReduceOp.MAX)
        return pad_rows(t, int(size.item()), dim=dim, value=pad_index, first=pad_first)

    return apply(one, data, "pad_across_processes")


def sampler_order(pieces: Sequence[torch.Tensor], *, batch_index: int, batch_size: int, total: int) -> torch.Tensor:
    """Rows gathered from one batch of a sample-sharded evaluation pass, put back in the
    sampler's order with the padding dropped.

    A ``DistributedSampler`` over ``total`` samples gives rank ``r`` the positions
    ``r, r + N, r + 2N, ...`` of its (padded) order, so row ``t`` of batch ``j`` on rank
    ``r`` sits at position ``(j * batch_size + t) * N + r``; positions from ``total`` on
    repeat earlier samples to even out the ranks, and are dropped.
    """
    world = len(pieces)
    placed: list[tuple[int, torch.Tensor]] = []
    for rank, piece in enumerate(pieces):
        for t in range(piece.shape[0]):
            position = (batch_index * batch_size + t) * world + rank
            if position < total:
                placed.append((position, piece[t]))
    placed.sort(key=lambda item: item[0])
    if not placed:
        return pieces[0][:0]
    return torch.stack([row for _, row in placed])
