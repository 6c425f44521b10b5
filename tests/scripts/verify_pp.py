"""A pipelined MLP for `gradsync verify` with pp: Linear-Tanh-Linear-Tanh | Linear-Tanh-Linear,
cut at module "4" into two stages (launch it with --parallelism, e.g. pp=2,dp_shard=2 on 4
ranks), one `pipeline_step` per micro-step (2 pipeline micro-batches). Each data-parallel
rank reads 5 micro-batches of 4 samples, so k=2 ends in a partial window.

``--dp-bug`` multiplies the loss by 1 + the rank's data-parallel coordinate: a loss that
depends on the data-parallel rank, which one process cannot equal.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradsync import Accelerator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp-bug", action="store_true")
    args = parser.parse_args()
    accel = Accelerator(pp_split=["4"], pp_microbatches=2, seed=0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 8, generator=g)
    y = torch.sin(x.sum(1, keepdim=True))
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 1),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    model, optimizer, loader = accel.prepare(model, optimizer, loader)
    mesh = accel.mesh  # None in one process
    scale = 1 + mesh.get_local_rank("dp_shard") if args.dp_bug and mesh is not None else 1

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, target) * scale

    for _ in range(2):
        for xb, yb in loader:
            with accel.accumulate(model):
                accel.pipeline_step(model, xb, yb, loss_fn)
                optimizer.step()
                optimizer.zero_grad()


if __name__ == "__main__":
    main()
