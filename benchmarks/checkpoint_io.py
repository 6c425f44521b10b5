"""Time of ``accel.save_state`` against a bare ``torch.save`` of the same tensors, and the
size on disk.

    gradsync launch --nproc-per-node 2 --backend ddp benchmarks/checkpoint_io.py --out bench-out

An MLP (4.2 M parameters, 16 MiB in fp32) with Adam after one optimizer step (its two
moment buffers: 32 MiB more), saved at a boundary (``--at mid-window``: one micro-step
later, when each rank also writes its window gradients). Per repetition, interleaved: (a) rank 0
``torch.save({"model": ..., "optimizer": ...})`` into a file, the other ranks waiting at a
barrier; (b) the same with an fsync; (c) ``accel.save_state`` into a new folder (atomic:
fsync, checksums, a marker, a rename; plus the RNG, the window and each rank's open-window
gradients); (d) ``accel.save_state(..., background=True)``: until it returns, and until
``wait_for_checkpoint()`` says it is committed. What each wrote is removed before the next
(outside the timing), so that every variant writes into the same free memory. Rank 0 times
each from a barrier to a barrier and writes ``checkpoint_io_{at}.json``.
The target: median (d) / median (a) <= 1.5 on DDP; (c) / (b) says what the durable default
costs beyond torch.save + fsync.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradsync import Accelerator


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument(
        "--at",
        choices=("boundary", "mid-window"),
        default="boundary",
        help="save after the optimizer step, or one micro-step into the next window "
        "(then each rank also writes its 16 MiB of window gradients)",
    )
    args = ap.parse_args()
    out = Path(args.out)
    accel = Accelerator(gradient_accumulation_steps=4, seed=0)
    w = args.width
    model = nn.Sequential(
        nn.Linear(w, w),
        nn.ReLU(),
        nn.Linear(w, w),
        nn.ReLU(),
        nn.Linear(w, w),
        nn.ReLU(),
        nn.Linear(w, w),
        nn.Linear(w, 1),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = accel.prepare(model, opt)
    x, y = torch.randn(8, w), torch.randn(8, 1)
    for _ in range(4 if args.at == "boundary" else 5):  # one optimizer step (and one micro-step)
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    work = out / "checkpoint_io"
    if accel.is_main_process:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
    accel.wait_for_everyone()

    def bare(i: int, sync: bool) -> float:
        accel.wait_for_everyone()
        start = time.perf_counter()
        if accel.is_main_process:
            state: dict[str, Any] = {
                "model": accel.unwrap_model(model).state_dict(),
                "optimizer": opt.state_dict(),
            }
            with open(work / f"bare-{i}-{int(sync)}.pt", "wb") as f:
                torch.save(state, f)
                if sync:
                    f.flush()
                    os.fsync(f.fileno())
        accel.wait_for_everyone()
        return time.perf_counter() - start

    def gradsync_save(i: int) -> float:
        accel.wait_for_everyone()
        start = time.perf_counter()
        accel.save_state(work / f"state-{i}")
        accel.wait_for_everyone()
        return time.perf_counter() - start

    def background_save(i: int) -> tuple[float, float]:
        """(until save_state returns, until the commit is done)."""
        accel.wait_for_everyone()
        start = time.perf_counter()
        accel.save_state(work / f"background-{i}", background=True)
        accel.wait_for_everyone()
        returned = time.perf_counter() - start
        accel.wait_for_checkpoint()
        return returned, time.perf_counter() - start

    sizes: dict[str, int] = {}

    def discard(name: str, what: Path) -> None:
        """Remove what a repetition wrote (outside the timing), so that every variant writes
        into the same free memory rather than the later ones waiting for the kernel to
        reclaim the page cache the earlier ones filled."""
        if accel.is_main_process:
            if name not in sizes:
                sizes[name] = what.stat().st_size if what.is_file() else folder_bytes(what)
            if what.is_dir():
                shutil.rmtree(what)
            else:
                what.unlink()
        accel.wait_for_everyone()

    times: dict[str, list[float]] = {
        "torch.save": [],
        "torch.save+fsync": [],
        "save_state": [],
        "save_state(background)": [],
        "background committed": [],
    }
    for i in range(args.repeats):
        times["torch.save"].append(bare(i, False))
        discard("torch.save", work / f"bare-{i}-0.pt")
        times["torch.save+fsync"].append(bare(i, True))
        discard("torch.save+fsync", work / f"bare-{i}-1.pt")
        times["save_state"].append(gradsync_save(i))
        discard("save_state", work / f"state-{i}")
        returned, committed = background_save(i)
        times["save_state(background)"].append(returned)
        times["background committed"].append(committed)
        discard("save_state(background)", work / f"background-{i}")
    if accel.is_main_process:
        median = {k: statistics.median(v) for k, v in times.items()}
        result = {
            "backend": accel.backend,
            "world_size": accel.world_size,
            "repeats": args.repeats,
            "at": args.at,
            "parameters": sum(p.numel() for p in model.parameters()),
            "median_s": median,
            "times_s": times,
            "ratio_vs_torch_save": median["save_state"] / median["torch.save"],
            "ratio_vs_torch_save_fsync": median["save_state"] / median["torch.save+fsync"],
            "ratio_committed_vs_torch_save_fsync": median["background committed"]
            / median["torch.save+fsync"],
            "ratio_background_vs_torch_save": median["save_state(background)"]
            / median["torch.save"],
            "bytes": sizes,
            "torch": torch.__version__,
        }
        (out / f"checkpoint_io_{args.at}.json").write_text(json.dumps(result, indent=1))
        mib = 1024 * 1024
        print(
            f"{accel.backend}, {accel.world_size} ranks, {result['parameters']} parameters, "
            f"saved at {args.at}, median of {args.repeats}:"
        )
        for k, v in median.items():
            print(f"  {k:24s} {v * 1000:8.1f} ms")
        print(
            f"  save_state / torch.save = {result['ratio_vs_torch_save']:.2f} "
            f"(/ torch.save+fsync = {result['ratio_vs_torch_save_fsync']:.2f}); "
            f"background: {result['ratio_background_vs_torch_save']:.2f}"
        )
        print(
            f"  on disk: torch.save {sizes['torch.save'] / mib:.1f} MiB, "
            f"save_state {sizes['save_state'] / mib:.1f} MiB"
        )
        shutil.rmtree(work, ignore_errors=True)
    accel.end()


if __name__ == "__main__":
    main()
