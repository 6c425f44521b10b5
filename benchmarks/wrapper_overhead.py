"""What gradsync adds to one micro-step, the prepared dataloader included.

    python benchmarks/wrapper_overhead.py [--reps 15] [--iters 2000] [--out DIR]

One process, a model so small that the wrapper dominates (Linear(8, 1), micro-batch 4, SGD,
k=4, backend "single"). Two loops over the same 4-row batches, timed in interleaved
repetitions (the order alternates, so drift on a shared machine hits both alike):

* bare: a plain DataLoader, ``loss / k``, ``backward``, ``step`` + ``zero_grad`` every k-th;
* gradsync: the prepared DataLoader, ``accumulate``, ``accel.backward``, the gated
  ``step`` / ``zero_grad`` on every micro-step.

Prints and writes (``DIR/wrapper_overhead.json``) the median per-micro-step time of each
loop and the median of the per-repetition differences (the overhead), with its range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any


def measure(reps: int, iters: int, k: int = 4) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from gradsync import Accelerator

    torch.set_num_threads(1)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    data = TensorDataset(torch.randn(iters * 4, 8), torch.randn(iters * 4, 1))

    def model_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        return model, torch.optim.SGD(model.parameters(), lr=1e-3)

    bare_model, bare_opt = model_opt()
    bare_loader = DataLoader(data, batch_size=4)

    def bare() -> float:
        t0 = time.perf_counter()
        for i, (x, y) in enumerate(bare_loader):
            loss = F.mse_loss(bare_model(x), y) / k
            loss.backward()
            if (i + 1) % k == 0:
                bare_opt.step()
                bare_opt.zero_grad()
        return time.perf_counter() - t0

    accel = Accelerator(backend="single", gradient_accumulation_steps=k)
    gs_model, gs_opt, gs_loader = accel.prepare(*model_opt(), DataLoader(data, batch_size=4))

    def wrapped() -> float:
        t0 = time.perf_counter()
        for x, y in gs_loader:
            with accel.accumulate(gs_model):
                loss = F.mse_loss(gs_model(x), y)
                accel.backward(loss)
                gs_opt.step()
                gs_opt.zero_grad()
        return time.perf_counter() - t0

    bare()
    wrapped()  # warm-up: one pass each
    bare_us: list[float] = []
    gs_us: list[float] = []
    for r in range(reps):
        pair = [(bare, bare_us), (wrapped, gs_us)]
        for fn, sink in pair if r % 2 == 0 else reversed(pair):
            sink.append(fn() / iters * 1e6)
    diffs = [g - b for g, b in zip(gs_us, bare_us)]
    return {
        "model": "Linear(8, 1), micro-batch 4, SGD, backend 'single', prepared DataLoader",
        "k": k, "reps": reps, "micro_steps_per_rep": iters,
        "bare_us": statistics.median(bare_us), "gradsync_us": statistics.median(gs_us),
        "overhead_us": statistics.median(diffs), "overhead_us_min": min(diffs),
        "overhead_us_max": max(diffs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--reps", type=int, default=15, help="interleaved repetitions (default 15)")
    p.add_argument("--iters", type=int, default=2000, help="micro-steps per repetition (default 2000)")
    p.add_argument("--out", default=None, help="folder for wrapper_overhead.json (default: print only)")
    args = p.parse_args()
    result = measure(args.reps, args.iters)
    print(f"bare {result['bare_us']:.1f} us, gradsync {result['gradsync_us']:.1f} us per micro-step; "
          f"overhead {result['overhead_us']:.1f} us (median of {args.reps} interleaved repetitions, "
          f"range {result['overhead_us_min']:.1f} to {result['overhead_us_max']:.1f})")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "wrapper_overhead.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
