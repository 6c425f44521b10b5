"""What ``on_oom="split"``'s agreement points cost per micro-step, when nothing runs out of
memory.

    python benchmarks/oom_agreement_cost.py --out bench-out          # about a minute on 2 cores

On 2 ranks, in one run: the sync-overhead benchmark's MLP (4.2 M parameters, micro-batch 8)
trained with ``on_oom="raise"`` and ``on_oom="split"`` on ``backend="ddp"`` and
``backend="fsdp"`` (sync_policy="defer"), a window of k micro-steps at a time, the settings
alternating window by window; the median time of a micro-step under each and their ratio
(target: <= 1 %), with the agreement all-reduces each micro-step ran: one before each
backward that synchronises (the boundary's), and one before each forward that all-gathers
(FSDP2's units, in every micro-step, or only in the window's first with
``fsdp_keep_params_in_window``, the "fsdp-keep" row).

Writes oom_agreement_cost.json and oom_agreement_cost.md to --out.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from small_bench import QUICK_SIZES, SIZES, parser, run_workers, write  # noqa: E402


def worker(spec: dict[str, Any], out: Path) -> None:
    import json

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(HERE))
    from bench_cells import Sizes, sgd

    from gradsync import Accelerator

    torch.set_num_threads(1)
    sizes = Sizes(**spec["sizes"])
    k, windows = spec["k"], spec["windows"]
    result: dict[str, Any] = {}
    for backend in spec["backends"]:
        runs = {}
        for on_oom in ("raise", "split"):
            keep = {"fsdp_keep_params_in_window": True} if backend == "fsdp-keep" else {}
            accel = Accelerator(
                backend=backend.removesuffix("-keep"),
                gradient_accumulation_steps=k,
                sync_policy="defer",
                on_oom=on_oom,
                **keep,
            )
            model = sizes.model(seed=0)
            n = k * (windows + 1) * sizes.micro_batch * dist.get_world_size()
            g = torch.Generator().manual_seed(1)
            data = TensorDataset(
                torch.randn(n, sizes.features, generator=g),
                torch.randn(n, sizes.outputs, generator=g),
            )
            model, opt, loader = accel.prepare(
                model, sgd(model.parameters()), DataLoader(data, batch_size=sizes.micro_batch)
            )
            runs[on_oom] = (accel, model, opt, iter(loader))
        times: dict[str, list[float]] = {"raise": [], "split": []}
        for w in range(windows + 1):  # the first window of each warms up, untimed
            for on_oom in ("raise", "split") if w % 2 == 0 else ("split", "raise"):
                accel, model, opt, batches = runs[on_oom]
                dist.barrier()
                start = time.perf_counter()
                for _ in range(k):
                    x, y = next(batches)
                    with accel.accumulate(model):
                        accel.backward(F.mse_loss(model(x), y))
                        opt.step()
                        opt.zero_grad()
                if w:
                    times[on_oom].append((time.perf_counter() - start) * 1000 / k)
        split = runs["split"][0]._p.runner.oom
        agreements = split.agreements / ((windows + 1) * k) if split is not None else 0
        result[backend] = {"times": times, "agreements_per_micro_step": agreements}
    flag = torch.zeros(dist.get_world_size(), dtype=torch.int32)
    one = []  # one agreement alone: a one-element-per-rank all-reduce, timed 200 times
    for _ in range(200):
        start = time.perf_counter()
        dist.all_reduce(flag)
        one.append((time.perf_counter() - start) * 1000)
    result["agreement_ms"] = statistics.median(one)
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0], "a tiny model and a few windows (a smoke run)")
    p.add_argument("--windows", type=int, default=24, help="timed windows per setting")
    p.add_argument("--backends", default="ddp,fsdp,fsdp-keep")
    args = p.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else SIZES
    spec = {
        "sizes": sizes,
        "k": args.k,
        "windows": 2 if args.quick else args.windows,
        "backends": args.backends.split(","),
    }
    raw = run_workers(__file__, spec, "on_oom agreement cost, 2 ranks")
    if raw is None:
        return 1
    one = raw.pop("agreement_ms")
    rows, result = [], {"sizes": sizes, "k": args.k, "agreement_ms": one, "backends": {}}
    for backend, got in raw.items():
        plain = statistics.median(got["times"]["raise"])
        split = statistics.median(got["times"]["split"])
        # Window by window, each split window against the raise window timed beside it: the
        # middle half of those ratios shows how far the machine's noise reaches.
        pairs = sorted(s / r - 1 for s, r in zip(got["times"]["split"], got["times"]["raise"]))
        q1, q3 = pairs[len(pairs) // 4], pairs[(3 * len(pairs)) // 4]
        per_step = got["agreements_per_micro_step"]
        share = per_step * one / plain
        result["backends"][backend] = {
            "raise_ms_median": plain,
            "split_ms_median": split,
            "ratio": split / plain - 1,
            "paired_ratio_quartiles": [q1, q3],
            "agreements_per_micro_step": per_step,
            "agreement_share": share,
            **got["times"],
        }
        rows.append(
            f"| {backend} | {plain:.2f} | {split:.2f} | {split / plain - 1:+.1%} "
            f"({q1:+.1%} to {q3:+.1%}) | {per_step:.3g} | {share:.2%} |"
        )
    table = (
        f"One agreement alone (a one-element all-reduce): {one:.3f} ms (median of 200).\n\n"
        "| backend | micro-step, on_oom='raise' (median ms) | on_oom='split' (median ms) "
        "| difference (paired quartiles) | agreements per micro-step "
        "| agreements' share of a micro-step |\n|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n"
    )
    write(args.out, "oom_agreement_cost", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
