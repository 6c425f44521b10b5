"""The only place that reads or writes the state of torch's PowerSGD communication hooks
(``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``).

What gradsync relies on, per ``PowerSGDState`` (tested in tests/unit/test_comm_hook_unit.py
and by the bitwise resume of tests/multiprocess/test_comm_hook.py):

* ``_orthogonalize`` takes the batched hook's 2-D matrices (``batched_hook_works``);
* ``iter`` (optimizer steps seen by the hook), ``rng`` (a numpy ``RandomState`` that seeds new
  Q matrices), ``total_numel_before_compression`` / ``total_numel_after_compression`` /
  ``next_stats_report`` (its statistics);
* ``error_dict[bucket]``: this rank's error feedback, one flat tensor per DDP bucket in the
  bucket's parameter order (``batched_powerSGD_hook``: padded to a square);
* ``p_memory_dict[bucket]`` / ``q_memory_dict[bucket]``: the warm-start matrices, written in
  place by the hook. For ``powerSGD_hook`` they hold one P (n x r) and one Q (m x r) per
  parameter it compresses (a parameter viewed as ``n x m = shape[0] x rest``, ``r =
  min(n, m, rank)``, compressed when ``(n + m) * r * min_compression_rate < n * m``), grouped
  by matrix shape in the order each shape first occurs in the bucket; for
  ``batched_powerSGD_hook`` one P and one Q for the whole bucket.

The state is keyed by bucket, and DDP changes its buckets once (it rebuilds them in the order
the gradients became ready, after the first synchronised backward): a process that resumes
from a checkpoint starts with the first layout, not the one the state was saved with. So the
state travels with each bucket's layout (the parameters' names and shapes) and is put back
per parameter where a live bucket's layout differs (``install``). The batched hook's matrices
span the whole bucket and cannot be cut per parameter: under another layout they start again.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from gradsync.errors import ConfigError

log = logging.getLogger("gradsync")

#: A bucket's layout: each parameter's name and shape, in the bucket's order.
Layout = tuple[tuple[str, tuple[int, ...]], ...]
_STATS = ("total_numel_before_compression", "total_numel_after_compression", "next_stats_report")


def make_state(
    options: dict[str, Any], group: dist.ProcessGroup | None = None
) -> powerSGD_hook.PowerSGDState:
    """A ``PowerSGDState`` over ``group`` (None: the world's); torch's refusal of ``options``
    as one line."""
    try:
        return powerSGD_hook.PowerSGDState(group, **options)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"comm_state_option={options!r}: {err}") from None


def batched_hook_works() -> bool:
    """Whether torch's ``batched_powerSGD_hook`` can compress here: it orthogonalizes its
    2-D matrices with the helper the unbatched hook uses, which some releases (2.13) take
    only as batches of matrices (3-D), so the batched hook fails at its first compressing
    step there. Tried on a 2-D matrix, as that hook calls it."""
    try:
        powerSGD_hook._orthogonalize(torch.ones(2, 1))
    except (AssertionError, RuntimeError, IndexError, ValueError):
        return False
    return True


def _rng_state(state: Any) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = state.rng.get_state()
    return {
        "name": name,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _set_rng(state: Any, saved: dict[str, Any]) -> None:
    keys = saved["keys"].numpy().astype(np.uint32)
    state.rng.set_state(
        (saved["name"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"])
    )


def capture(
    state: Any, layouts: dict[int, Layout], pending: list[dict[str, Any]]
) -> dict[str, Any]:
    """Everything of ``state`` that later steps depend on, as plain data and CPU tensors: its
    counters and RNG, and per bucket its layout (``layouts``) with its error and matrices;
    ``pending`` (buckets loaded and not yet met again) go along as they are."""
    buckets = []
    for index in sorted(set(state.error_dict) | set(state.p_memory_dict)):
        part: dict[str, Any] = {"layout": [list(x) for x in layouts.get(index, ())]}
        for key, table in (("error", state.error_dict), ("p", state.p_memory_dict)):
            if index in table:
                part[key] = table[index].detach().to("cpu", copy=True)
        if index in state.q_memory_dict:
            part["q"] = state.q_memory_dict[index].detach().to("cpu", copy=True)
        buckets.append(part)
    return {
        "iter": int(state.iter),
        "rng": _rng_state(state),
        "stats": [int(getattr(state, name)) for name in _STATS],
        "buckets": buckets + [dict(p) for p in pending],
    }


def restore(state: Any, saved: dict[str, Any]) -> list[dict[str, Any]]:
    """Put ``saved`` (from ``capture``) back into ``state``: counters and RNG at once; the
    buckets are returned, to be installed as the hook meets each live bucket (``install``)."""
    state.iter = saved["iter"]
    _set_rng(state, saved["rng"])
    for name, value in zip(_STATS, saved["stats"]):
        setattr(state, name, value)
    state.error_dict.clear()
    state.p_memory_dict.clear()
    state.q_memory_dict.clear()
    return [dict(b, layout=_layout(b["layout"])) for b in saved["buckets"]]


def _layout(raw: Any) -> Layout:
    return tuple((str(name), tuple(int(n) for n in shape)) for name, shape in raw)


def take(state: Any, layouts: dict[int, Layout]) -> list[dict[str, Any]]:
    """Move every bucket's error and matrices out of ``state`` with its layout (the buckets
    are about to change): the pending buckets ``install`` puts back."""
    out = []
    for index in sorted(set(state.error_dict) | set(state.p_memory_dict)):
        part: dict[str, Any] = {"layout": layouts.get(index, ())}
        for key, table in (
            ("error", state.error_dict),
            ("p", state.p_memory_dict),
            ("q", state.q_memory_dict),
        ):
            if index in table:
                part[key] = table.pop(index)
        out.append(part)
    return out


def install(
    state: Any,
    index: int,
    layout: Layout,
    pending: list[dict[str, Any]],
    *,
    batched: bool,
    device: torch.device,
) -> None:
    """Give live bucket ``index`` (of ``layout``, on ``device``) its state from ``pending``:
    as saved when a pending bucket has the same layout, else cut per parameter and joined in
    this layout's order (the batched hook's matrices then start again, said once)."""
    for part in pending:
        if part["layout"] == layout:
            for key, table in (
                ("error", state.error_dict),
                ("p", state.p_memory_dict),
                ("q", state.q_memory_dict),
            ):
                if key in part:
                    table[index] = part[key].to(device, copy=True)
            return
    pieces = _pieces(pending, state, batched=batched)
    names = [name for name, _ in layout]
    if state.use_error_feedback and all(n in pieces["error"] for n in names):
        error = torch.cat([pieces["error"][n].reshape(-1) for n in names])
        total = error.numel()
        if batched:  # padded to a square, as the batched hook pads its bucket
            side = math.ceil(math.sqrt(total))
            error = torch.cat([error, error.new_zeros(side * side - total)])
        state.error_dict[index] = error.to(device)
    if batched:
        if state.warm_start and any(part.get("p") is not None for part in pending):
            log.warning(
                "gradsync: batched_power_sgd's warm-start matrices were saved for another DDP "
                "bucket layout and start again (comm_hook='power_sgd' resumes exactly)"
            )
        return
    order = _compressed(layout, state)
    if state.warm_start and order and all(n in pieces["p"] for n, _, _ in order):
        state.p_memory_dict[index] = torch.cat([pieces["p"][n] for n, _, _ in order]).to(device)
        state.q_memory_dict[index] = torch.cat([pieces["q"][n] for n, _, _ in order]).to(device)


def _compressed(layout: Layout, state: Any) -> list[tuple[str, int, int]]:
    """The parameters ``powerSGD_hook`` compresses in a bucket of ``layout``, in the order of
    their P and Q in its memory: (name, P's size, Q's size)."""
    groups: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for name, shape in layout:
        if not shape:
            continue
        n = shape[0]
        m = math.prod(shape) // n if n else 0
        rank = min(n, m, state.matrix_approximation_rank)
        if (n + m) * rank * state.min_compression_rate < n * m:
            groups.setdefault((n, m), []).append((name, n * rank, m * rank))
    return [entry for group in groups.values() for entry in group]


def _pieces(
    pending: list[dict[str, Any]], state: Any, *, batched: bool
) -> dict[str, dict[str, Any]]:
    """Each pending bucket's error (and, unbatched, its P and Q) cut per parameter."""
    out: dict[str, dict[str, Any]] = {"error": {}, "p": {}, "q": {}}
    for part in pending:
        layout = part["layout"]
        if "error" in part:
            offset = 0
            for name, shape in layout:
                size = math.prod(shape)
                out["error"][name] = part["error"][offset : offset + size]
                offset += size
        if batched or "p" not in part:
            continue
        p_at = q_at = 0
        for name, p_size, q_size in _compressed(layout, state):
            out["p"][name] = part["p"][p_at : p_at + p_size]
            out["q"][name] = part["q"][q_at : q_at + q_size]
            p_at, q_at = p_at + p_size, q_at + q_size
    return out


def snapshot(state: Any) -> dict[str, Any]:
    """A copy of ``state`` to go back to when a window is dropped (``put_back``)."""
    return {
        "iter": state.iter,
        "rng": state.rng.get_state(),
        "stats": [getattr(state, name) for name in _STATS],
        "tables": [
            {k: v.clone() for k, v in table.items()}
            for table in (state.error_dict, state.p_memory_dict, state.q_memory_dict)
        ],
    }


def put_back(state: Any, snap: dict[str, Any]) -> None:
    """``state`` as it was when ``snap`` was taken."""
    state.iter = snap["iter"]
    state.rng.set_state(snap["rng"])
    for name, value in zip(_STATS, snap["stats"]):
        setattr(state, name, value)
    for table, saved in zip(
        (state.error_dict, state.p_memory_dict, state.q_memory_dict), snap["tables"]
    ):
        table.clear()
        table.update(saved)
