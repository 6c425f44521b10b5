"""A tiny job for launcher tests: each rank trains one window and reports what it saw."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from gradsync import Accelerator


def main() -> None:
    out = Path(sys.argv[1])
    accel = Accelerator()
    model = accel.prepare(torch.nn.Linear(4, 1))
    for _ in range(accel.gradient_accumulation_steps):
        with accel.accumulate(model):
            accel.backward(model(torch.ones(2, 4)).sum())
    total = torch.tensor([float(accel.rank)])
    dist.all_reduce(total)
    report = {
        "rank": accel.rank,
        "world_size": accel.world_size,
        "local_rank": accel.local_rank,
        "backend": accel.backend,
        "accumulation": accel.gradient_accumulation_steps,
        "micro_batch_size": accel.config.micro_batch_size,
        "rank_sum": float(total),
        "args": sys.argv[2:],
        "env_backend": os.environ.get("GRADSYNC_BACKEND"),
        "mixed_precision": accel.mixed_precision,
        "device": os.environ.get("GRADSYNC_DEVICE"),
        "config": os.environ.get("GRADSYNC_CONFIG"),
    }
    (out / f"rank{accel.rank}.json").write_text(json.dumps(report))
    accel.end()
    code = int(os.environ.get("REPORT_EXIT_CODE", "0"))
    if code and report["rank"] == 1:
        sys.exit(code)


if __name__ == "__main__":
    main()
