"""A model trained a few micro-steps on backend "single", as the checkpoint tests (and the
processes they start) save and load it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from gradsync import Accelerator

from scenarios.common import Indexed, make_model, make_optimizer, make_scheduler


def trained(
    steps: int = 4, micro: int = 6, seed: int = 0
) -> tuple[Accelerator, torch.nn.Module, object, object, object]:
    accel = Accelerator(backend="single", gradient_accumulation_steps=steps, seed=seed)
    model = make_model()
    opt = make_optimizer(model.parameters(), "sgd", 0.05)
    sched = make_scheduler(opt)
    loader = DataLoader(Indexed(40), batch_size=2, shuffle=True)
    model, opt, loader, sched = accel.prepare(model, opt, loader, sched)
    it = iter(loader)
    for _ in range(micro):
        x, y, _ = next(it)
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
    return accel, model, opt, sched, loader


def fresh() -> tuple[Accelerator, torch.nn.Module, object, object, object]:
    return trained(micro=0, seed=5)
