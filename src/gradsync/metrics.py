"""Metrics across ranks: gather, reduce, pad, over tensors and nested dicts / lists of them,
and gather of picklable objects.

Every function here is a collective: call it on every rank, in the same order. In one
process (no process group) each returns its input as one process would see it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gradsync._support.dist import DataParallel, all_gather_object, is_multiprocess
from gradsync.data.batches import tree_map
from gradsync.errors import ConfigError

if TYPE_CHECKING:
    from gradsync.data import LoaderIteration

#: What ``reduce`` takes as ``reduction``.
REDUCTIONS: tuple[str, ...] = ("sum", "mean", "max", "min", "none")


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


def gather_pieces(t: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every rank's ``t`` (a scalar counts as one row), in rank order; the first
    dimension may differ between ranks, the others must agree. ``group``: the ranks to
    gather from (None: every rank)."""
    t = _rows(t)
    if not is_multiprocess():
        return [t]
    world = dist.get_world_size(group)
    sizes = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    all_sizes = [torch.zeros_like(sizes) for _ in range(world)]
    dist.all_gather(all_sizes, sizes, group=group)
    lengths = [int(s.item()) for s in all_sizes]
    longest = max(lengths)
    padded = pad_rows(t, longest) if t.shape[0] < longest else t.contiguous()
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [piece[:n] for piece, n in zip(out, lengths)]


def gather(data: Any, group: Any = None) -> Any:
    """Each tensor of ``data`` from every rank (of ``group``), concatenated along the first
    dimension in rank order (a scalar becomes one row per rank)."""
    return apply(lambda t: torch.cat(gather_pieces(t, group)), data, "gather")


def gather_for_metrics(
    data: Any,
    iterating: LoaderIteration | None,
    world: int | DataParallel,
    use_gather_object: bool = False,
) -> Any:
    """``gather``, with the rows put back in the sampler's order and its end-of-pass padding
    dropped when ``data`` holds one row per sample of the batch ``iterating`` (the pass of a
    prepared loader being iterated) just yielded from a sample-sharded sampler. With no pass
    being iterated (between passes, or over a loader never prepared) nothing is dropped.

    With ``use_gather_object``, or when ``data`` holds anything but tensors (Accelerate's
    rule), the objects are gathered instead (``gather_object``); a list (or tuple) with one
    entry per sample of that batch comes back in the sampler's order with the padding
    dropped, exactly as the tensor rows do. A list longer than the batch on some rank is not
    one entry per sample: its lists are concatenated in rank order.

    Args:
        data: tensors (nested dicts / lists / tuples of them), or any picklable object.
        iterating: the pass of a prepared loader being iterated, if any
            (``LoaderContext.iterating``).
        world: the number of processes, or the data-parallel ranks (those that read
            distinct batches: on an N-D mesh those of this rank's tensor-parallel
            coordinate), whose group the data is gathered over.
        use_gather_object: gather ``data`` as objects even when it holds only tensors.

    Returns:
        The gathered tensors in ``data``'s structure, or on the object path a list.
    """
    group = world.group if isinstance(world, DataParallel) else None
    world = world.size if isinstance(world, DataParallel) else world
    cut = iterating.owner.dealt_remainder() if iterating is not None and iterating.last else None
    if cut is not None and world > 1:  # whole batches dealt: drop the last round's padding
        if use_gather_object or not _all_tensors(data):
            return gather_object(data, group)[:cut]
        return apply(lambda t: torch.cat(gather_pieces(t, group))[:cut], data, "gather_for_metrics")
    layout = iterating.owner.sample_layout(world) if iterating is not None else None
    if use_gather_object or not _all_tensors(data):
        if iterating is None or layout is None or world == 1 or not isinstance(data, list | tuple):
            return gather_object(data, group)
        pieces = [
            list(piece) if isinstance(piece, list | tuple) else [piece]
            for piece in all_gather_object(data, group)
        ]
        batch_size, total = layout
        if any(len(piece) > batch_size for piece in pieces):
            return [entry for piece in pieces for entry in piece]
        return [
            pieces[rank][row]
            for rank, row in sample_positions(
                [len(piece) for piece in pieces],
                batch_index=iterating.yielded - 1,
                batch_size=batch_size,
                total=total,
            )
        ]
    if iterating is None or layout is None or world == 1:
        return gather(data, group)
    batch_size, total = layout
    index = iterating.yielded - 1

    def one(t: torch.Tensor) -> torch.Tensor:
        return sampler_order(
            gather_pieces(t, group), batch_index=index, batch_size=batch_size, total=total
        )

    return apply(one, data, "gather_for_metrics")


def _all_tensors(data: Any) -> bool:
    """``data`` is a tensor or a nested dict / list / tuple with only tensors as leaves."""
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, list | tuple):
        return all(_all_tensors(value) for value in data)
    if isinstance(data, Mapping):
        return all(_all_tensors(value) for value in data.values())
    return False


def gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank (a collective).

    A list or tuple is concatenated with the other ranks' (rank 0's entries first); any
    other object comes back as a list of one per rank. Accelerate's ``gather_object``
    flattens whatever each rank gives (a string into its characters, a dict into its keys)
    and returns the object itself without a process group; here the result is that list in
    one process too.

    Args:
        obj: a picklable object; tensors in it travel pickled (through the CPU).
        group: the ranks to gather from (None: every rank).

    Returns:
        The list described above.
    """
    out: list[Any] = []
    for piece in all_gather_object(obj, group):
        if isinstance(piece, list | tuple):
            out.extend(piece)
        else:
            out.append(piece)
    return out


def reduce(
    data: Any, reduction: str = "sum", scale: float = 1.0, op: str | None = None, group: Any = None
) -> Any:
    """Each tensor of ``data`` reduced over ranks, as Accelerate's ``Accelerator.reduce``
    documents it, then multiplied by ``scale``.

    ``"sum"``, ``"mean"``, ``"max"`` and ``"min"`` give every rank the result (integer
    tensors are averaged, or scaled by a ``scale`` other than 1, as float64); ``"none"``
    runs no collective and gives this rank's own tensor (a copy). Accelerate's code differs
    from its documentation in two places, and gradsync follows the documentation: there
    ``scale`` is applied on XLA only and ``"none"`` still sums; here ``scale`` applies on
    every backend and ``"none"`` does not reduce.

    Args:
        data: a tensor, or dicts / lists / tuples of tensors.
        reduction: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"none"``.
        scale: a factor every result is multiplied by.
        op: the former name of ``reduction``, kept as an alias; it replaces the default
            ``"sum"``, and may be given with another ``reduction`` only when the two agree.
        group: the ranks to reduce over (None: every rank).

    Returns:
        The same structure with reduced tensors.

    Raises:
        ConfigError: an unknown reduction, or ``op`` and ``reduction`` that disagree.
    """
    name = "reduction"
    if op is not None:
        if reduction not in ("sum", op):
            raise ConfigError(
                f"reduce(reduction={reduction!r}, op={op!r}) disagree; op is the "
                "former name of reduction: give one of them"
            )
        reduction, name = op, "op"
    if reduction not in REDUCTIONS:
        raise ConfigError(
            f"reduce({name}={reduction!r}) is unknown; use one of "
            + ", ".join(repr(r) for r in REDUCTIONS)
        )
    torch_op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}.get(
        reduction, dist.ReduceOp.SUM
    )

    def one(t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        exact = out.is_floating_point() or out.is_complex()
        if not exact and (reduction == "mean" or scale != 1.0):
            out = out.double()
        if reduction != "none" and is_multiprocess():
            dist.all_reduce(out, op=torch_op, group=group)
            if reduction == "mean":
                out /= dist.get_world_size(group)
        if scale != 1.0:
            out *= scale
        return out

    return apply(one, data, "reduce")


def pad_rows(
    t: torch.Tensor, length: int, dim: int = 0, value: float = 0, first: bool = False
) -> torch.Tensor:
    """``t`` padded with ``value`` along ``dim`` to ``length`` (at the start when ``first``)."""
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    fill = torch.full(shape, value, dtype=t.dtype, device=t.device)
    return torch.cat([fill, t] if first else [t, fill], dim=dim)


def pad_across_processes(
    data: Any, dim: int = 0, pad_index: float = 0, pad_first: bool = False
) -> Any:
    """Each tensor of ``data`` padded along ``dim`` to the largest size any rank has there."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if not is_multiprocess() or t.dim() == 0:
            return t
        if not -t.dim() <= dim < t.dim():
            raise ConfigError(
                f"pad_across_processes(dim={dim}) is out of range for a {t.dim()}-d tensor"
            )
        size = torch.tensor([t.shape[dim]], dtype=torch.int64, device=t.device)
        dist.all_reduce(size, op=dist.ReduceOp.MAX)
        return pad_rows(t, int(size.item()), dim=dim, value=pad_index, first=pad_first)

    return apply(one, data, "pad_across_processes")


def sample_positions(
    lengths: Sequence[int], *, batch_index: int, batch_size: int, total: int
) -> list[tuple[int, int]]:
    """(rank, row) of each row gathered from one batch of a sample-sharded evaluation pass,
    in the sampler's order, the padding dropped; ``lengths`` holds each rank's row count.

    A ``DistributedSampler`` over ``total`` samples gives rank ``r`` the positions
    ``r, r + N, r + 2N, ...`` of its (padded) order, so row ``t`` of batch ``j`` on rank
    ``r`` sits at position ``(j * batch_size + t) * N + r``; positions from ``total`` on
    repeat earlier samples to even out the ranks, and are dropped.
    """
    world = len(lengths)
    placed: list[tuple[int, int, int]] = []
    for rank, length in enumerate(lengths):
        for t in range(length):
            position = (batch_index * batch_size + t) * world + rank
            if position < total:
                placed.append((position, rank, t))
    placed.sort()
    return [(rank, t) for _, rank, t in placed]


def sampler_order(
    pieces: Sequence[torch.Tensor], *, batch_index: int, batch_size: int, total: int
) -> torch.Tensor:
    """Rows gathered from one batch of a sample-sharded evaluation pass, put back in the
    sampler's order with the padding dropped (see ``sample_positions``)."""
    order = sample_positions(
        [piece.shape[0] for piece in pieces],
        batch_index=batch_index,
        batch_size=batch_size,
        total=total,
    )
    if not order:
        return pieces[0][:0]
    return torch.stack([pieces[rank][t] for rank, t in order])
