"""A job that runs until `gradsync launch` is stopped: the launcher's signal tests run it.

    stop_train.py FOLDER graceful   # on SIGTERM: writes FOLDER/got-R, takes 2 s to finish, writes FOLDER/done-R
    stop_train.py FOLDER plain      # no handler: SIGTERM or SIGINT ends it as they end python
    stop_train.py FOLDER stubborn   # ignores SIGTERM: only the end of the grace period ends it

Each rank trains one window of a small model on 2 ranks, writes FOLDER/started-R (its pid),
then waits (outside any collective) until it is stopped.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

from gradsync import Accelerator


def main() -> None:
    folder, mode = Path(sys.argv[1]), sys.argv[2]
    accel = Accelerator(backend="ddp", gradient_accumulation_steps=2)
    rank = accel.rank

    def graceful(signum: int, frame: object) -> None:
        (folder / f"got-{rank}").write_text(signal.Signals(signum).name)
        time.sleep(2)  # e.g. a checkpoint being written
        (folder / f"done-{rank}").write_text("done")
        os._exit(0)

    if mode == "graceful":
        signal.signal(signal.SIGTERM, graceful)
    elif mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    model = accel.prepare(torch.nn.Linear(4, 1))
    for _ in range(2):
        with accel.accumulate(model):
            accel.backward(model(torch.ones(2, 4)).sum())
    (folder / f"started-{rank}").write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
