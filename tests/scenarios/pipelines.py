"""The deferral self-check, unused parameters on DDP, and the data pipelines gradsync shards
(an IterableDataset, a WeightedRandomSampler, a bucketing batch sampler), in one 2-rank
group that gradsync creates itself, as a launched script would (counting wrapper, recorder
off): run by mp_worker.py."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, Sampler, WeightedRandomSampler

from gradsync import Accelerator, audit
from gradsync.backends import _group

from scenarios.common import Indexed, Net, captured_log, make_scheduler, to_lists

FEATURES = 8


def setup_process_group() -> None:
    """The group the DDP adapter creates when the self-check is on and audit is off."""
    _group.ensure_process_group("ddp", want_audit=False, self_check=True)


def _recorder_state() -> dict[str, Any]:
    rec = audit.recorder_of()
    assert rec is not None
    return {"enabled": rec.enabled, "records": len(rec.records)}


# -- the self-check -----------------------------------------------------------------------
def self_check(
    *, loop: str, backend: str = "ddp", steps: int = 4, windows: int = 5
) -> dict[str, Any]:
    """``loop``: "correct" (forward and backward in the block), "forward_outside" (the forward
    before the block), "own_no_sync" (the micro-step wrapped in a no_sync() of the user's
    own, so the boundary reduces nothing, as asked), "own_no_sync_around" (the user's
    no_sync() around the whole loop, as LocalSGD enters it), or "inner_module" (the
    forward through the prepared model's inner module: the boundary reduces nothing)."""
    torch.manual_seed(0)
    accel = Accelerator(
        backend=backend, gradient_accumulation_steps=steps, seed=0, sync_policy="defer"
    )
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = accel.prepare(model, opt)
    data = Indexed(64)
    around = model.no_sync() if loop == "own_no_sync_around" else contextlib.nullcontext()
    with captured_log(logging.WARNING) as messages, around:
        for i in range(windows * steps):
            x, y = data.x[2 * i : 2 * i + 2], data.y[2 * i : 2 * i + 2]
            if loop == "forward_outside":
                out = model(x)
                with accel.accumulate(model):
                    accel.backward(F.mse_loss(out, y))
            elif loop == "own_no_sync":
                with accel.accumulate(model), model.no_sync():
                    accel.backward(F.mse_loss(model(x), y))
            elif loop == "inner_module":
                with accel.accumulate(model):
                    accel.backward(F.mse_loss(model.module(x), y))
            else:
                with accel.accumulate(model):
                    accel.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    return {
        "warnings": [m for m in messages if "self-check" in m],
        "audit_is_none": accel.audit is None,
        "policy": accel.sync_policy,
        "after": _recorder_state(),
        "checking": accel._self_check is not None,
    }


# -- unused parameters --------------------------------------------------------------------
class Branchy(Net):
    """A side head used only in some micro-steps."""

    def __init__(self) -> None:
        super().__init__()
        self.side = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, side: bool = False) -> torch.Tensor:  # type: ignore[override]
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h) + self.side(h) if side else self.head(h)


def make_branchy() -> Branchy:
    torch.manual_seed(0)
    return Branchy()


def unused(
    *, find_unused: bool, steps: int = 4, samples: int = 40, micro_batch: int = 2
) -> dict[str, Any]:
    """The side head runs only in each window's first micro-step (off the boundary)."""
    accel = Accelerator(
        backend="ddp",
        gradient_accumulation_steps=steps,
        seed=0,
        sync_policy="defer",
        find_unused_parameters=find_unused,
    )
    model = make_branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(Indexed(samples), batch_size=micro_batch, shuffle=True)
    model, opt, loader = accel.prepare(model, opt, loader)
    windows: list[list[list[int]]] = []
    current: list[list[int]] = []
    try:
        for _ in range(2):
            for x, y, idx in loader:
                with accel.accumulate(model):
                    side = accel.micro_step.index == 0
                    accel.backward(F.mse_loss(model(x, side=side), y))
                    current.append([*(int(i) for i in idx), -1 if side else -2])
                    opt.step()
                    opt.zero_grad()
                if accel.sync_gradients:
                    windows.append(current)
                    current = []
    except RuntimeError as err:
        return {"error": str(err), "windows": windows}
    return {
        "error": None,
        "windows": windows,
        "state": to_lists(accel.get_state_dict(model)),
        "find_unused": bool(getattr(model, "find_unused_parameters", False)),
    }


# -- data pipelines -----------------------------------------------------------------------
class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """A stream of ``n`` samples (every rank reads all of it), sized."""

    def __init__(self, n: int) -> None:
        self.data = Indexed(n)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        for i in range(len(self.data)):
            yield self.data[i]

    def __len__(self) -> int:
        return len(self.data)


class Bucketing(Sampler[list[int]]):
    """A bucketing batch sampler: ids grouped by `length` (id % 3), buckets shuffled with
    ``self.generator`` (None: gradsync seeds it)."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.n, self.batch_size = n, batch_size
        self.generator: torch.Generator | None = None

    def _batches(self) -> list[list[int]]:
        out = []
        for length in range(3):
            ids = [i for i in range(self.n) if i % 3 == length]
            out += [ids[j : j + self.batch_size] for j in range(0, len(ids), self.batch_size)]
        return out

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._batches()
        for j in torch.randperm(len(batches), generator=self.generator).tolist():
            yield batches[j]

    def __len__(self) -> int:
        return len(self._batches())


def loader_run(
    *, kind: str, samples: int, micro_batch: int, steps: int = 2, epochs: int = 2
) -> dict[str, Any]:
    """Train over a loader gradsync shards; return the ids this rank saw per epoch and the
    windows (for the one-process reference). Each rank's global RNG differs on purpose: the
    batch sequence must not depend on it."""
    accel = Accelerator(backend="ddp", gradient_accumulation_steps=steps, seed=7)
    data = Indexed(samples)
    if kind == "iterable":
        raw = DataLoader(Stream(samples), batch_size=micro_batch)
    elif kind == "weighted":
        weights = [1.0 + (i % 5) for i in range(samples)]
        sampler = WeightedRandomSampler(weights, num_samples=samples, replacement=False)
        raw = DataLoader(data, batch_size=micro_batch, sampler=sampler)
    elif kind == "bucketing":
        raw = DataLoader(data, batch_sampler=Bucketing(samples, micro_batch))
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = make_scheduler(opt)
    model, opt, loader, sched = accel.prepare(model, opt, raw, sched)
    torch.manual_seed(1000 + accel.rank)
    epochs_seen: list[list[list[int]]] = []
    windows: list[list[list[int]]] = []
    current: list[list[int]] = []
    for _ in range(epochs):
        batches: list[list[int]] = []
        for x, y, idx in loader:
            with accel.accumulate(model):
                accel.backward(F.mse_loss(model(x), y))
                opt.step()
                sched.step()
                opt.zero_grad()
            batches.append([int(i) for i in idx])
            current.append(batches[-1])
            if accel.sync_gradients:
                windows.append(current)
                current = []
        epochs_seen.append(batches)
    return {
        "len": len(loader),
        "epochs": epochs_seen,
        "windows": windows,
        "state": to_lists(accel.get_state_dict(model)),
    }
