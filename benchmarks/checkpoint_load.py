"""Time of ``accel.load_state``, and of checking the checkpoint's pickles within it.

    gradsync launch --nproc-per-node 2 --backend ddp benchmarks/checkpoint_load.py --out bench-out

The model of ``checkpoint_io.py`` (an MLP of 4.2 M parameters, Adam after one optimizer
step: 48 MiB of model and optimizer state), saved once at a boundary. Per repetition,
interleaved, each timed on rank 0 from a barrier to a barrier: ``load_state(folder)``
(every pickle checked against the format's allow-list before anything loads); and on rank 0
alone, the folder's verification with and without that check (``read_manifest``: sizes and
checksums of every file, plus the pickles). Writes ``checkpoint_load.json`` with the medians:
the check's own cost is the difference of the last two, and its share of ``load_state``.
Runs against a gradsync from before the check too (then only ``load_state`` is timed), so
the same script gives a before/after.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gradsync import Accelerator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--width", type=int, default=1024)
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
    for _ in range(4):
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    folder = accel.save_state(out / "checkpoint_load" / "ckpt")
    checking = "trusted" in inspect.signature(accel.load_state).parameters

    def timed_load() -> float:
        accel.wait_for_everyone()
        t0 = time.perf_counter()
        accel.load_state(folder)
        accel.wait_for_everyone()
        return (time.perf_counter() - t0) * 1e3

    def timed_verify(scan: bool) -> float:
        from gradsync.storage import safety
        from gradsync.storage.folder import _verify

        allowed = safety.allow_list().__contains__ if scan else None
        t0 = time.perf_counter()
        _verify(Path(folder), allowed)
        return (time.perf_counter() - t0) * 1e3

    timed_load()  # warm the page cache and the imports
    loads, plain, scanned = [], [], []
    for r in range(args.repeats):
        loads.append(timed_load())
        if checking and accel.is_main_process:
            pair = [(False, plain), (True, scanned)]
            for scan, sink in pair if r % 2 == 0 else reversed(pair):
                sink.append(timed_verify(scan))
    if accel.is_main_process:
        result: dict[str, object] = {
            "model": f"MLP width {w}, Adam, {accel.world_size} rank(s), backend {accel.backend}",
            "repeats": args.repeats,
            "load_state_ms": statistics.median(loads),
        }
        line = f"load_state {result['load_state_ms']:.1f} ms"
        if checking:
            check = statistics.median(scanned) - statistics.median(plain)
            result.update(
                verify_ms=statistics.median(plain),
                verify_and_scan_ms=statistics.median(scanned),
                scan_ms=check,
                scan_share=check / statistics.median(loads),
            )
            line += (
                f"; verifying the folder {result['verify_ms']:.2f} ms, with the pickle check "
                f"{result['verify_and_scan_ms']:.2f} ms: the check costs {check:.2f} ms "
                f"({check / statistics.median(loads):.1%} of load_state)"
            )
        (out / "checkpoint_load.json").write_text(json.dumps(result, indent=1))
        print(line, flush=True)
    accel.end()


if __name__ == "__main__":
    main()
