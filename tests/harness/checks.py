"""Parent-side checks of the multi-process tests: the one-process references the ranks' results
must equal, and the assertions several test modules share on what the scenarios recorded.

Nothing here runs in a worker: the scenarios (``scenarios.*``) record, this module judges.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradsync import audit

from scenarios.amp import poison
from scenarios.common import Indexed, make_model, make_optimizer, make_scheduler, to_lists
from scenarios.pipelines import make_branchy


def reference(
    rank_results: list[dict[str, Any]],
    *,
    samples: int,
    optimizer: str = "sgd",
    lr: float = 0.05,
    clip: float | None = None,
    clip_value: float | None = None,
    model: nn.Module | None = None,
) -> dict[str, Any]:
    """One process training on the same global windows: each window's loss is the mean, over
    ranks and micro-batches, of the micro-batch mean losses (the global sample mean when all
    micro-batches have equal size)."""
    data = Indexed(samples)
    model = model if model is not None else make_model()
    opt = make_optimizer(model.parameters(), optimizer, lr)
    sched = make_scheduler(opt)
    n_windows = len(rank_results[0]["windows"])
    for r in rank_results:
        assert len(r["windows"]) == n_windows, "ranks took different numbers of optimizer steps"
    norms: list[float] = []
    for w in range(n_windows):
        micro = [mb for r in rank_results for mb in r["windows"][w]]
        opt.zero_grad()
        loss = sum(F.mse_loss(model(data.x[mb]), data.y[mb]) for mb in micro) / len(micro)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        opt.step()
        sched.step()
    return {"state": to_lists(model.state_dict()), "norms": norms}


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max()) for k in a)


def assert_matches_one_process(
    rank_results: list[dict[str, Any]], **reference_kwargs: Any
) -> dict[str, Any]:
    """Every rank's final parameters equal one process on the same windows (fp32, 1e-5),
    and the ranks agree exactly; returns the reference for further checks."""
    ref = reference(rank_results, **reference_kwargs)
    for r in rank_results:
        assert max_diff(r["state"], ref["state"]) < 1e-5
    assert max_diff(rank_results[0]["state"], rank_results[1]["state"]) == 0.0
    return ref


def data_ranks(rank_results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """On an N-D mesh: one rank per data-parallel rank (tp coordinate 0), in data-parallel
    order (the ranks of a tp group read the same micro-batches: counted once)."""
    chosen = sorted((r for r in rank_results if r["coords"][2] == 0), key=lambda r: r["data_rank"])
    assert [r["data_rank"] for r in chosen] == list(range(rank_results[0]["data_size"]))
    return chosen


def assert_nd_matches_one_process(
    rank_results: list[dict[str, Any]], tolerance: float = 1e-5, **reference_kwargs: Any
) -> dict[str, Any]:
    """Every rank of an N-D mesh ends with the parameters of one process trained on the data
    ranks' global windows (within ``tolerance``), and all ranks agree exactly."""
    ref = reference(data_ranks(rank_results), **reference_kwargs)
    for r in rank_results:
        assert max_diff(r["state"], ref["state"]) < tolerance
        assert max_diff(r["state"], rank_results[0]["state"]) == 0.0
    return ref


def assert_dropped_window_leaks_nothing(
    rank_results: list[dict[str, Any]], **reference_kwargs: Any
) -> None:
    """A dropped window was really dropped mid-way (it held micro-batches), nothing of it
    reached the parameters: they equal one process that never saw its micro-batches."""
    for r in rank_results:
        assert len(r["dropped"]) == 1 and len(r["dropped"][0]) >= 1, r["dropped"]
        assert r["optimizer_steps"] == len(r["windows"]) == r["scheduler_last_epoch"]
    assert_matches_one_process(rank_results, **reference_kwargs)


def assert_clipping_matches_one_process(rank_results: list[dict[str, Any]], samples: int) -> None:
    """The norms clip_grad_norm_ returned at each boundary, and the final parameters, equal one
    process clipping the same windows (Adam, lr 0.01, max_norm 0.5), and really clipped."""
    ref = reference(rank_results, samples=samples, optimizer="adam", lr=0.01, clip=0.5)
    assert rank_results[0]["norms"] == rank_results[1]["norms"]
    assert any(n > 0.5 for n in ref["norms"]), "the test must actually clip"
    for r in rank_results:
        assert len(r["norms"]) == len(ref["norms"]) == r["optimizer_steps"]
        assert max(abs(a - b) for a, b in zip(r["norms"], ref["norms"])) < 1e-5
        assert max_diff(r["state"], ref["state"]) < 1e-5


