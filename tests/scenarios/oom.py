"""``on_oom="split"`` with a real allocation failure (run inside the workers): one rank's
address space is capped (RLIMIT_AS) so that a micro-batch of 8 cannot be allocated and one
of 4 can. Every rank must learn of it, drop the window, go on with micro-batches of 4 and
k doubled, and train on the same global windows: the result is compared with one process
trained on those windows (computed on a rank whose memory is not capped)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import resource
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from gradsync import Accelerator

from scenarios.common import FEATURES, Indexed, audited_gloo_group

#: Width of the wide activation: a micro-batch of b rows allocates b x 16 x WIDE floats
#: a few times over (about 100 MB per tensor at b = 8).
WIDE = 200_000


def setup_process_group() -> None:
    audited_gloo_group()


class WideNet(nn.Module):
    """An input layer whose activation is ``WIDE`` times as wide as its input (memory in
    proportion to the micro-batch), then two small layers: three units for FSDP2."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, 16)
        self.mid = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)
        self.register_buffer("ramp", torch.linspace(0, 1, WIDE), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = self.inp(x).unsqueeze(-1) * self.ramp
        return self.head(self.mid(wide.tanh().mean(-1)))


def _new_model() -> nn.Module:
    torch.manual_seed(0)
    return WideNet()


def _address_space() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def _capped(headroom: int | None) -> Iterator[None]:
    """RLIMIT_AS at the address space in use plus ``headroom`` bytes (put back afterwards)."""
    before = resource.getrlimit(resource.RLIMIT_AS)
    if headroom is not None:
        resource.setrlimit(resource.RLIMIT_AS, (_address_space() + headroom, before[1]))
    try:
        yield
    finally:
        if headroom is not None:
            resource.setrlimit(resource.RLIMIT_AS, before)


def _fits(rows: int, headroom: int) -> bool:
    """Whether a forward and backward of ``rows`` rows run within ``headroom`` bytes."""
    probe = _new_model()
    x = torch.randn(rows, FEATURES)
    try:
        with _capped(headroom):
            probe(x).sum().backward()
        return True
    except RuntimeError as err:
        if "can't allocate memory" not in str(err):
            raise
        return False


@functools.cache  # a rank's scenarios one after the other: the same model, the same need
def calibrated_headroom(rows: int = 4) -> int:
    """The address space a capped rank may take: what a micro-batch of ``rows`` needs here
    (found by bisection, with real allocation failures), and a third more. A micro-batch
    twice as large needs about twice as much, so it does not fit."""
    low, high = 0, 4 * 2**30
    while high - low > 4 * 2**20:
        mid = (low + high) // 2
        low, high = (low, mid) if _fits(rows, mid) else (mid, high)
    headroom = high * 4 // 3
    assert not _fits(2 * rows, headroom), "a micro-batch twice as large fits: no OOM to test"
    return headroom


@functools.cache  # a rank's later scenarios train on the same global windows
def _reference(
    windows: tuple[tuple[int, ...], ...], samples: int, lr: float
) -> tuple[torch.Tensor, ...]:
    """One process: each optimizer step on the mean loss over its global window of
    ``Indexed(samples)`` (whole: a slice's memory, once freed, would raise glibc's mmap
    threshold and change where a capped rank's later allocations come from)."""
    data = Indexed(samples)
    model = _new_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for window in windows:
        ids = list(window)
        F.mse_loss(model(data.x[ids]), data.y[ids]).backward()
        opt.step()
        opt.zero_grad()
    return tuple(p.detach() for p in model.parameters())


def split_on_oom(backend: str, capped_rank: int, epochs: int = 2, **options: Any) -> dict[str, Any]:
    """Train ``epochs`` over 64 samples, global batch 32 (micro 8 x k 2 x 2 ranks), with
    ``capped_rank``'s memory capped; report the plan after, the windows and the gap to one
    process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if os.environ.get("MALLOC_ARENA_MAX") != "1":  # tests/multiprocess/test_oom.py: ONE_ARENA
        raise RuntimeError("run with MALLOC_ARENA_MAX=1: a thread's arena would take the headroom")
    lr = 0.5
    data = Indexed(64)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("gradsync").addHandler(handler)
    try:
        accel = Accelerator(
            backend=backend,
            gradient_accumulation_steps=2,
            on_oom="split",
            timeout=300,
            **options,
        )
        model = _new_model()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        model, opt, loader = accel.prepare(model, opt, DataLoader(data, batch_size=8))
        windows: list[list[int]] = []
        current: list[int] = []
        losses: list[float] = []
        with _capped(calibrated_headroom() if rank == capped_rank else None):
            for _ in range(epochs):
                for x, y, ids in loader:
                    k = accel.gradient_accumulation_steps
                    with accel.accumulate(model):
                        loss = F.mse_loss(model(x), y)
                        accel.backward(loss)
                        opt.step()
                        opt.zero_grad()
                    if accel.gradient_accumulation_steps != k:  # re-planned: the window again
                        current = []
                        continue
                    current.extend(ids.tolist())
                    if accel.sync_gradients:
                        windows.append(current)
                        losses.append(accel.window_loss)
                        current = []
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, windows)
        global_windows = [sorted(i for g in gathered for i in g[n]) for n in range(len(windows))]
        state = accel.get_state_dict(model)
        trained = [v.detach().float() for v in state.values()]
        gap = None
        if rank != capped_rank:
            reference = _reference(tuple(map(tuple, global_windows)), len(data), lr)
            gap = max(
                ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
                for a, b in zip(trained, reference)
            )
        return {
            "plan": [accel.plan.micro_batch_size, accel.gradient_accumulation_steps],
            "windows": global_windows,
            "gap": gap,
            "said": [r for r in records if "out of memory" in r],
            "len": len(loader),
        }
    finally:
        logging.getLogger("gradsync").removeHandler(handler)
