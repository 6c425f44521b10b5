"""A small training job started the way a cluster starts it (``srun``, ``mpiexec``, a pod's
command, an sbatch script's ``gradsync launch``), with nothing but ``Accelerator()``: no
backend named, no group formed by hand.

    python cluster_train.py OUT

Each rank writes ``OUT/rank{r}.json``: what ``gradsync._support.environment.detect`` found before the
Accelerator existed, the group it formed (rank, world, local rank, local main process), the
backend ``"auto"`` chose, and what ``scenarios.common.train`` records (the windows of sample
ids and the final parameters), from which the parent trains the one-process reference.
Tiny on purpose: 24 samples, micro-batches of 2, windows of 2, one epoch.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gradsync import Accelerator
from gradsync._support import environment

from scenarios.common import Loop, train

LOOP = Loop(samples=24, micro_batch=2, epochs=1, lr=0.05)
STEPS = 2


def main() -> None:
    out = Path(sys.argv[1])
    found = environment.detect()
    accel = Accelerator(gradient_accumulation_steps=STEPS, seed=0)
    result = train(accel, LOOP)
    report = {
        "environment": asdict(found),
        "samples": LOOP.samples,
        "rank": accel.rank,
        "world_size": accel.world_size,
        "local_rank": accel.local_rank,
        "local_main": accel.is_local_main_process,
        "main": accel.is_main_process,
        "backend": accel.backend,
        "group_size": dist.get_world_size() if dist.is_initialized() else 1,
        "group_rank": dist.get_rank() if dist.is_initialized() else 0,
        "windows": result["windows"],
        "state": result["state"],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{accel.rank}.json").write_text(json.dumps(report))
    accel.end()


if __name__ == "__main__":
    main()
