"""A job in which one rank goes wrong: the launcher tests run it.

    fail_rank.py raise   # rank 1 raises after the first window; rank 0 waits for it
    fail_rank.py hang    # rank 1 stops answering; rank 0's barrier times out (timeout=30 s)
"""

from __future__ import annotations

import sys
import time

import torch

from gradsync import Accelerator


def main() -> None:
    mode = sys.argv[1]
    accel = Accelerator(backend="ddp", gradient_accumulation_steps=2, timeout=30 if mode == "hang" else None)
    model = accel.prepare(torch.nn.Linear(4, 1))
    for _ in range(2):
        with accel.accumulate(model):
            accel.backward(model(torch.ones(2, 4)).sum())
    if accel.rank == 1:
        if mode == "raise":
            raise ValueError("boom from rank 1: the data file is missing")
        time.sleep(600)  # alive, but not answering (the launcher stops it)
    accel.wait_for_everyone()
    accel.end()


if __name__ == "__main__":
    main()
