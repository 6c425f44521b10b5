"""What the deferral self-check costs once its checked steps are over: the counting wrapper
stays the process group (recording off), so every collective pays one Python dispatch more.

    python benchmarks/selfcheck_overhead.py --out bench-out          # about a minute on 2 cores

On 2 ranks, in one run: gradsync creates the process group as it does by default for a
deferring policy (through the counting wrapper, recorder off) and the Accelerator's
self-check runs over its first steps and ends; then

* per collective: the wrapper's own cost, a 4-byte all-reduce through the wrapper
  (recording off) against the same on the gloo group it wraps, on a 1-rank group in one
  process where an all-reduce takes microseconds (alternating blocks; median per call); and
  the wrapper's Python layer alone (its flag check and extra call, around an inner group
  that does nothing); the larger of the two is the extra cost per collective; and
  the same all-reduce across the 2 ranks on the wrapped world group and a plain gloo group
  (hundreds of microseconds of network and scheduling, which hide the wrapper's part);
* per DDP step: how many collectives one optimizer step of the sync-overhead benchmark's MLP
  (k micro-batches, ``no_sync()`` on all but the last) issues, counted by the wrapper;
* the estimate: extra time per collective x collectives per step / step time (target <= 1 %);
* end to end: the same DDP loop over the wrapped group and over the plain group, steps
  alternating, the median over steps of (wrapped / plain) of neighbouring steps (noisy on a
  shared machine; the estimate above is the figure to read).

Writes selfcheck_overhead.json and selfcheck_overhead.md to --out.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from small_bench import QUICK_SIZES, SIZES, parser, run_workers, write  # noqa: E402


def _past_the_check(sizes: Any, k: int) -> tuple[Any, list[Any]]:
    """The default: gradsync creates the group through the wrapper and checks the first
    steps; a few windows of k micro-batches run past them. The Accelerator and this rank's
    batches."""
    import torch.nn.functional as F
    from bench_cells import sgd

    from gradsync import Accelerator

    accel = Accelerator(backend="ddp", gradient_accumulation_steps=k, seed=0)
    model = sizes.model()
    model, opt = accel.prepare(model, sgd(model.parameters()))
    batches = sizes.batches(accel.rank, k, accel.device)
    for _ in range(4):  # past the checked steps
        for x, y in batches:
            with accel.accumulate(model):
                accel.backward(F.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
    return accel, batches


def _local_allreduce_us(off: Any, t: Any, calls: int) -> dict[str, list[float]]:
    """Per collective, the wrapper's own cost: on a 1-rank gloo group of this process, where
    an all-reduce costs microseconds, the wrapper (recording off) against the group it wraps
    (us per call, alternating blocks)."""
    from datetime import timedelta

    import torch.distributed as dist

    from gradsync import audit

    inner = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=60))
    local = audit.AuditProcessGroup(inner, 0, 1, "local", off)
    local_us: dict[str, list[float]] = {"wrapped": [], "plain": []}
    for block in range(20):
        pair = ((local_us["wrapped"], local), (local_us["plain"], inner))
        for times_, pg in pair if block % 2 == 0 else pair[::-1]:
            t0 = time.perf_counter()
            for _ in range(calls * 4):
                pg.allreduce([t]).wait()
            times_.append((time.perf_counter() - t0) * 1e6 / (calls * 4))
    return local_us


class _Idle:
    """An inner group that does nothing: around it, the wrapper's Python layer alone."""

    def allreduce(self, tensors: Any, opts: Any = None) -> None:
        return None


def _wrapper_layer_us(off: Any, t: Any, calls: int) -> dict[str, list[float]]:
    """The wrapper's Python layer alone: around an inner group that does nothing (no data
    moves: this times the wrapper's flag check and extra call, not a collective)."""
    from gradsync import audit

    idle = _Idle()
    layer = audit.AuditProcessGroup(idle, 0, 1, "layer", off)
    layer_us: dict[str, list[float]] = {"wrapped": [], "plain": []}
    for block in range(20):
        pair = ((layer_us["wrapped"], layer), (layer_us["plain"], idle))
        for times_, obj in pair if block % 2 == 0 else pair[::-1]:
            t0 = time.perf_counter()
            for _ in range(calls * 40):
                obj.allreduce([t])
            times_.append((time.perf_counter() - t0) * 1e6 / (calls * 40))
    return layer_us


def _world_allreduce_us(wrapped: Any, plain: Any, t: Any, calls: int) -> dict[str, list[float]]:
    """Per collective across the 2 ranks (network and scheduling noise included): the
    wrapped world group against the plain one, alternating blocks."""
    import torch.distributed as dist

    per_call: dict[str, list[float]] = {"wrapped": [], "plain": []}
    for block in range(12):
        order = (
            (("wrapped", wrapped), ("plain", plain))
            if block % 2 == 0
            else (("plain", plain), ("wrapped", wrapped))
        )
        for name, group in order:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(t, group=group)
            per_call[name].append((time.perf_counter() - t0) * 1e6 / calls)
    return per_call


def _ddp_step(runner: tuple[Any, Any], batches: list[Any], k: int) -> float:
    """One optimizer step of DDP over k micro-batches (``no_sync()`` on all but the last), ms."""
    import torch.nn.functional as F

    m, o = runner
    t0 = time.perf_counter()
    for i, (x, y) in enumerate(batches):
        with m.no_sync() if i < k - 1 else contextlib.nullcontext():
            F.mse_loss(m(x), y).backward()
    o.step()
    o.zero_grad()
    return (time.perf_counter() - t0) * 1e3


