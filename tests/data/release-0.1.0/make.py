"""Writes the checkpoints of this folder (run once, by gradsync 0.1.0; kept as they were).

    python tests/data/release-0.1.0/make.py single          # one process
    gradsync launch --nproc-per-node 2 tests/data/release-0.1.0/make.py fsdp

The training: a frozen teacher and a trained student (two Linear layers), Adam, k=2, 3
optimizer steps on fixed data, saved at the boundary; ``<backend>-expected.pt`` holds the student's
parameters after a 4th step, which a run resumed from the checkpoint must reproduce.
The current gradsync loads these through ``tests/unit/test_checkpoint_releases.py`` and
``tests/scenarios/releases.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from gradsync import Accelerator

HERE = Path(__file__).resolve().parent


def models() -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    teacher = torch.nn.Linear(4, 4).requires_grad_(False)
    student = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return teacher, student, torch.optim.Adam(student.parameters(), lr=0.05)


def batches(world: int, rank: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The 2 micro-batches of 2 samples this rank trains on in optimizer step ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(2 * 2 * world, 4, generator=g), torch.randn(2 * 2 * world, 1, generator=g)
    mine = slice(rank * 4, rank * 4 + 4)
    xs, ys = x[mine], y[mine]
    return [(xs[:2], ys[:2]), (xs[2:], ys[2:])]


def train_step(
    accel: Accelerator,
    teacher: torch.nn.Module,
    student: torch.nn.Module,
    opt: torch.optim.Optimizer,
    step: int,
) -> None:
    for x, y in batches(accel.world_size, accel.rank, step):
        with accel.accumulate(student):
            loss = torch.nn.functional.mse_loss(student(teacher(x)), y)
            accel.backward(loss)
            opt.step()
            opt.zero_grad()


def main(backend: str) -> None:
    accel = Accelerator(backend=backend, gradient_accumulation_steps=2)
    teacher, student, opt = models()
    teacher = accel.prepare(teacher)
    student, opt = accel.prepare(student, opt)
    for step in range(3):
        train_step(accel, teacher, student, opt, step)
    accel.save_state(HERE / backend)
    train_step(accel, teacher, student, opt, 3)
    state = accel.get_state_dict(student)
    if accel.is_main_process:
        torch.save(state, HERE / f"{backend}-expected.pt")
    accel.end()


if __name__ == "__main__":
    main(sys.argv[1])
