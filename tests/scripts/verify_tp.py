"""A tensor-parallel MLP for `gradsync verify` on an N-D mesh: two colwise/rowwise Linear
pairs, trained through FSDP2 over the data-parallel dims (launch it with --parallelism, e.g.
dp_shard=2,tp=2 on 4 ranks). Each data-parallel rank reads 5 micro-batches of 4 samples,
so k=2 ends in a partial window.

``--dp-bug`` multiplies the loss by 1 + the rank's dp_shard coordinate: a loss that depends
on the data-parallel rank, which one process cannot equal.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradsync import Accelerator

PLAN = {"up": "colwise", "down": "rowwise", "up2": "colwise", "down2": "rowwise"}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.up2 = nn.Linear(8, 16)
        self.down2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.down(torch.tanh(self.up(x)))
        return self.down2(torch.tanh(self.up2(h)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp-bug", action="store_true")
    args = parser.parse_args()
    accel = Accelerator(tp_plan=PLAN, seed=0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 8, generator=g)
    y = torch.sin(x.sum(1, keepdim=True))
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    model, optimizer, loader = accel.prepare(model, optimizer, loader)
    mesh = accel.mesh  # None in one process
    scale = 1 + mesh.get_local_rank("dp_shard") if args.dp_bug and mesh is not None else 1
    for _ in range(2):
        for xb, yb in loader:
            with accel.accumulate(model):
                loss = nn.functional.mse_loss(model(xb), yb) * scale
                accel.backward(loss)
                optimizer.step()
                optimizer.zero_grad()


if __name__ == "__main__":
    main()