def _ddp_steps(
    sizes: Any, wrapped: Any, plain: Any, batches: list[Any], k: int, steps: int, recorder: Any
) -> tuple[int, dict[str, list[float]]]:
    """DDP steps over each group: the collectives of one step (counted by the wrapper) and
    ``steps`` timed steps per group, alternating (ms)."""
    from bench_cells import sgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    runners = {}
    for name, group in (("wrapped", wrapped), ("plain", plain)):
        m = DDP(sizes.model(), process_group=group)
        runners[name] = (m, sgd(m.parameters()))

    for name in runners:  # warm-up: DDP rebuilds its buckets after the first step
        _ddp_step(runners[name], batches, k)
        _ddp_step(runners[name], batches, k)
    recorder.outside.clear()
    recorder.enabled = True
    _ddp_step(runners["wrapped"], batches, k)
    recorder.enabled = False
    collectives = len(recorder.outside)
    recorder.outside.clear()
    times: dict[str, list[float]] = {"wrapped": [], "plain": []}
    for s in range(steps):
        for name in ("wrapped", "plain") if s % 2 == 0 else ("plain", "wrapped"):
            times[name].append(_ddp_step(runners[name], batches, k))
    return collectives, times


def worker(spec: dict[str, Any], out: Path) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from bench_cells import Sizes

    from gradsync import audit

    torch.set_num_threads(1)
    sizes = Sizes(**spec["sizes"])
    k, steps, calls = spec["k"], spec["steps"], spec["calls"]

    # The default: gradsync creates the group through the wrapper and checks the first steps.
    accel, batches = _past_the_check(sizes, k)
    recorder = audit.recorder_of()
    assert recorder is not None and isinstance(dist.group.WORLD, audit.AuditProcessGroup)
    assert not recorder.enabled and accel._self_check is None, "the check must be over"

    wrapped = dist.group.WORLD
    plain = dist.new_group(backend="gloo")
    assert not isinstance(plain, audit.AuditProcessGroup)

    off = audit.Recorder()
    off.enabled = False
    t = torch.zeros(1)
    local_us = _local_allreduce_us(off, t, calls)
    layer_us = _wrapper_layer_us(off, t, calls)
    per_call = _world_allreduce_us(wrapped, plain, t, calls)
    collectives, times = _ddp_steps(sizes, wrapped, plain, batches, k, steps, recorder)
    if accel.rank == 0:
        (out / "result.json").write_text(
            json.dumps(
                {
                    "per_call_us": per_call,
                    "local_us": local_us,
                    "layer_us": layer_us,
                    "collectives_per_step": collectives,
                    "step_ms": times,
                }
            )
        )
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0], "a tiny model and a few steps (a smoke run)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per group")
    p.add_argument("--calls", type=int, default=500, help="all-reduces per timed block")
    args = p.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else SIZES
    spec = {
        "sizes": sizes,
        "k": args.k,
        "steps": 4 if args.quick else args.steps,
        "calls": 50 if args.quick else args.calls,
    }
    raw = run_workers(
        __file__,
        spec,
        f"self-check overhead benchmark: DDP, 2 ranks, k={spec['k']}, "
        f"{spec['steps']} steps per group",
    )
    if raw is None:
        return 1
    wrapped_us = statistics.median(raw["per_call_us"]["wrapped"])
    plain_us = statistics.median(raw["per_call_us"]["plain"])
    local_wrapped = statistics.median(raw["local_us"]["wrapped"])
    local_plain = statistics.median(raw["local_us"]["plain"])
    layer_extra = statistics.median(raw["layer_us"]["wrapped"]) - statistics.median(
        raw["layer_us"]["plain"]
    )
    # the larger of the two (the 1-rank gloo difference carries timing noise): conservative
    extra_us = max(0.0, layer_extra, local_wrapped - local_plain)
    step_ms = statistics.median(raw["step_ms"]["plain"])
    n = raw["collectives_per_step"]
    ratios = [w / p for w, p in zip(raw["step_ms"]["wrapped"], raw["step_ms"]["plain"])]
    result = {
        "backend": "ddp",
        "world_size": 2,
        "k": spec["k"],
        "sizes": sizes,
        "allreduce_us_wrapped": wrapped_us,
        "allreduce_us_plain": plain_us,
        "local_allreduce_us_wrapped": local_wrapped,
        "local_allreduce_us_plain": local_plain,
        "wrapper_layer_us": layer_extra,
        "extra_us_per_collective": extra_us,
        "collectives_per_step": n,
        "step_ms": step_ms,
        "estimated_share": extra_us * n / (step_ms * 1e3),
        "end_to_end_ratio_median": statistics.median(ratios),
        "end_to_end_ratio_min": min(ratios),
        "end_to_end_ratio_max": max(ratios),
        "target_share": 0.01,
        "raw": raw,
    }
    table = (
        "| backend | k | wrapper's Python layer (us) | 1-rank all-reduce: wrapper / plain gloo (us) | "
        "extra per collective, the larger (us) | "
        "2-rank all-reduce: wrapper / plain (us) | collectives per step | step (ms) | "
        "estimated share of a step | end to end wrapped/plain (median of pairs) |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
        f"| ddp | {spec['k']} | {layer_extra:.2f} | {local_wrapped:.2f} / {local_plain:.2f} | {extra_us:.2f} | "
        f"{wrapped_us:.0f} / {plain_us:.0f} | {n} | {step_ms:.1f} | "
        f"{100 * result['estimated_share']:.4f} % | {result['end_to_end_ratio_median']:.3f} "
        f"(range {result['end_to_end_ratio_min']:.2f}-{result['end_to_end_ratio_max']:.2f}) |\n"
    )
    write(args.out, "selfcheck_overhead", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
