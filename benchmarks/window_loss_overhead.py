"""What ``accel.window_loss`` costs: the token-weighted DDP loop with ``track_window_loss=True``
(reading ``accel.window_loss`` at every boundary, as a loop that logs it does) against the
same loop with ``track_window_loss=False``, in one run.

    python benchmarks/window_loss_overhead.py --out bench-out        # about a minute on 2 cores

The loop is the token-weighting benchmark's (``count_items`` + ``backward(reduction="sum")``)
on 2 ranks with the sync-overhead benchmark's MLP (4.2 M parameters), k micro-batches of 8
samples per optimizer step. What tracking adds is, per ``backward``, one add of the weighted
loss into a 2-element tensor (no synchronisation), and per window one all-reduce of those two
floats, started at the window's first ``optimizer.step()`` and waited for at the first read.

* the estimate from the parts: the add (k per step) and the all-reduce (started and waited
  for at once, so none of it overlaps the optimizer step as it does in the loop), each timed
  alone on the 2 ranks over many windows, divided by the step time of the loop without
  tracking (target <= 0.5 %); and the read of ``accel.window_loss`` timed inside the loop,
  median and mean (what is left to wait for there: the all-reduce overlaps the optimizer
  step, but the read waits for the slower rank to reach its step);
* end to end: the loop with tracking, without it, and a second loop without it as a control
  (the ratio's noise floor on the machine), steps rotating among the three; the median over
  steps of (tracked / untracked) of neighbouring steps, and of (control / untracked). Noisy
  on a shared machine: the estimate is the figure to read.

Writes window_loss_overhead.json and window_loss_overhead.md to --out.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from small_bench import QUICK_SIZES, SIZES, parser, run_workers, write  # noqa: E402

MODES = ("off", "control", "on")  # control: a second loop without tracking, the noise floor


def worker(spec: dict[str, Any], out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(HERE))
    from bench_cells import Sizes, sgd

    from gradsync import Accelerator
    from gradsync._core.window_loss import WindowLoss

    torch.set_num_threads(1)
    sizes = Sizes(**spec["sizes"])
    k, steps, windows = spec["k"], spec["steps"], spec["windows"]

    def data() -> list[dict[str, torch.Tensor]]:
        """Samples for every rank (the prepared loader shards them), each with its tokens."""
        g = torch.Generator().manual_seed(1000)
        return [
            {
                "x": torch.randn(sizes.features, generator=g),
                "y": torch.randn(sizes.outputs, generator=g),
                "tokens": torch.randint(1, 17, (), generator=g),
            }
            for _ in range(k * (steps + 3) * sizes.micro_batch * 2)
        ]

    def per_sample(model: Any, b: dict[str, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = ((model(b["x"]) - b["y"]) ** 2).mean(dim=1)
        return out

    runners = {}
    for mode in MODES:
        accel = Accelerator(
            backend="ddp",
            gradient_accumulation_steps=k,
            seed=0,
            count_items=lambda b: b["tokens"].sum(),
            track_window_loss=mode == "on",
        )
        mlp = sizes.model()
        model, opt = accel.prepare(mlp, sgd(mlp.parameters()))
        samples: Any = data()  # a list of samples is a map-style dataset
        loader = accel.prepare(DataLoader(samples, batch_size=sizes.micro_batch))
        runners[mode] = (accel, model, opt, iter(loader))

    read_us: list[float] = []  # the read of accel.window_loss in the tracked loop
    losses: list[float] = []

    def one_step(mode: str) -> float:
        accel, model, opt, it = runners[mode]
        t0 = time.perf_counter()
        for _ in range(k):
            b = next(it)
            with accel.accumulate(model):
                accel.backward((per_sample(model, b) * b["tokens"]).sum(), reduction="sum")
                opt.step()
                opt.zero_grad()
            if mode == "on" and accel.sync_gradients:  # what a loop that logs the loss does
                r0 = time.perf_counter()
                losses.append(accel.window_loss)
                read_us.append((time.perf_counter() - r0) * 1e6)
        return (time.perf_counter() - t0) * 1e3

    for mode in MODES:  # warm-up: DDP rebuilds its buckets after the first step
        one_step(mode)
        one_step(mode)
    read_us.clear()
    losses.clear()
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for s in range(steps):
        order = MODES[s % 3 :] + MODES[: s % 3]  # each mode first, middle and last in turn
        for mode in order:
            times[mode].append(one_step(mode))

    # -- the parts alone: the same WindowLoss the Accelerator builds, on the same group ----
    accel = runners["on"][0]
    wl = WindowLoss(accel.device, accel.world_size, accel._runner.own_collective)
    loss = torch.randn((), requires_grad=True) * 2.0  # a scalar loss with a graph, as in the loop
    add_us: list[float] = []  # per backward
    allreduce_us: list[float] = []  # per window: started and waited for at once
    start_us: list[float] = []  # of which: starting it
    for w in range(windows):
        if w % 25 == 0:
            dist.barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            wl.add(loss, 1.0 / 1000, None)
        t1 = time.perf_counter()
        wl.close()
        t2 = time.perf_counter()
        value = wl.value
        t3 = time.perf_counter()
        add_us.append((t1 - t0) * 1e6 / k)
        start_us.append((t2 - t1) * 1e6)
        allreduce_us.append((t3 - t1) * 1e6)
    assert math.isfinite(value)
    if accel.rank == 0:
        (out / "result.json").write_text(
            json.dumps(
                {
                    "times": times,
                    "read_us": read_us,
                    "add_us": add_us,
                    "allreduce_us": allreduce_us,
                    "start_us": start_us,
                    "window_loss_last": losses[-1],
                    "windows_read": len(losses),
                }
            )
        )
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0], "a tiny model and a few steps (a smoke run)")
    p.add_argument(
        "--steps", type=int, default=90, help="timed optimizer steps per mode (after 2 warm-up)"
    )
    p.add_argument(
        "--windows", type=int, default=1000, help="windows in the timing of the parts alone"
    )
    args = p.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else SIZES
    spec = {
        "sizes": sizes,
        "k": args.k,
        "steps": 6 if args.quick else args.steps,
        "windows": 50 if args.quick else args.windows,
    }
    raw = run_workers(
        __file__,
        spec,
        f"window-loss overhead benchmark: DDP, 2 ranks, k={spec['k']}, "
        f"{spec['steps']} steps per mode",
    )
    if raw is None:
        return 1
    off, on, ctl = raw["times"]["off"], raw["times"]["on"], raw["times"]["control"]
    ratios = [a / b for a, b in zip(on, off)]
    control = [c / b for c, b in zip(ctl, off)]
    step_ms = statistics.median(off)
    add_us = statistics.median(raw["add_us"])
    allreduce_us = statistics.median(raw["allreduce_us"])
    per_step_us = spec["k"] * add_us + allreduce_us
    result = {
        "backend": "ddp",
        "world_size": 2,
        "k": spec["k"],
        "sizes": sizes,
        "off_step_ms": step_ms,
        "on_step_ms": statistics.median(on),
        "control_step_ms": statistics.median(ctl),
        "add_us": add_us,
        "allreduce_us": allreduce_us,
        "allreduce_start_us": statistics.median(raw["start_us"]),
        "read_in_loop_us": statistics.median(raw["read_us"]),
        "read_in_loop_mean_us": statistics.mean(raw["read_us"]),
        "estimated_us_per_step": per_step_us,
        "estimated_share": per_step_us / (step_ms * 1e3),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "control_ratio_median": statistics.median(control),
        "ratio_over_control": statistics.median(ratios) / statistics.median(control),
        "window_loss_last": raw["window_loss_last"],
        "windows_read": raw["windows_read"],
        "target_share": 0.005,
        "raw": raw,
    }
    table = (
        "| backend | k | untracked (ms/step) | tracked (ms/step) | add per backward (us) | "
        "all-reduce alone, start+wait (us) | read in the loop, median / mean (us) | estimated share of a step | "
        "end to end tracked/untracked (median of pairs) | control: untracked/untracked |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
        f"| ddp | {spec['k']} | {step_ms:.1f} | {result['on_step_ms']:.1f} | {add_us:.1f} | "
        f"{allreduce_us:.0f} | {result['read_in_loop_us']:.0f} / {result['read_in_loop_mean_us']:.0f} | "
        f"{100 * result['estimated_share']:.2f} % | {result['ratio_median']:.3f} "
        f"(range {result['ratio_min']:.2f}-{result['ratio_max']:.2f}) | "
        f"{result['control_ratio_median']:.3f} |\n"
    )
    write(args.out, "window_loss_overhead", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
