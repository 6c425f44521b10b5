"""Scripts for `gradsync verify`'s tests, one per --case:

- ``dataset-noise``: the dataset adds torch.rand noise in __getitem__ (no fixed generator):
  verify replays the batches each rank read, so the runs still agree;
- ``forward-noise``: the loss adds torch.randn noise in the training step: not deterministic;
- ``no-loader``: trains on tensors it slices itself, no prepared loader;
- ``no-accumulate``: builds an Accelerator and a loader, never enters accumulate;
- ``fail``: raises before training;
- ``hang``: sleeps before training;
- ``shards-itself``: an IterableDataset with dataset_shards_itself=True.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from gradsync import Accelerator


class Noisy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int = 64, noise: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True)
        self.noise = noise

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i]
        if self.noise:
            x = x + 0.5 * torch.rand(8)  # random augmentation, no fixed generator
        return x, self.y[i]


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(32):
            x = torch.randn(8)
            yield x, x.sum(0, keepdim=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True)
    case = parser.parse_args().case
    if case == "fail":
        raise RuntimeError("this script fails on purpose")
    if case == "hang":
        time.sleep(600)
    accel = Accelerator(
        seed=0,
        gradient_accumulation_steps=2,
        dataset_shards_itself=True if case == "shards-itself" else None,
    )
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    dataset: Dataset[tuple[torch.Tensor, torch.Tensor]] = (
        Stream() if case == "shards-itself" else Noisy(noise=case == "dataset-noise")
    )
    loader = DataLoader(dataset, batch_size=4, shuffle=case != "shards-itself")
    if case == "no-loader":
        model, optimizer = accel.prepare(model, optimizer)
        data = Noisy()
        batches = [(data.x[i : i + 4], data.y[i : i + 4]) for i in range(0, 64, 4)]
    else:
        model, optimizer, loader = accel.prepare(model, optimizer, loader)
        batches = loader  # type: ignore[assignment]
    if case == "no-accumulate":
        accel.end()
        return
    for _ in range(2):
        for x, y in batches:
            with accel.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                if case == "forward-noise":
                    loss = loss + 0.1 * torch.randn(()) * loss
                accel.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    accel.end()


if __name__ == "__main__":
    main()
