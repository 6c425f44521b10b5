"""Pipeline x FSDP2 x tensor parallel on 8 gloo ranks: pp=2 x dp_shard=2 x tp=2, each stage's
Linears split over tp by a plan written for the whole model, GPipe and 1F1B under defer and
every_step with k = 1 and 4 (a partial last window), against one process on the same global windows; the audit
keeps the gradient reduction off the boundary under defer, with tp and pp on their own lines.

Every scenario runs in the 8-rank group shared with the other 8-rank modules.
"""

from __future__ import annotations

import pytest

from harness import Scenario, Shared
from harness.checks import assert_pipeline_matches_one_process
from scenarios import pp

SAMPLES = 56  # 7 micro-batches of 4 per data-parallel rank: windows of 4 and 3
CUBE = {"pp": 2, "dp_shard": 2, "tp": 2}
#: (schedule, k, policy): both schedules, both window lengths, both policies.
RUNS = [(s, k, p) for s in ("GPipe", "1F1B") for k in (1, 4) for p in ("defer", "every_step")]
SCENARIOS = {
    f"pp_cube_{s}_k{k}_{p}": Scenario(
        pp.train_pp,
        dims=CUBE,
        steps=k,
        policy=p,
        schedule=s,
        microbatches=2,
        samples=SAMPLES,
        micro_batch=4,
        tp_plan=pp.TP_PLAN,
    )
    for s, k, p in RUNS
}

SHARED = Shared("gloo8", SCENARIOS, nproc=8)


@pytest.fixture(scope="module")
def results(shared):
    return shared(SHARED)


@pytest.mark.parametrize("schedule, k, policy", RUNS)
def test_the_4d_mesh_equals_one_process(results, schedule, k, policy):
    ranks = results[f"pp_cube_{schedule}_k{k}_{policy}"]
    assert sorted((r["stage"], r["data_rank"]) for r in ranks) == [
        (s, d) for s in (0, 1) for d in (0, 1) for _ in (0, 1)
    ]
    assert_pipeline_matches_one_process(ranks, samples=SAMPLES)


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_defer_reduces_gradients_only_at_the_boundary(results, schedule):
    for r in results[f"pp_cube_{schedule}_k4_defer"]:
        for rec in r["audit"]:
            groups = rec["groups"]
            assert groups["tp"]["reduction_bytes"] > 0 and groups["pp"]["bytes"] > 0
            assert (rec["reduction_bytes"] > 0) == rec["boundary"], rec