def assert_mid_window_save_refused(rank_results: list[dict[str, Any]], backend: str) -> None:
    """What ``mid_window_save_refused`` recorded: both kinds of save (default,
    background=True) two micro-steps into a window are one line that says to save at a
    boundary, on both ranks, with no folder left; at the boundary both save, the background
    one is committed, and it loads back."""
    for rank in rank_results:
        for background in (False, True):
            message = rank[f"mid_background_{background}"]
            assert message.startswith(
                "UsageError: save_state() inside an accumulation window is not "
                f"supported with backend='{backend}'"
            ), message
            assert "call it at a boundary" in message and "\n" not in message
        assert rank["left_after_refusal"] == []
        assert [p.rsplit("/", 1)[-1] for p in rank["boundary_saves"]] == [
            "b-default",
            "b-background",
        ]
        assert rank["committed"].endswith("b-background")
        assert rank["after"] == ["b-background", "b-default"]
        assert rank["restored"] is True


def assert_export_is_the_gathered_model(rank_results: list[dict[str, Any]]) -> None:
    """What ``export_model`` recorded: every rank got the folder, which holds one safetensors
    file (no config: a plain module) equal to the gathered state dict, with the tied weight
    written once and named in the metadata."""
    rank0 = rank_results[0]
    assert rank0["files"] == ["model.safetensors"], rank0
    assert rank0["keys"] == ["embed.weight", "mid.bias", "mid.weight"], rank0
    assert rank0["tied"] == {"head.weight": "embed.weight"}
    assert rank0["equal_to_gathered"] is True and rank0["trained"] is True
    assert all(r["path_name"] == "export" for r in rank_results)


def reference_amp(
    rank_results: list[dict[str, Any]],
    *,
    samples: int,
    optimizer: str = "sgd",
    lr: float = 0.05,
    clip: float | None = None,
    clip_value: float | None = None,
    poison_window: int | None = None,
    spike_window: int | None = None,
    poison_rank: int = 1,
    grad_scaler: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One process on the same global windows under the same fp16 autocast and GradScaler:
    each micro-batch's loss divided by the window's micro-batch count, scaled, backward;
    at the window's end unscale, clip, step (skipped on inf/NaN), update."""
    data = Indexed(samples)
    model = make_model()
    opt = make_optimizer(model.parameters(), optimizer, lr)
    sched = make_scheduler(opt)
    scaler = torch.amp.GradScaler("cpu", **(grad_scaler or {}))
    skipped, scales, norms = [], [], []
    for w in range(len(rank_results[0]["windows"])):
        micro = [mb for r in rank_results for mb in r["windows"][w]]
        spiked = sum(len(r["windows"][w]) for r in rank_results[:poison_rank]) + 1
        opt.zero_grad()
        for i, mb in enumerate(micro):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(data.x[mb]), data.y[mb])
            loss = loss * (1e9 if w == spike_window and i == spiked else 1.0)
            scaler.scale(loss / len(micro)).backward()
        if w == poison_window:
            poison(model)
        scaler.unscale_(opt)
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
        if not skipped[-1]:
            sched.step()
        scales.append(scaler.get_scale())
    return {
        "state": to_lists(model.state_dict()),
        "skipped": skipped,
        "scales": scales,
        "norms": norms,
        "last_epoch": sched.last_epoch,
    }


def unused_reference(rank_results: list[dict[str, Any]], *, samples: int = 40) -> dict[str, Any]:
    """One process on the same windows (the side head in the same micro-batches)."""
    data = Indexed(samples)
    model = make_branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for w in range(len(rank_results[0]["windows"])):
        micro = [mb for r in rank_results for mb in r["windows"][w]]
        opt.zero_grad()
        loss = sum(
            F.mse_loss(model(data.x[mb[:-1]], side=mb[-1] == -1), data.y[mb[:-1]]) for mb in micro
        )
        (loss / len(micro)).backward()
        opt.step()
    return {"state": to_lists(model.state_dict())}


SCALAR_BYTES = 64  # a reduction this small is a scalar (norm, overflow flag), not gradients
SCALAR_SLACK = 256  # all the scalar reductions of one boundary together stay below this


def reductions(ops: list[list[Any]]) -> list[int]:
    """The payload of each reduction among a micro-step's collectives (op, bytes)."""
    return [nbytes for op, nbytes in ops if op in audit.REDUCTIONS]


def assert_one_gradient_reduction(ops: list[list[Any]], grad_bytes: int) -> None:
    """Exactly one gradient-sized reduction carrying all the gradients; the rest are scalars."""
    sizes = reductions(ops)
    gradient_sized = [b for b in sizes if b > SCALAR_BYTES]
    assert len(gradient_sized) == 1, f"want one reduction of the gradients, got {gradient_sized}"
    assert grad_bytes <= gradient_sized[0] <= grad_bytes + SCALAR_SLACK, (
        gradient_sized,
        grad_bytes,
    )
    assert sum(sizes) <= grad_bytes + SCALAR_SLACK, (sizes, grad_bytes)


