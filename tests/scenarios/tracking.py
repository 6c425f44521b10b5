"""Worker side of the trackers on a real 2-rank group (tests/multiprocess/test_tracking_ranks.py):
every rank makes the same calls; only rank 0 may write, and no call may wait for another rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradsync import audit
from gradsync.tracking import Trackers

NAMES = ["tensorboard", "wandb", "mlflow", "csv", "jsonl"]
#: Logs per rank: uneven on purpose; a log that waited for the other rank would hang.
LOGS = {0: 3, 1: 40}


def ranks(*, folder: str) -> dict[str, Any]:
    rank = dist.get_rank()
    recorder = audit.recorder_of()
    assert recorder is not None
    recorder.clear()
    steps = [0]
    trackers = Trackers(NAMES, folder, step=lambda: steps[0])
    trackers.init("proj", config={"lr": 0.5, "world": dist.get_world_size()})
    for i in range(LOGS[rank]):
        steps[0] = i
        trackers.log({"loss": torch.tensor(float(i)), "rank": rank})
    writer = trackers.get("tensorboard", unwrap=True)
    writer.add_scalar("extra", 1.5, 7)  # on every rank: does nothing off rank 0
    started = [t.name for t in trackers.started]
    trackers.finish()
    return {
        "started": started,
        "writer": type(writer).__name__,
        "collectives": [op for op, _ in recorder.outside],
    }
