"""A job in which one rank goes wrong: the launcher tests run it.

    fail_rank.py raise          # rank 1 raises after the first window; rank 0 waits for it
    fail_rank.py hang FOLDER    # rank 1 stops answering; rank 0's barrier times out (timeout=10 s)

``hang`` times every collective out after 10 s, so its ranks first wait for each other with no
time limit (each writes FOLDER/ready-RANK and waits for the others'): however late one of them
starts on a loaded machine, the two then run the same few steps together, seconds apart at most.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from gradsync import Accelerator


def all_started(folder: Path) -> None:
    """Wait, with no time limit, until every rank of the launch has started."""
    (folder / f"ready-{os.environ['RANK']}").write_text("")
    while len(list(folder.glob("ready-*"))) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.05)


def main() -> None:
    mode = sys.argv[1]
    if mode == "hang":
        all_started(Path(sys.argv[2]))
    accel = Accelerator(
        backend="ddp", gradient_accumulation_steps=2, timeout=10 if mode == "hang" else None
    )
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
