"""CUDA and NCCL paths: skipped where no GPU is present (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from harness import run_scenarios
from scenarios.common import max_diff, reference

pytestmark = pytest.mark.gpu


def test_single_backend_on_cuda_matches_the_cpu_reference(clean_env):
    from gradsync import Accelerator

    from scenarios.common import train

    accel = Accelerator(backend="single", gradient_accumulation_steps=4, seed=0)
    assert accel.device.type == "cuda"
    r = train(accel, samples=22, micro_batch=2)
    assert max_diff(r["state"], reference([r], samples=22)["state"]) < 1e-4


def test_ddp_over_nccl_defers_and_matches():
    nproc = min(2, torch.cuda.device_count())
    results = run_scenarios("scenarios.gpu", {
        "k4": {"fn": "train_ddp_cuda", "steps": 4, "samples": 44, "micro_batch": 2},
    }, nproc=nproc)
    ranks = results["k4"]
    ref = reference(ranks, samples=44)
    for r in ranks:
        assert max_diff(r["state"], ref["state"]) < 1e-4
        assert all(rec["reductions"] == 0 for rec in r["audit"] if not rec["boundary"])
        assert all(rec["reductions"] >= 1 for rec in r["audit"] if rec["boundary"]) or nproc == 1
