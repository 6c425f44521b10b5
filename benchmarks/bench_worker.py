"""One rank of the sync-overhead benchmark (``run(SPEC, OUT)``, started by sync_overhead.py as
torchrun's agent starts ranks; or by hand:

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench_worker.py SPEC OUT

Joins an audited process group (gloo on CPU, nccl on GPUs), then for each backend and each
accumulation k builds every mode's runner and times them interleaved: each repetition
runs a few optimizer steps of every mode in turn (rotating the order), so drift on a
shared machine hits all modes alike. Writes OUT/rank{r}.json after every cell group.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_cells import CELLS, BackendCells, Sizes, build, checksum, mode_skip, sgd
from peak_memory import PeakMemory, no_gradients

from gradsync import audit


# -- memory -----------------------------------------------------------------------
def _memory_step(
    runner: Any, batches: list[Any], k: int, rec: Any, device: torch.device, keep_grads: bool
) -> dict[str, Any]:
    """One optimizer step under the memory probe (untimed: the CPU probe's per-op sampling
    would slow the step): the peak above the window's start, and what the adapter predicted
    for the policy it ran (gradsync modes only)."""
    # Every mode's window starts without gradients (the loops free them at different times:
    # gradsync when the next window starts, the hand-written loops at the boundary), except
    # where the backend's buckets are views of them (fairscale): zeroed in place, kept.
    if keep_grads:
        gc.collect()
    else:
        no_gradients(runner.model)
    with PeakMemory(device) as probe:
        _run_steps(runner, batches, k, 1, 0, rec)
    accel = getattr(runner, "accel", None)
    backend = getattr(accel, "_backend", None)
    memory = getattr(backend, "memory", None) or {}
    return {
        "peak_bytes": probe.peak_bytes,
        "baseline_bytes": probe.baseline,
        "predicted_extra_bytes": memory.get("deferral_extra_bytes"),
        "reason": accel.sync_policy_reason if accel is not None else "",
        "method": probe.method,
    }


# -- one mode's chunk of optimizer steps ----------------------------------------------
def _run_steps(
    runner: Any, batches: list[Any], k: int, steps: int, start: int, rec: Any
) -> tuple[list[float], list[float], list[float]]:
    """Run ``steps`` optimizer steps; return per-step times, off-boundary and boundary micro-step times."""
    step_t, off_t, on_t = [], [], []
    n = len(batches)
    perf = time.perf_counter
    for s in range(steps):
        t_step = perf()
        for i in range(k):
            x, y = batches[(start + s * k + i) % n]
            sync = i == k - 1
            rec.open(sync)
            t0 = perf()
            runner.micro(x, y, sync)
            dt = perf() - t0
            rec.close()
            (on_t if sync else off_t).append(dt)
        step_t.append(perf() - t_step)
    return step_t, off_t, on_t


def _audit_per_step(rec: Any, k: int) -> dict[str, Any]:
    """Collectives of the recorded micro-steps, per optimizer step."""
    records = rec.records
    steps = max(1, len(records) // k)
    red = sum(r.reductions for r in records)
    red_bytes = sum(r.reduction_bytes for r in records)
    gathers = sum(r.count("allgather") for r in records)
    all_bytes = sum(r.nbytes() for r in records)
    last = records[-k:] if len(records) >= k else records
    return {
        "reductions": red / steps,
        "reduction_bytes": red_bytes / steps,
        "allgathers": gathers / steps,
        "bytes": all_bytes / steps,
        "reductions_per_micro_step": [r.reductions for r in last],
    }


def _allreduce_ms(numel: int, device: torch.device, reps: int) -> list[float]:
    buf = torch.ones(numel, device=device)
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _optimizer_ms(sizes: Sizes, device: torch.device, reps: int) -> list[float]:
    """One local optimizer step + zero_grad on the full model (no communication)."""
    model = sizes.model().to(device)
    opt = sgd(model.parameters())
    times = []
    for _ in range(reps + 1):
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        times.append((time.perf_counter() - t0) * 1e3)
    return times[1:]


def _agree(ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _short(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[
        :300
    ]


# -- one backend at one k -----------------------------------------------------------------
class _Group:
    """One backend at one k on this rank: what every phase of ``run_group`` reads, and the
    output its notes go to. (A plain class: small_bench loads this file as a module that
    ``sys.modules`` does not hold, where ``dataclass`` cannot read its annotations.)"""

    def __init__(
        self,
        label: str,
        k: int,
        cells: BackendCells,
        device: torch.device,
        rank: int,
        out: dict[str, Any],
        rec: Any,
    ) -> None:
        self.label = label
        self.k = k
        self.cells = cells
        self.device = device
        self.rank = rank
        self.out = out
        self.rec = rec

    def note_failure(self, mode: str, what: str) -> None:
        """Inside an ``except``: rank 0 prints the traceback; a note on the mode."""
        if self.rank == 0:
            traceback.print_exc()
        self.out["notes"].append(f"{self.label} k={self.k} {mode}: {what}")


def _runnable_modes(cells: BackendCells, spec: dict[str, Any], out: dict[str, Any]) -> list[str]:
    """The spec's modes this backend runs; why the others do not, noted once."""
    modes = []
    for mode in spec["modes"]:
        reason = mode_skip(cells, mode)
        if reason is not None:
            if reason not in out["notes"]:
                out["notes"].append(reason)
            continue
        modes.append(mode)
    return modes