def pipeline_reference(
    rank_results: list[dict[str, Any]],
    *,
    samples: int,
    clip: float | None = None,
    tokens: bool = False,
) -> dict[str, Any]:
    """One process training the whole ``scenarios.pp`` model on the same global windows as a
    pipelined run: each window's loss is the mean of its micro-batch mean losses over the
    data-parallel ranks (read from the first stage's ranks); with ``tokens`` the summed
    masked loss over the window's counted items."""
    from scenarios.pp import make_seq, masked_sse

    data = Indexed(samples)
    by_data = {r["data_rank"]: r for r in rank_results if r["stage"] == 0}  # one per tp group
    firsts = [by_data[d] for d in sorted(by_data)]
    assert sorted(by_data) == list(range(rank_results[0]["data_size"]))
    model = make_seq()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    norms: list[float] = []
    first_losses: list[float] = []
    window_losses: list[float] = []
    for w in range(len(firsts[0]["windows"])):
        micro = [mb for r in firsts for mb in r["windows"][w]]
        loss_fn = masked_sse if tokens else F.mse_loss
        losses = [loss_fn(model(data.x[mb]), data.y[mb]) for mb in micro]
        first_losses.append(float(losses[0].detach()))
        opt.zero_grad()
        items = sum(int((data.y[mb] > 0).sum()) for mb in micro) if tokens else len(micro)
        total = sum(losses) / items
        window_losses.append(float(total.detach()))
        total.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return {
        "state": to_lists(model.state_dict()),
        "norms": norms,
        "first_losses": first_losses,
        "window_losses": window_losses,
    }


def assert_pipeline_matches_one_process(
    rank_results: list[dict[str, Any]], *, samples: int, tolerance: float = 1e-5, **kwargs: Any
) -> dict[str, Any]:
    """Every rank's ``get_state_dict`` (the whole model, gathered from the stages) equals one
    process's on the same global windows; the stages hold the whole model between them; the
    loss comes back on the last stage only."""
    ref = pipeline_reference(rank_results, samples=samples, **kwargs)
    held: set[str] = set()
    for r in rank_results:
        assert r["optimizer_steps"] == len(r["windows"]) > 0
        assert set(r["state"]) == set(ref["state"]), sorted(set(r["state"]) ^ set(ref["state"]))
        if "held" in r:  # the stage's own names (a pipeline)
            assert set(r["held"]) <= set(ref["state"]), r["held"]
            held |= set(r["held"])
        else:
            held |= set(r["state"])
        diff = max_diff(r["state"], ref["state"])
        assert diff < tolerance, (r["stage"], r["data_rank"], diff)
        last = r["stage"] == max(q["stage"] for q in rank_results)
        assert all((loss is not None) == last for loss in r["losses"])
        # the window loss on the last stage's ranks (NaN on the others: they saw no loss)
        for got, want in zip(r["window_losses"], ref["window_losses"], strict=True):
            assert abs(got - want) < 1e-5 if last else math.isnan(got), (got, want)
    assert held == set(ref["state"])
    return ref


def assert_saves_the_whole_model(rank_results: list[dict[str, Any]], folder: Path) -> None:
    """``scenarios.pp.save_model``'s ranks: each rank's ``get_state_dict`` holds the whole
    model (``make_seq``'s names), the same on every rank, and so does the file rank 0 wrote
    into ``folder``; each rank's own stage holds a part of it."""
    from scenarios.pp import make_seq

    names = list(make_seq().state_dict())
    first = rank_results[0]["state"]
    assert list(first) == names, list(first)
    written = torch.load(folder / "pytorch_model.bin", weights_only=True)
    assert list(written) == names, list(written)
    assert max_diff({k: v.tolist() for k, v in written.items()}, first) == 0
    for r in rank_results:
        assert r["state"] == first
        assert set(r["held"]) < set(names), r["held"]
    assert set().union(*(r["held"] for r in rank_results)) == set(names)


def assert_decoder_pipeline_matches_one_process(
    rank_results: list[dict[str, Any]], *, samples: int, tolerance: float = 1e-5
) -> None:
    """A pipelined ``scenarios.pp_decoder`` Llama: every stage's parameters equal the same
    parameters of plain torch in one process on the same global windows; the stages hold
    the whole model's parameters between them; gradsync chose the asked policy."""
    from scenarios.pp_decoder import reference

    ref = reference(rank_results, samples)
    held: set[str] = set()
    for r in rank_results:
        assert r["optimizer_steps"] == len(r["windows"]) == 2, r["windows"]
        assert r["policy"] == "defer"
        assert set(r["state"]) == set(ref), sorted(set(r["state"]) ^ set(ref))  # the whole
        assert set(r["held"]) <= set(ref), r["held"]  # this rank's stage
        held |= set(r["held"])
        diff = max_diff(r["state"], ref)
        assert diff < tolerance, (r["stage"], r["data_rank"], diff)
    assert held == set(ref)
