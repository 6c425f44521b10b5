"""DDP scenarios, run by mp_worker.py inside one 2-rank gloo group."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from gradsync import Accelerator

from scenarios.common import Loop, make_model, train


def train_ddp(*, steps: int | str, loop: Loop, policy: str = "auto") -> dict[str, Any]:
    accel = Accelerator(
        backend="ddp", gradient_accumulation_steps=steps, sync_policy=policy, seed=0, audit=True
    )
    return train(accel, loop)


def misuse() -> dict[str, Any]:
    """Each misuse raises a clear error; returns the messages."""
    accel = Accelerator(backend="ddp", gradient_accumulation_steps=4)
    raw = make_model()
    model = accel.prepare(raw)
    messages: dict[str, str] = {}
    try:
        with accel.accumulate(raw):  # the unwrapped model: deferral would do nothing
            pass
    except RuntimeError as err:
        messages["unprepared"] = str(err)
    try:
        accel.backward(F.mse_loss(model(torch.randn(2, 8)), torch.randn(2, 1)))
    except RuntimeError as err:
        messages["outside"] = str(err)
    other = torch.optim.SGD(make_model(1).parameters(), lr=0.1)
    try:
        accel.prepare(make_model(), other)
    except ValueError as err:
        messages["foreign_optimizer"] = f"{type(err).__name__}: {err}"
    return messages


def sharding(*, samples: int, micro_batch: int, epochs: int = 2) -> dict[str, Any]:
    """The ids this rank's prepared loader yields, per epoch."""
    from torch.utils.data import DataLoader

    from scenarios.common import Indexed

    accel = Accelerator(backend="ddp", seed=3)
    loader = accel.prepare(DataLoader(Indexed(samples), batch_size=micro_batch, shuffle=True))
    per_epoch = [[int(i) for _, _, idx in loader for i in idx] for _ in range(epochs)]
    return {"len": len(loader), "epochs": per_epoch}


def export_model() -> dict[str, Any]:
    from scenarios.common import export_model as export

    return export(Accelerator(backend="ddp", gradient_accumulation_steps=4, seed=0))