def _build_runners(g: _Group, modes: list[str], sizes: Sizes) -> dict[str, Any]:
    """Every mode's runner; a mode whose build failed on any rank is left out (noted)."""
    runners: dict[str, Any] = {}
    for mode in modes:
        err: BaseException | None = None
        try:
            runners[mode] = build(g.cells, mode, sizes, g.k, g.device)
        except Exception as exc:  # recorded as a note; the other modes still run
            err = exc
            if g.rank == 0:
                traceback.print_exc()
        if not _agree(err is None, g.device):
            runners.pop(mode, None)
            g.out["notes"].append(
                f"{g.label} k={g.k} {mode}: skipped, building it failed"
                + (f" ({_short(err)})" if err else " on another rank")
            )
    return runners


def _warm_up(
    g: _Group, runners: dict[str, Any], modes: list[str], batches: list[Any], warmup: int
) -> None:
    """Warm-up steps of every mode; a mode whose step fails is removed from ``modes``."""
    for mode in list(modes):
        try:
            _run_steps(runners[mode], batches, g.k, warmup, 0, g.rec)
        except Exception as exc:
            g.note_failure(mode, f"dropped, a warm-up step failed ({_short(exc)})")
            modes.remove(mode)
            g.rec.close()
    g.rec.clear()


def _measure_memory(
    g: _Group,
    runners: dict[str, Any],
    modes: list[str],
    batches: list[Any],
    res: dict[str, dict[str, Any]],
) -> None:
    """Each mode's step under the memory probe, into ``res[mode]["memory"]``."""
    for mode in modes:
        dist.barrier()
        try:
            res[mode]["memory"] = _memory_step(
                runners[mode], batches, g.k, g.rec, g.device, g.cells.grads_are_views
            )
        except Exception as exc:
            g.note_failure(
                mode, f"no memory reading, its step under the probe failed ({_short(exc)})"
            )
            g.rec.close()
    g.rec.clear()


def _timed_reps(
    g: _Group,
    runners: dict[str, Any],
    modes: list[str],
    batches: list[Any],
    res: dict[str, dict[str, Any]],
    spec: dict[str, Any],
    numel: int,
) -> tuple[list[str], list[float]]:
    """The interleaved repetitions (the modes' order rotating), each followed by a few
    all-reduces of the gradient's size; the modes still running and those all-reduce times
    (ms). A mode whose step fails is dropped from then on, and from ``res``."""
    steps, reps = spec["steps_per_rep"], spec["reps"] * g.cells.rep_scale
    ar_ms: list[float] = []
    for r in range(reps):
        order = modes[r % len(modes) :] + modes[: r % len(modes)] if modes else []
        for mode in order:
            dist.barrier()
            g.rec.clear()
            try:
                step_t, off_t, on_t = _run_steps(
                    runners[mode], batches, g.k, steps, (r + 1) * steps * g.k, g.rec
                )
            except Exception as exc:  # both ranks run the same code: they fail alike
                g.note_failure(mode, f"dropped, a step failed ({_short(exc)})")
                modes = [m for m in modes if m != mode]
                res.pop(mode, None)
                g.rec.close()
                continue
            entry = res[mode]
            entry["step_s"] += step_t
            entry["off_s"] += off_t
            entry["on_s"] += on_t
            entry["rep_median_s"].append(statistics.median(step_t))
            entry["audit"] = _audit_per_step(g.rec, g.k)
        g.rec.clear()
        ar_ms += _allreduce_ms(numel, g.device, 2)
    return modes, ar_ms


