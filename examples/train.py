"""A small regression model trained with gradient accumulation.

    gradsync launch --nproc-per-node 2 --gradient-accumulation-steps 4 examples/train.py

With ``--checkpoints DIR`` it saves every 5 optimizer steps (keeping the newest 2) and
resumes from the newest checkpoint there, so a job restarted after a failure goes on
where it stopped:

    gradsync launch --nproc-per-node 2 --max-restarts 3 examples/train.py --checkpoints ckpt

Settings come from the launcher (GRADSYNC_* variables); run it with plain `python` for
one process. After every optimizer step it prints the loss on a held-out set (the same on
every process, so it falls smoothly), and from gradsync's audit which micro-steps
synchronised gradients; at the end, one line with the first and the last loss.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from gradsync import Accelerator


def make_data(samples: int, features: int, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """A noisy linear target; the last quarter of the samples is held out."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    w = torch.randn(features, 1, generator=g) / features**0.5
    y = x @ w + 0.05 * torch.randn(samples, 1, generator=g)
    cut = samples * 3 // 4
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=640)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--checkpoints", default=None, metavar="DIR", help="save and resume here")
    args = parser.parse_args()

    accel = Accelerator(audit=True, seed=0)
    train_set, held_out = make_data(args.samples, 16)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
    loader = DataLoader(train_set, batch_size=args.micro_batch_size, shuffle=True)
    model, optimizer, loader, scheduler = accel.prepare(model, optimizer, loader, scheduler)
    x_eval, y_eval = (t.to(accel.device) for t in held_out.tensors)

    def held_out_loss() -> float:
        with torch.no_grad():
            return float(nn.functional.mse_loss(model(x_eval), y_eval))

    accel.print(
        f"backend={accel.backend} sync_policy={accel.sync_policy} world={accel.world_size} "
        f"accumulation={accel.gradient_accumulation_steps} batches/rank/epoch={len(loader)}"
    )
    # Resume from the newest complete checkpoint, if there is one (every rank gets the same).
    latest = gradsync.latest_checkpoint(args.checkpoints) if args.checkpoints else None
    if latest is not None:
        accel.load_state(latest)
        accel.print(f"resumed from {latest} at step {accel.optimizer_steps}")
    first = held_out_loss()
    accel.print(f"{'after resuming' if latest else 'before training'}: held-out loss {first:.4f}")
    last = first
    for epoch in range(loader.epoch, args.epochs):  # loader.epoch: where the resume left off
        for x, y in loader:
            with accel.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accel.backward(loss)
                norm = accel.clip_grad_norm_(model.parameters(), 5.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accel.sync_gradients:
                last = held_out_loss()
                assert norm is not None
                accel.print(
                    f"epoch {epoch} step {accel.optimizer_steps:2d}: held-out loss {last:.4f} "
                    f"{'#' * max(1, round(40 * last / first))}  grad-norm {float(norm):.3f}"
                )
            if args.checkpoints and accel.sync_gradients and accel.optimizer_steps % 5 == 0:
                # committed (fsync, marker, rename) by rank 0 while training goes on
                accel.save_state(
                    f"{args.checkpoints}/step-{accel.optimizer_steps}", keep_last=2, background=True
                )
    accel.print(
        f"held-out loss {first:.4f} -> {last:.4f} ({first / last:.1f}x lower) after "
        f"{accel.optimizer_steps} optimizer steps"
    )
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
