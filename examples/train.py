"""A small regression model trained with gradient accumulation.

    gradsync launch --nproc-per-node 2 --gradient-accumulation-steps 4 examples/train.py

With ``--checkpoints DIR`` it saves every 5 optimizer steps (keeping the newest 2) and
resumes from the newest checkpoint there, so a job restarted after a failure goes on
where it stopped:

    gradsync launch --nproc-per-node 2 --max-restarts 3 examples/train.py --checkpoints ckpt

Settings come from the launcher (GRADSYNC_* variables); run it with plain `python` for
one process. It prints the loss of every optimizer step and, from gradsync's audit,
which micro-steps synchronised gradients.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from gradsync import Accelerator


def make_data(samples: int, features: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(samples, 1, generator=g)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoints", default=None, metavar="DIR", help="save and resume here")
    args = parser.parse_args()

    accel = Accelerator(audit=True, seed=0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    loader = DataLoader(make_data(args.samples, 16), batch_size=args.micro_batch_size, shuffle=True)
    model, optimizer, loader, scheduler = accel.prepare(model, optimizer, loader, scheduler)

    accel.print(
        f"backend={accel.backend} sync_policy={accel.sync_policy} world={accel.world_size} "
        f"accumulation={accel.gradient_accumulation_steps} batches/rank/epoch={len(loader)}"
    )
    # Resume from the newest complete checkpoint, if there is one (every rank gets the same).
    latest = gradsync.latest_checkpoint(args.checkpoints) if args.checkpoints else None
    if latest is not None:
        accel.load_state(latest)
        accel.print(f"resumed from {latest} at step {accel.optimizer_steps}")
    for epoch in range(loader.epoch, args.epochs):  # loader.epoch: where the resume left off
        window_loss = 0.0
        for x, y in loader:
            with accel.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accel.backward(loss)
                window_loss += loss.item()
                norm = accel.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                if accel.sync_gradients:
                    step = accel.micro_step
                    assert step is not None and norm is not None
                    accel.print(
                        f"epoch {epoch} step {accel.optimizer_steps}: loss {window_loss / step.size:.4f} "
                        f"grad-norm {float(norm):.3f} lr {scheduler.get_last_lr()[0]:.4f} "
                        f"({step.size} micro-batch{'es' if step.size > 1 else ''})"
                    )
                    window_loss = 0.0
            if args.checkpoints and accel.sync_gradients and accel.optimizer_steps % 5 == 0:
                accel.save_state(f"{args.checkpoints}/step-{accel.optimizer_steps}", keep_last=2)
    if accel.audit is not None:
        records = accel.audit.records
        syncs = [r for r in records if r.boundary]
        off = sum(r.reductions for r in records if not r.boundary)
        accel.print(
            f"done: {accel.optimizer_steps} optimizer steps, {len(records)} micro-steps; "
            f"gradient reductions on boundary micro-steps {sum(r.reductions for r in syncs)}, "
            f"off the boundary {off}"
        )
    accel.wait_for_everyone()
    accel.end()


if __name__ == "__main__":
    main()
