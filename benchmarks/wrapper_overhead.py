"""What gradsync adds to one micro-step, the prepared dataloader included.

    python benchmarks/wrapper_overhead.py [--reps 15] [--iters 2000] [--out DIR]

One process, a model so small that the wrapper dominates (Linear(8, 1), micro-batch 4, SGD,
k=4, backend "single"). Two loops over the same 4-row batches, timed in interleaved
repetitions (the order alternates, so drift on a shared machine hits both alike):

* bare: a plain DataLoader, ``loss / k``, ``backward``, ``step`` + ``zero_grad`` every k-th;
* gradsync: the prepared DataLoader, ``accumulate``, ``accel.backward``, the gated
  ``step`` / ``zero_grad`` on every micro-step;
* seeded: the bare loop tuned by hand the way gradsync scales and clears: the 1/k scaling
  as backward's seed (``loss.backward(gradient=1/k)``: no division in the graph) and the
  gradients set to None directly (no ``zero_grad`` profiler record) — the floor;
* accelerate: Hugging Face Accelerate's ``accumulate`` loop (where it is installed).

Prints and writes (``DIR/wrapper_overhead.json``) the median per-micro-step time of each
loop and the median of the per-repetition differences to the bare loop (the overhead), with
its range; and gradsync's difference to the seeded loop (what gradsync's own bookkeeping
costs once its cheaper scaling is taken out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _model_opt() -> tuple[Any, Any]:
    """The model (seeded: every loop starts from the same weights) and its SGD."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _bare_loop(data: Any, k: int) -> Callable[[], float]:
    """The bare loop: a plain DataLoader, ``loss / k``, ``step`` + ``zero_grad`` every k-th."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    bare_model, bare_opt = _model_opt()
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

    return bare


def _gradsync_loop(data: Any, k: int) -> Callable[[], float]:
    """gradsync's loop: the prepared DataLoader, ``accumulate``, the gated calls."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from gradsync import Accelerator

    accel = Accelerator(backend="single", gradient_accumulation_steps=k)
    gs_model, gs_opt, gs_loader = accel.prepare(*_model_opt(), DataLoader(data, batch_size=4))

    def wrapped() -> float:
        t0 = time.perf_counter()
        for x, y in gs_loader:
            with accel.accumulate(gs_model):
                loss = F.mse_loss(gs_model(x), y)
                accel.backward(loss)
                gs_opt.step()
                gs_opt.zero_grad()
        return time.perf_counter() - t0

    return wrapped


def _seeded_loop(data: Any, k: int) -> Callable[[], float]:
    """The bare loop tuned by hand: 1/k as backward's seed, the gradients set to None."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    seed = torch.full((), 1.0 / k)
    seeded_model, seeded_opt = _model_opt()
    seeded_loader = DataLoader(data, batch_size=4)

    def seeded() -> float:
        t0 = time.perf_counter()
        for i, (x, y) in enumerate(seeded_loader):
            F.mse_loss(seeded_model(x), y).backward(gradient=seed)
            if (i + 1) % k == 0:
                seeded_opt.step()
                for group in seeded_opt.param_groups:
                    for p in group["params"]:
                        p.grad = None
        return time.perf_counter() - t0

    return seeded


def _accelerate_loop(data: Any, k: int) -> Callable[[], float] | None:
    """Accelerate's ``accumulate`` loop, or None where Accelerate is not installed."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    try:
        os.environ.setdefault("ACCELERATE_USE_CPU", "1")
        import accelerate

        acc = accelerate.Accelerator(gradient_accumulation_steps=k, cpu=True)
        acc_model, acc_opt, acc_loader = acc.prepare(*_model_opt(), DataLoader(data, batch_size=4))

        def accelerated() -> float:
            t0 = time.perf_counter()
            for x, y in acc_loader:
                with acc.accumulate(acc_model):
                    acc.backward(F.mse_loss(acc_model(x), y))
                    acc_opt.step()
                    acc_opt.zero_grad()
            return time.perf_counter() - t0

        return accelerated
    except ImportError:
        return None


def _interleaved_us(
    loops: dict[str, Callable[[], float]], reps: int, iters: int
) -> dict[str, list[float]]:
    """One warm-up pass of each loop, then ``reps`` repetitions, each loop first in turn:
    each loop's time per micro-step (us) in every repetition."""
    for fn in loops.values():
        fn()  # warm-up: one pass each
    times: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for r in range(reps):
        order = names[r % len(names) :] + names[: r % len(names)]  # each loop first in turn
        for name in order:
            times[name].append(loops[name]() / iters * 1e6)
    return times


def _over(times: dict[str, list[float]], name: str, base: str = "bare") -> list[float]:
    """Per repetition, loop ``name``'s time less loop ``base``'s."""
    return [a - b for a, b in zip(times[name], times[base])]


def measure(reps: int, iters: int, k: int = 4) -> dict[str, Any]:
    import torch
    from torch.utils.data import TensorDataset

    torch.set_num_threads(1)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    data = TensorDataset(torch.randn(iters * 4, 8), torch.randn(iters * 4, 1))

    loops: dict[str, Any] = {
        "bare": _bare_loop(data, k),
        "gradsync": _gradsync_loop(data, k),
        "seeded": _seeded_loop(data, k),
    }
    accelerated = _accelerate_loop(data, k)
    if accelerated is not None:
        loops["accelerate"] = accelerated
    times = _interleaved_us(loops, reps, iters)

    diffs = _over(times, "gradsync")
    result: dict[str, Any] = {
        "model": "Linear(8, 1), micro-batch 4, SGD, backend 'single', prepared DataLoader",
        "k": k,
        "reps": reps,
        "micro_steps_per_rep": iters,
        "bare_us": statistics.median(times["bare"]),
        "gradsync_us": statistics.median(times["gradsync"]),
        "seeded_us": statistics.median(times["seeded"]),
        "overhead_us": statistics.median(diffs),
        "overhead_us_min": min(diffs),
        "overhead_us_max": max(diffs),
        "over_seeded_us": statistics.median(_over(times, "gradsync", "seeded")),
    }
    if "accelerate" in times:
        result["accelerate_us"] = statistics.median(times["accelerate"])
        result["accelerate_overhead_us"] = statistics.median(_over(times, "accelerate"))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--reps", type=int, default=15, help="interleaved repetitions (default 15)")
    p.add_argument(
        "--iters", type=int, default=2000, help="micro-steps per repetition (default 2000)"
    )
    p.add_argument(
        "--out", default=None, help="folder for wrapper_overhead.json (default: print only)"
    )
    args = p.parse_args()
    result = measure(args.reps, args.iters)
    print(
        f"bare {result['bare_us']:.1f} us, gradsync {result['gradsync_us']:.1f} us per micro-step; "
        f"overhead {result['overhead_us']:.1f} us (median of {args.reps} interleaved repetitions, "
        f"range {result['overhead_us_min']:.1f} to {result['overhead_us_max']:.1f})"
    )
    print(
        f"seeded hand loop {result['seeded_us']:.1f} us: gradsync - seeded = {result['over_seeded_us']:.1f} us"
    )
    if "accelerate_us" in result:
        print(
            f"accelerate {result['accelerate_us']:.1f} us: overhead {result['accelerate_overhead_us']:.1f} us"
        )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "wrapper_overhead.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
