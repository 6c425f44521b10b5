"""Time of ``accel.save_state`` against a bare ``torch.save`` of the same tensors, and the
size on disk.

    gradsync launch --nproc-per-node 2 --backend ddp benchmarks/checkpoint_io.py --out bench-out

An MLP (4.2 M parameters, 16 MiB in fp32) with Adam after one optimizer step (its two
moment buffers: 32 MiB more), saved at a boundary (``--at mid-window``: one micro-step
later, when each rank also writes its window gradients). Per repetition, interleaved: (a) rank 0
``torch.save({"model": ..., "optimizer": ...})`` into a file, the other ranks waiting at a
barrier; (b) the same with an fsync; (c) ``accel.save_state`` into a new folder (atomic:
fsync, checksums, a marker, a rename; plus the RNG, the window and each rank's open-window
gradients). Rank 0 times each from a barrier to a barrier and writes ``checkpoint_io_{at}.json``.
The target (issue 11): median (c) / median (a) <= 1.5 on DDP.
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
    ap.add_argument("--at", choices=("boundary", "mid-window"), default="boundary",
                    help="save after the optimizer step, or one micro-step into the next window "
                         "(then each rank also writes its 16 MiB of window gradients)")
    args = ap.parse_args()
    out = Path(args.out)
    accel = Accelerator(gradient_accumulation_steps=4, seed=0)
    w = args.width
    model = nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                          nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.Linear(w, 1))
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
            state: dict[str, Any] = {"model": accel.unwrap_model(model).state_dict(),
                                     "optimizer": opt.state_dict()}
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

    times: dict[str, list[float]] = {"torch.save": [], "torch.save+fsync": [], "save_state": []}
    for i in range(args.repeats):
        times["torch.save"].append(bare(i, False))
        times["torch.save+fsync"].append(bare(i, True))
        times["save_state"].append(gradsync_save(i))
    if accel.is_main_process:
        median = {k: statistics.median(v) for k, v in times.items()}
        result = {
            "backend": accel.backend, "world_size": accel.world_size, "repeats": args.repeats,
            "at": args.at,
            "parameters": sum(p.numel() for p in model.parameters()),
            "median_s": median, "times_s": times,
            "ratio_vs_torch_save": median["save_state"] / median["torch.save"],
            "ratio_vs_torch_save_fsync": median["save_state"] / median["torch.save+fsync"],
            "bytes": {"torch.save": (work / "bare-0-0.pt").stat().st_size,
                      "save_state": folder_bytes(work / "state-0")},
            "torch": torch.__version__,
        }
        (out / f"checkpoint_io_{args.at}.json").write_text(json.dumps(result, indent=1))
        mib = 1024 * 1024
        print(f"{accel.backend}, {accel.world_size} ranks, {result['parameters']} parameters, "
              f"saved at {args.at}, median of {args.repeats}:")
        for k, v in median.items():
            print(f"  {k:18s} {v * 1000:8.1f} ms")
        print(f"  save_state / torch.save = {result['ratio_vs_torch_save']:.2f} "
              f"(/ torch.save+fsync = {result['ratio_vs_torch_save_fsync']:.2f})")
        print(f"  on disk: torch.save {result['bytes']['torch.save'] / mib:.1f} MiB, "
              f"save_state {result['bytes']['save_state'] / mib:.1f} MiB")
        shutil.rmtree(work, ignore_errors=True)
    accel.end()


if __name__ == "__main__":
    main()
