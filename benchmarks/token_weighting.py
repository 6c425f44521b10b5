"""What token-weighted accumulation costs: ``reduction="sum"`` with ``count_items`` against
the plain ``"mean"`` loop, on DDP, in one run.

    python benchmarks/token_weighting.py --out bench-out          # about a minute on 2 cores

Both modes train the sync-overhead benchmark's MLP (4.2 M parameters) with k micro-batches
of 8 samples per optimizer step on 2 ranks; each sample carries a number of "tokens" (1-16)
that weighs its loss. The only extra work of the token-weighted loop is counting a window's
items (read ahead) and one all-reduce of two integers per window. Modes alternate step by
step with a second, identical "mean" loop as a control; the figures are the median over steps
of (token-weighted step time / mean step time) of neighbouring steps, the same for the control
(the noise floor of that ratio on the machine), and the time of the count all-reduce alone
with its share of a step.
Writes token_weighting.json and token_weighting.md to --out.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from small_bench import QUICK_SIZES, SIZES, parser, run_workers, write  # noqa: E402


def worker(spec: dict[str, Any], out: Path) -> None:
    import torch
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(HERE))
    from bench_cells import Sizes, sgd

    from gradsync import Accelerator

    torch.set_num_threads(1)
    sizes = Sizes(**spec["sizes"])
    k, steps = spec["k"], spec["steps"]

    def data() -> list[dict[str, torch.Tensor]]:
        """Samples for every rank (the prepared loader shards them), each with its tokens."""
        g = torch.Generator().manual_seed(1000)
        return [
            {
                "x": torch.randn(sizes.features, generator=g),
                "y": torch.randn(sizes.outputs, generator=g),
                "tokens": torch.randint(1, 17, (), generator=g),
            }
            for _ in range(k * steps * sizes.micro_batch * 2)
        ]

    def per_sample(model: Any, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((model(b["x"]) - b["y"]) ** 2).mean(dim=1)

    runners = {}
    for mode in ("mean", "control", "sum"):  # control: a second "mean" loop, the noise floor
        accel = Accelerator(
            backend="ddp",
            gradient_accumulation_steps=k,
            seed=0,
            count_items=(lambda b: b["tokens"].sum()) if mode == "sum" else None,
        )
        model = sizes.model()
        model, opt = accel.prepare(model, sgd(model.parameters()))
        loader = accel.prepare(DataLoader(data(), batch_size=sizes.micro_batch))
        runners[mode] = (accel, model, opt, loader)

    def one_step(mode: str, it: Any) -> float:
        accel, model, opt, _ = runners[mode]
        t0 = time.perf_counter()
        for _ in range(k):
            b = next(it)
            with accel.accumulate(model):
                if mode == "sum":
                    accel.backward((per_sample(model, b) * b["tokens"]).sum(), reduction="sum")
                else:
                    accel.backward(per_sample(model, b).mean())
                opt.step()
                opt.zero_grad()
        return (time.perf_counter() - t0) * 1e3

    iters = {mode: iter(runners[mode][3]) for mode in runners}
    for mode in runners:  # warm-up: DDP rebuilds its buckets after the first step
        one_step(mode, iters[mode])
        one_step(mode, iters[mode])
    times: dict[str, list[float]] = {mode: [] for mode in runners}
    modes = list(runners)
    for s in range(steps - 2):
        order = modes[s % 3 :] + modes[: s % 3]  # each mode first, middle and last in turn
        for mode in order:
            times[mode].append(one_step(mode, iters[mode]))
    count_ms = []
    accel = runners["sum"][0]
    t = torch.zeros(2, dtype=torch.int64)
    for _ in range(50):
        t0 = time.perf_counter()
        torch.distributed.all_reduce(t)
        count_ms.append((time.perf_counter() - t0) * 1e3)
    if accel.rank == 0:
        (out / "result.json").write_text(
            json.dumps({"times": times, "count_allreduce_ms": count_ms})
        )


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0], "a tiny model and 8 steps (a smoke run)")
    p.add_argument("--steps", type=int, default=42, help="optimizer steps per mode (2 are warm-up)")
    args = p.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else SIZES
    spec = {"sizes": sizes, "k": args.k, "steps": 8 if args.quick else args.steps}
    raw = run_workers(
        __file__,
        spec,
        f"token-weighting benchmark: DDP, 2 ranks, k={spec['k']}, {spec['steps']} steps per mode",
    )
    if raw is None:
        return 1
    mean_ms, sum_ms = raw["times"]["mean"], raw["times"]["sum"]
    ratios = [s / m for s, m in zip(sum_ms, mean_ms)]
    control = [c / m for c, m in zip(raw["times"]["control"], mean_ms)]
    result = {
        "backend": "ddp",
        "world_size": 2,
        "k": spec["k"],
        "sizes": sizes,
        "mean_step_ms": statistics.median(mean_ms),
        "sum_step_ms": statistics.median(sum_ms),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "control_ratio_median": statistics.median(control),
        "count_allreduce_ms": statistics.median(raw["count_allreduce_ms"]),
        "count_allreduce_share": statistics.median(raw["count_allreduce_ms"])
        / statistics.median(mean_ms),
        "target_ratio": 1.01,
        "raw": raw,
    }
    table = (
        "| backend | k | mean loop (ms/step) | token-weighted (ms/step) | ratio (median of pairs) | "
        "control: mean / mean | count all-reduce (ms) | its share of a step |\n"
        "|---|---|---|---|---|---|---|---|\n"
        f"| ddp | {spec['k']} | {result['mean_step_ms']:.1f} | {result['sum_step_ms']:.1f} | "
        f"{result['ratio_median']:.3f} (range {result['ratio_min']:.2f}-{result['ratio_max']:.2f}) | "
        f"{result['control_ratio_median']:.3f} | "
        f"{result['count_allreduce_ms']:.3f} | {100 * result['count_allreduce_share']:.2f} % |\n"
    )
    write(args.out, "token_weighting", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
