"""torch.compile with gradsync: compiled before prepare, compiled after it, and
``Accelerator(compile=True)``, on DDP and FSDP2 (one 2-rank gloo group for all of them:
compiling is slow; on one process: unit/test_compile_single.py). Equal to one process
(fp32, 1e-5), and deferral stays real: no gradient collective off the boundary."""

from __future__ import annotations

import pytest

from harness import Scenario, Shared
from harness.checks import assert_matches_one_process
from scenarios import compiled
from scenarios.common import Loop

SAMPLES = 44
RUN = Loop(samples=SAMPLES, micro_batch=2, epochs=1)
WHERE = ("before", "after", "option")
SCENARIOS = {
    f"{b}_{w}": Scenario(compiled.train_compiled, backend=b, where=w, steps=4, loop=RUN)
    for b in ("ddp", "fsdp")
    for w in WHERE
}


SHARED = Shared("gloo2", SCENARIOS, env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})


@pytest.fixture(scope="module")
def results(shared):
    return shared(SHARED)


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
