"""Peak tensor memory of a stretch of code, above the level at its start: what the benchmarks'
memory column reports.

    with PeakMemory(device) as probe:
        ...one optimizer step...
    probe.peak_bytes     # the highest level seen, minus the level at entry

On a GPU it is ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus
``memory_allocated`` at entry: the caching allocator's own count of live tensor bytes.

On the CPU torch allocates tensors with glibc's ``malloc`` (no caching allocator), so the
live tensor heap is read from glibc: ``mallinfo2()``, sampled by a ``TorchDispatchMode``
after every op that reaches the dispatcher (forward, the autograd engine's backward ops,
the optimizer's, the collectives' buffers), and at entry and exit.

**What "live heap" means here: ``uordblks + hblkhd``**, the bytes of chunks ``malloc`` has
handed out and not yet taken back: ``uordblks`` those inside the arenas (small and
medium allocations, and large ones once glibc's dynamic mmap threshold has grown past
them), ``hblkhd`` those served by their own ``mmap`` (large allocations; unmapped on
``free``). Both fall when a tensor is freed. ``arena`` (the bytes the arenas took from the
system) is not used: it counts free chunks glibc keeps for reuse, so, like the process RSS,
it does not fall when tensors are freed and keeps the high-water mark of earlier, unrelated
work. The reading includes a chunk header per allocation (16 bytes) and whatever else
``malloc`` serves meanwhile (gloo's buffers, Python objects above 512 bytes: pymalloc maps
its own arenas for the small ones), which is noise of kilobytes against tensors of
megabytes. Sampling after each op misses what an op allocates and frees inside itself (a
kernel's scratch space); it sees every tensor an op returns or keeps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HeapSampler", "PeakMemory", "heap_reader", "live_heap_bytes", "no_gradients"]


def no_gradients(*models: Any) -> None:
    """Drop the models' ``.grad`` and collect cyclic garbage: every policy's window then starts
    from the same state (parameters and optimizer state, no gradients), whatever the previous
    step left."""
    import gc

    for model in models:
        for p in model.parameters():
            p.grad = None
    gc.collect()


class _Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc >= 2.33): ten ``size_t`` fields."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_reader() -> Callable[[], int] | None:
    """A function returning the live heap in bytes (``uordblks + hblkhd``), or None where
    the C library has no ``mallinfo2`` (not glibc, or glibc older than 2.33)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _Mallinfo2
    mallinfo2.argtypes = []

    def live() -> int:
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)

    return live


_READ = heap_reader()


def live_heap_bytes() -> int:
    """The live heap now, in bytes (``uordblks + hblkhd``; see the module's docstring)."""
    if _READ is None:
        raise RuntimeError(
            "mallinfo2() is not available: the CPU memory column needs glibc >= 2.33"
        )
    return _READ()


class HeapSampler(TorchDispatchMode):
    """Reads the live heap after every op dispatched while it is active, keeping the highest
    level above the one at entry (``peak_bytes``), the level at entry (``baseline``) and how
    many ops it saw. A dispatch mode is thread-local: ops that other threads run (gloo's)
    are seen at the next sample of this thread, since the heap is the process's."""

    def __init__(self) -> None:
        super().__init__()
        self.baseline = 0
        self.peak = 0  # absolute, bytes
        self.ops = 0

    def sample(self) -> int:
        level = live_heap_bytes()
        if level > self.peak:
            self.peak = level
        return level

    @property
    def peak_bytes(self) -> int:
        """The highest live heap seen, above the level at entry (bytes)."""
        return self.peak - self.baseline

    def __enter__(self) -> HeapSampler:
        self.baseline = self.peak = live_heap_bytes()
        self.ops = 0
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.sample()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        self.sample()
        return out


class PeakMemory:
    """Peak tensor memory of a block above the level at its start, on ``device``: CUDA's
    allocator counters on a GPU, ``HeapSampler`` on the CPU. After the block:
    ``peak_bytes`` (the peak above the start), ``baseline`` (the level at the start, bytes)
    and ``method`` (how it was measured, for the output's notes); inside it, ``level()``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = 0
        self.peak_bytes = 0
        self._sampler: HeapSampler | None = None
        if device.type == "cuda":
            self.method = "torch.cuda.max_memory_allocated - memory_allocated at the window start"
        else:
            self.method = (
                "live heap (glibc mallinfo2 uordblks + hblkhd) sampled after every op by a "
                "TorchDispatchMode, peak minus the level at the window start"
            )

    def level(self) -> int:
        """The level now, above the one at entry (bytes): inside the block, what is held at
        this point (e.g. between two micro-steps of a window)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.memory_allocated(self.device)) - self.baseline
        assert self._sampler is not None, "inside the block only"
        return self._sampler.sample() - self.baseline

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = int(torch.cuda.memory_allocated(self.device))
        else:
            self._sampler = HeapSampler().__enter__()
            self.baseline = self._sampler.baseline
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device)) - self.baseline
        else:
            assert self._sampler is not None
            self._sampler.__exit__(kind, err, tb)
            self.peak_bytes = self._sampler.peak_bytes
