"""A job in which a rank raises its own AttributeError (a typo in the script), in three
orders of events: the launcher tests (test_launch_stop.py) run it on 2 ranks.

    raise_first.py FOLDER busy        # rank 1 raises; rank 0 is busy outside any collective
    raise_first.py FOLDER slow-exit   # rank 1 raises and takes 10 min to exit (a slow exit
                                      # handler); once it is exiting, rank 0 gives up
                                      # (sys.exit(3)) and exits first
    raise_first.py FOLDER both        # rank 0 raises ValueError and takes 10 min to exit; once
                                      # it is exiting, rank 1 raises AttributeError and exits
                                      # at once

The order is made by marker files, not by timing: it holds on a loaded machine.
"""

from __future__ import annotations

import atexit
import sys
import time
from pathlib import Path

import torch

from gradsync import Accelerator


def slow_exit(marker: Path) -> None:
    """An exit handler that takes long (a tracker uploading its last records, say); it runs
    after gradsync's worker recorded the exception."""
    marker.write_text("exiting")
    time.sleep(600)


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + 600
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    folder, mode = Path(sys.argv[1]), sys.argv[2]
    accel = Accelerator(backend="ddp", gradient_accumulation_steps=2)
    model = accel.prepare(torch.nn.Linear(4, 1))
    for _ in range(2):
        with accel.accumulate(model):
            accel.backward(model(torch.ones(2, 4)).sum())
    if mode == "busy":
        if accel.rank == 1:
            print(model.weights)
        time.sleep(300)
    elif mode == "slow-exit":
        marker = folder / "rank1-exiting"
        if accel.rank == 1:
            atexit.register(slow_exit, marker)
            print(model.weights)
        wait_for(marker)
        sys.exit(3)
    elif mode == "both":
        marker = folder / "rank0-exiting"
        if accel.rank == 0:
            atexit.register(slow_exit, marker)
            raise ValueError("rank 0 raised first")
        wait_for(marker)
        print(model.weights)
    accel.end()


if __name__ == "__main__":
    main()
