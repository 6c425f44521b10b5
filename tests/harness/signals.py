"""Train in this process until a signal stops it: the shared driver of the save-on-signal tests."""

from __future__ import annotations

import os

import pytest
import torch.nn.functional as F
from torch.utils.data import DataLoader

import gradsync

from scenarios.common import Indexed, make_model, make_optimizer


def run_until_signal(accel: gradsync.Accelerator, signum: int, at: int = 1) -> SystemExit:
    """Train until ``signum``, sent to this process after micro-step ``at``, stops it; the
    watch acts on it when the next window starts. Returns the SystemExit it raised."""
    model = make_model()
    opt = make_optimizer(model.parameters(), "sgd", 0.05)
    model, opt, loader = accel.prepare(model, opt, DataLoader(Indexed(40), batch_size=2))
    with pytest.raises(SystemExit) as stop:
        for i, (x, y, _) in enumerate(loader):
            with accel.accumulate(model):
                accel.backward(F.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
            if i == at:
                os.kill(os.getpid(), signum)
                assert accel.stop_requested
    return stop.value
