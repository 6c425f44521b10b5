"""DeepSpeed ZeRO 3 with ZeRO++ hpZ (``zero_hpz_partition_size``), run by mp_worker.py inside
one 4-rank audited gloo group (hpZ's secondary partition groups are sub-groups of it)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from gradsync import Accelerator

from scenarios.common import DEEPSPEED_PRELOAD as PRELOAD  # noqa: F401  (mp_worker.py)
from scenarios.common import Loop, Probe, make_model, train
from scenarios.deepspeed import ds_config

__all__ = ["hpz_config", "refused", "train_hpz"]


def hpz_config(hpz: int) -> dict[str, Any]:
    """ZeRO 3 with a secondary partition of ``hpz`` ranks. The persistence thresholds are 0
    so that every parameter of the tiny model is partitioned (by default DeepSpeed keeps
    small parameters whole on every rank, and hpZ would have nothing to do)."""
    return {
        "stage": 3,
        "zero_hpz_partition_size": hpz,
        "stage3_param_persistence_threshold": 0,
        "stage3_model_persistence_threshold": 0,
    }


def secondary_group_ranks() -> list[int]:
    """The ranks of this rank's hpZ secondary partition group (DeepSpeed's own record of it)."""
    from deepspeed.utils import groups

    group = groups._get_zero_param_intra_parallel_group()
    return [] if group is None else sorted(dist.get_process_group_ranks(group))


class SecondaryTensors(Probe):
    """How many parameters hold an hpZ secondary partition after each backward, and how
    many are partitioned at all (ZeRO 3 keeps none whole here)."""

    def __init__(self) -> None:
        self.held: list[int] = []
        self.persistent = 0

    def after_backward(self, accel: Any, model: nn.Module, window: int) -> None:
        params = list(model.module.parameters())
        self.held.append(sum(getattr(p, "ds_secondary_tensor", None) is not None for p in params))
        self.persistent = sum(bool(getattr(p, "ds_persist", False)) for p in params)

    def finish(self, accel: Any, model: nn.Module, scheduler: Any) -> dict[str, Any]:
        return {
            "secondary_held": self.held,
            "persistent": self.persistent,
            "n_params": len(list(model.module.parameters())),
        }


def train_hpz(
    *, hpz: int, steps: int | str, loop: Loop, policy: str, budget: int | None = None
) -> dict[str, Any]:
    """The shared loop on ZeRO 3 with ``zero_hpz_partition_size=hpz``: what it recorded,
    every collective per micro-step, the secondary group and the secondary tensors held."""
    accel = Accelerator(
        backend="deepspeed",
        gradient_accumulation_steps=steps,
        sync_policy=policy,
        seed=0,
        audit=True,
        sync_memory_budget=budget,
        deepspeed_config=ds_config(3, zero_optimization=hpz_config(hpz)),
    )
    assert accel.audit is not None
    start = len(accel.audit.records)
    out = train(accel, loop, model=make_model(), probe=SecondaryTensors())
    out["reason"] = accel.sync_policy_reason
    out["secondary_group"] = secondary_group_ranks()
    out["audit_ops"] = [[list(op) for op in rec.ops] for rec in accel.audit.records[start:]]
    return out


def refused(*, hpz: int) -> str:
    """Building the Accelerator with ``zero_hpz_partition_size=hpz`` on this group: the error."""
    try:
        Accelerator(
            backend="deepspeed",
            gradient_accumulation_steps=4,
            micro_batch_size=2,
            deepspeed_config=ds_config(3, zero_optimization=hpz_config(hpz)),
        )
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"
