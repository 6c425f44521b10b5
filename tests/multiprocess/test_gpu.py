"""CUDA and NCCL paths: skipped where no GPU is present (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from harness import Scenario, run_scenarios
from harness.checks import max_diff, reference
from scenarios import gpu
from scenarios.common import Loop

pytestmark = pytest.mark.gpu


def test_single_backend_on_cuda_matches_the_cpu_reference(clean_env):
    from gradsync import Accelerator

    from scenarios.common import train

    accel = Accelerator(backend="single", gradient_accumulation_steps=4, seed=0)
    assert accel.device.type == "cuda"
    r = train(accel, Loop(samples=22, micro_batch=2))
    assert max_diff(r["state"], reference([r], samples=22)["state"]) < 1e-4


def test_ddp_over_nccl_defers_and_matches():
    nproc = min(2, torch.cuda.device_count())
    results = run_scenarios(
        {
            "k4": Scenario(gpu.train_ddp_cuda, steps=4, loop=Loop(samples=44, micro_batch=2)),
        },
        nproc=nproc,
    )
    ranks = results["k4"]
    ref = reference(ranks, samples=44)
    for r in ranks:
        assert max_diff(r["state"], ref["state"]) < 1e-4
        assert all(rec["reductions"] == 0 for rec in r["audit"] if not rec["boundary"])
        assert all(rec["reductions"] >= 1 for rec in r["audit"] if rec["boundary"]) or nproc == 1


def test_fp16_on_cuda_matches_the_hand_written_loop_and_skips_an_overflow(clean_env):
    import torch.nn.functional as F

    from gradsync import Accelerator

    from scenarios.common import Indexed, make_model, to_lists

    data, dev = Indexed(32), torch.device("cuda")

    def batch(i):
        return data.x[2 * i : 2 * i + 2].to(dev), data.y[2 * i : 2 * i + 2].to(dev)

    def spike(i):
        return 1e9 if i == 6 else 1.0  # window 1 overflows in its third micro-step

    model = make_model().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cuda")
    want = []
    for w in range(4):
        opt.zero_grad()
        for i in range(4 * w, 4 * w + 4):
            x, y = batch(i)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.mse_loss(model(x), y) * spike(i)
            scaler.scale(loss / 4).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        want.append(scaler.get_scale() < before)

    accel = Accelerator(backend="single", gradient_accumulation_steps=4, mixed_precision="fp16")
    ours = make_model()
    ours, ours_opt = accel.prepare(ours, torch.optim.SGD(ours.parameters(), lr=0.05))
    got = []
    for i in range(16):
        x, y = batch(i)
        with accel.accumulate(ours):
            accel.backward(F.mse_loss(ours(x), y) * spike(i))
            ours_opt.step()
            ours_opt.zero_grad()
        if accel.sync_gradients:
            got.append(accel.optimizer_step_was_skipped)
    assert got == want == [False, True, False, False]
    assert accel.scaler.get_scale() == scaler.get_scale()
    assert max_diff(to_lists(accel.get_state_dict(ours)), to_lists(model.state_dict())) < 1e-6
