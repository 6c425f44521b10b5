"""CUDA/NCCL scenarios (one rank per GPU), run only where a GPU is present."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from gradsync import Accelerator, audit

from scenarios.common import Loop, train


def setup_process_group() -> None:
    audit.register()
    dist.init_process_group(audit.AUDIT_BACKEND["cuda"], timeout=timedelta(seconds=180))


def train_ddp_cuda(*, steps: int, loop: Loop) -> dict[str, Any]:
    accel = Accelerator(backend="ddp", gradient_accumulation_steps=steps, seed=0, audit=True)
    assert accel.device.type == "cuda", accel.device
    return train(accel, loop)
