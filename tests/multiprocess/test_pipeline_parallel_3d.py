"""Pipeline x FSDP2 x tensor parallel on 8 gloo ranks: pp=2 x dp_shard=2 x tp=2, each stage's
Linears split over tp by a plan written for the whole model, under defer and every_step with
k = 4 (a partial last window), against one process on the same global windows; the audit
keeps the gradient reduction off the boundary under defer, with tp and pp on their own lines.

Both scenarios run in the 8-rank group shared with the other 8-rank modules.
"""

from __future__ import annotations

import pytest

from harness import Scenario, Shared
from harness.checks import assert_pipeline_matches_one_process
from scenarios import pp

SAMPLES = 56  # 7 micro-batches of 4 per data-parallel rank: windows of 4 and 3
CUBE = {"pp": 2, "dp_shard": 2, "tp": 2}
SCENARIOS = {
    f"pp_cube_{p}": Scenario(
        pp.train_pp,
        dims=CUBE,
        steps=4,
        policy=p,
        schedule="1F1B",
        microbatches=2,
        samples=SAMPLES,
        micro_batch=4,
        tp_plan=pp.TP_PLAN,
    )
    for p in ("defer", "every_step")
}

SHARED = Shared("gloo8", SCENARIOS, nproc=8)


@pytest.fixture(scope="module")
def results(shared):
    return shared(SHARED)


@pytest.mark.parametrize("policy", ["defer", "every_step"])
def test_the_4d_mesh_equals_one_process(results, policy):
    ranks = results[f"pp_cube_{policy}"]
    assert sorted((r["stage"], r["data_rank"]) for r in ranks) == [
        (s, d) for s in (0, 1) for d in (0, 1) for _ in (0, 1)
    ]
    assert_pipeline_matches_one_process(ranks, samples=SAMPLES)


def test_defer_reduces_gradients_only_at_the_boundary(results):
    for r in results["pp_cube_defer"]:
        for rec in r["audit"]:
            groups = rec["groups"]
            assert groups["tp"]["reduction_bytes"] > 0 and groups["pp"]["bytes"] > 0
            assert (rec["reduction_bytes"] > 0) == rec["boundary"], rec
