"""What Accelerate calls each backend (``accelerator.distributed_type``): one table, here,
where backend names may be branched on."""

from __future__ import annotations

import enum


class DistributedType(str, enum.Enum):
    """Accelerate's names of the kinds of run; a value equals its name as a string, so it
    compares equal to Accelerate's own ``DistributedType`` members."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    MULTI_HPU = "MULTI_HPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    TPU = "XLA"  # the name before Accelerate 1.0, still compared against by older scripts
    MEGATRON_LM = "MEGATRON_LM"

    def __str__(self) -> str:
        return self.value


def distributed_type(backend: str, device_type: str, world_size: int) -> DistributedType:
    """The ``DistributedType`` of a run of ``backend`` on ``device_type`` over ``world_size``."""
    if backend == "deepspeed":
        return DistributedType.DEEPSPEED
    if backend == "fsdp":
        return DistributedType.FSDP
    if world_size == 1 and backend == "single":
        return DistributedType.NO
    return DistributedType.MULTI_GPU if device_type == "cuda" else DistributedType.MULTI_CPU
