"""The benchmarks' memory probe measures tensors: known allocations inside the dispatch-mode
sampler show as a peak within a stated tolerance of their bytes, and freeing lowers the level."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

PROBE = Path(__file__).resolve().parents[2] / "benchmarks" / "peak_memory.py"
MiB = 2**20
#: What else the heap may hold above the tensors: chunk headers, the mode's own Python
#: objects, glibc's rounding (all kilobytes).
SLACK = 2 * MiB


def _probe():
    spec = importlib.util.spec_from_file_location("peak_memory", PROBE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probe = _probe()
pytestmark = pytest.mark.skipif(
    probe.heap_reader() is None, reason="needs glibc >= 2.33 (mallinfo2)"
)


@pytest.fixture(autouse=True)
def _warm() -> None:
    """The first ops of a process initialise torch's kernels (a lasting ~20 MiB): not the test's."""
    with probe.HeapSampler():
        torch.empty(MiB // 4).fill_(1.0)
        x = torch.ones(256, 256, requires_grad=True)
        (x * 2).sum().backward()


def test_a_64_mib_tensor_shows_as_64_mib_and_freeing_it_lowers_the_level():
    with probe.HeapSampler() as sampler:
        a = torch.empty(64 * MiB // 4)
        a.fill_(1.0)
        held = sampler.sample() - sampler.baseline
        del a
        after = sampler.sample() - sampler.baseline
    assert 64 * MiB <= sampler.peak_bytes < 64 * MiB + SLACK
    assert 64 * MiB <= held < 64 * MiB + SLACK
    assert after < SLACK, "the freed tensor must leave the live heap"
    assert sampler.ops >= 2


def test_the_peak_is_what_is_live_at_once_not_what_was_allocated_in_total():
    with probe.HeapSampler() as sampler:
        for _ in range(3):
            b = torch.zeros(32 * MiB // 4)  # one at a time: 32 MiB live, 96 MiB allocated
            del b
        c, d = torch.zeros(16 * MiB // 4), torch.zeros(16 * MiB // 4)
        both = sampler.sample() - sampler.baseline
        del c, d
    assert 32 * MiB <= sampler.peak_bytes < 32 * MiB + SLACK
    assert 32 * MiB <= both < 32 * MiB + SLACK


def test_backward_and_optimizer_allocations_are_seen():
    """Ops the autograd engine runs count: a 16 MiB leaf's gradient, created in backward, and
    SGD's momentum buffer of the same size, created in its first step."""
    w = torch.zeros(16 * MiB // 4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    with probe.HeapSampler() as sampler:
        (w * 3.0).sum().backward()
        opt.step()
    assert w.grad is not None
    # the gradient and the momentum buffer stay (32 MiB; w * 3.0 lived before them), give or
    # take what torch frees of its own meanwhile (the optimizer's first step frees ~1 MiB)
    assert 32 * MiB - SLACK <= sampler.peak_bytes < 32 * MiB + SLACK
    assert 32 * MiB - SLACK <= probe.live_heap_bytes() - sampler.baseline < 32 * MiB + SLACK


def test_peak_memory_on_the_cpu_is_the_sampler():
    with probe.PeakMemory(torch.device("cpu")) as peak:
        e = torch.ones(8 * MiB // 4)
        held = peak.level()
        del e
        after = peak.level()
    assert 8 * MiB <= peak.peak_bytes < 8 * MiB + SLACK
    assert 8 * MiB <= held < 8 * MiB + SLACK and after < SLACK
    assert peak.baseline > 0 and "mallinfo2" in peak.method


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_peak_memory_on_a_gpu_is_max_memory_allocated():
    device = torch.device("cuda", 0)
    with probe.PeakMemory(device) as peak:
        f = torch.ones(64 * MiB // 4, device=device)
        held = peak.level()
        del f
    assert 64 * MiB <= peak.peak_bytes < 64 * MiB + SLACK
    assert 64 * MiB <= held < 64 * MiB + SLACK
    assert "max_memory_allocated" in peak.method
