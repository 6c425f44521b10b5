"""torch.compile with gradsync: compiled before prepare, compiled after it, and
``Accelerator(compile=True)``, on DDP and FSDP2 (one 2-rank gloo group for all of them:
compiling is slow) and on one process. Equal to one process (fp32, 1e-5), and deferral
stays real: no gradient collective off the boundary."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gradsync import Accelerator

from harness import run_scenarios
from scenarios.common import Net, assert_matches_one_process, make_model, max_diff, to_lists

SAMPLES = 44
RUN = {"samples": SAMPLES, "micro_batch": 2, "epochs": 1}
WHERE = ("before", "after", "option")
SCENARIOS = {f"{b}_{w}": {"fn": "train_compiled", "backend": b, "where": w, "steps": 4, **RUN}
             for b in ("ddp", "fsdp") for w in WHERE}


@pytest.fixture(scope="module")
def results():
    return run_scenarios("scenarios.compiled", SCENARIOS, env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
@pytest.mark.parametrize("where", WHERE)
def test_compiled_equals_one_process_and_defers(results, backend, where):
    ranks = results[f"{backend}_{where}"]
    assert_matches_one_process(ranks, samples=SAMPLES)
    for r in ranks:
        assert r["unwrapped_is_net"], "unwrap_model must see through torch.compile"
        assert r["compiled_graphs"] > 0, "the model must really run compiled"
        assert r["optimizer_steps"] == len(r["windows"]) == 3
        records = r["audit"]
        assert len(records) == 11
        assert not [rec for rec in records if not rec["boundary"] and rec["reductions"]]
        assert all(rec["reductions"] >= 1 for rec in records if rec["boundary"])


@pytest.mark.parametrize("where", WHERE)
def test_compiled_on_one_process(clean_env, where):
    accel = Accelerator(backend="single", gradient_accumulation_steps=2, seed=0,
                        compile=where == "option")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accel.prepare(torch.compile(model) if where == "before" else model, opt)
    if where == "after":
        model = torch.compile(model)
    batches = [(torch.randn(2, 8), torch.randn(2, 1)) for _ in range(4)]
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for w in range(2):
        ref_opt.zero_grad()
        (sum(F.mse_loss(ref(x), y) for x, y in batches[2 * w:2 * w + 2]) / 2).backward()
        ref_opt.step()
    for x, y in batches:
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    assert isinstance(accel.unwrap_model(model), Net)
    state = accel.get_state_dict(model)
    assert sorted(state) == sorted(ref.state_dict())
    assert max_diff(to_lists(state), to_lists(ref.state_dict())) < 1e-6