def _param_agreement(
    g: _Group,
    runners: dict[str, Any],
    modes: list[str],
    res: dict[str, dict[str, Any]],
    initial: float,
) -> None:
    """Each mode's parameter difference to gradsync's, relative to gradsync's update."""
    sums = {m: checksum(runners[m].model) for m in modes}
    g.rec.clear()
    ref = sums.get("gradsync")
    update = abs(ref - initial) if ref is not None else 0.0
    for m in modes:
        res[m]["param_diff_rel"] = (
            abs(sums[m] - ref) / update if ref is not None and update else None
        )


def _print_group(label: str, k: int, modes: list[str], res: dict[str, dict[str, Any]]) -> None:
    """Each mode's median step time and its reductions per step (rank 0 calls it)."""
    for m in modes:
        med = statistics.median(res[m]["step_s"]) * 1e3
        aud = res[m]["audit"]
        print(
            f"[bench] {label:<11} k={k:<2} {m:<10} {med:8.2f} ms/step  "
            f"{aud['reductions']:.1f} reductions, {aud['reduction_bytes'] / 2**20:.2f} MiB per step",
            flush=True,
        )


def run_group(
    label: str,
    k: int,
    spec: dict[str, Any],
    sizes: Sizes,
    device: torch.device,
    rank: int,
    out: dict[str, Any],
) -> None:
    cells = CELLS[label]
    rec = audit.recorder_of()
    assert rec is not None, "the worker's process group must be the audited one"
    g = _Group(label, k, cells, device, rank, out, rec)
    modes = _runnable_modes(cells, spec, out)

    if rank == 0:
        print(f"[bench] {label:<11} k={k:<2} running {', '.join(modes)} ...", flush=True)
    runners = _build_runners(g, modes, sizes)
    modes = [m for m in modes if m in runners]
    initial = checksum(sizes.model())
    rec.clear()

    batches = sizes.batches(rank, spec["batches"], device)
    numel = sum(p.numel() for p in sizes.model().parameters())
    # Warm-up: DDP rebuilds its buckets after the first step, allocators settle.
    _warm_up(g, runners, modes, batches, spec["warmup"])

    res: dict[str, dict[str, Any]] = {
        m: {
            "step_s": [],
            "off_s": [],
            "on_s": [],
            "rep_median_s": [],
            "memory": None,
            "audit": None,
        }
        for m in modes
    }
    # Memory: one more step per mode, each mode's from the same state (warmed up, its
    # optimizer state allocated), before the timed steps.
    _measure_memory(g, runners, modes, batches, res)
    modes, ar_ms = _timed_reps(g, runners, modes, batches, res, spec, numel)
    # Every mode saw the same batches in the same order: their parameters must agree.
    _param_agreement(g, runners, modes, res, initial)

    group = {
        "backend": label,
        "k": k,
        "grad_numel": numel,
        "grad_bytes": numel * 4,
        "allreduce_ms": ar_ms,
        "optimizer_ms": _optimizer_ms(sizes, device, 5),
        "modes": {m: {**res[m], "policy": getattr(runners[m], "policy", "?")} for m in modes},
    }
    out["groups"].append(group)
    if rank == 0:
        _print_group(label, k, modes, res)
    runners.clear()
    gc.collect()


def main() -> None:
    run(*sys.argv[1:3])


def run(spec_path: str, out_dir: str) -> None:
    """One rank: every cell of the spec at ``spec_path``; ``rank{r}.json`` into ``out_dir``."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec.get("threads", 1))
    device_type = "cuda" if torch.cuda.is_available() and spec.get("device") != "cpu" else "cpu"
    for label in spec["backends"]:
        setup = CELLS[label].process_setup if label in CELLS else None
        if setup is not None and CELLS[label].missing() is None:
            setup()
    audit.register()
    dist.init_process_group(audit.AUDIT_BACKEND[device_type], timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    device = (
        torch.device(device_type, rank % max(1, torch.cuda.device_count()))
        if device_type == "cuda"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sizes = Sizes(**spec["sizes"])
    out: dict[str, Any] = {"rank": rank, "device": str(device), "groups": [], "notes": []}
    path = Path(out_dir, f"rank{rank}.json")
    for label in spec["backends"]:
        cells = CELLS.get(label)
        if cells is None:
            out["notes"].append(f"{label}: unknown backend cell; known: {', '.join(CELLS)}")
            continue
        if cells.note and cells.note not in out["notes"]:
            out["notes"].append(cells.note)
        missing = cells.missing()
        if not _agree(missing is None, device):
            out["notes"].append(missing or f"{label}: skipped, unavailable on another rank")
            if rank == 0:
                print(f"[bench] {label:<12} skipped: {missing}", flush=True)
            continue
        for k in spec["ks"]:
            run_group(label, k, spec, sizes, device, rank, out)
            path.write_text(json.dumps(out))
    path.write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
