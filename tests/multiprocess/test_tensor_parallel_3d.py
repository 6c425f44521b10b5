"""The 3-D mesh (dp_replicate 2, dp_shard 2, tp 2) on 8 gloo ranks with the tiny net: every policy
equals one process on the same global windows; the audit splits the traffic
into shard, replicate and tp. One launched group (about 25 s on 2 cores), shared with the
other 8-rank modules."""

from __future__ import annotations

import pytest

from harness import Scenario, Shared
from harness.checks import assert_nd_matches_one_process
from scenarios import tp
from scenarios.common import Loop

SAMPLES = 28
RUN = Loop(samples=SAMPLES, micro_batch=2)
CUBE = {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
SCENARIOS = {
    p: Scenario(tp.train_tp, dims=CUBE, steps=4, loop=RUN, policy=p)
    for p in ("every_step", "defer", "defer_replicate", "auto")
}


SHARED = Shared("gloo8", SCENARIOS, nproc=8)


@pytest.fixture(scope="module")
def results(shared):
    return shared(SHARED)


@pytest.mark.parametrize("policy", SCENARIOS)
def test_the_3d_mesh_equals_one_process(results, policy):
    ranks = results[policy]
    assert ranks[0]["mesh_shape"] == [2, 2, 2] and ranks[0]["data_size"] == 4
    assert_nd_matches_one_process(ranks, samples=SAMPLES)


def test_only_the_shard_group_reduces_off_the_boundary_under_defer_replicate(results):
    for r in results["defer_replicate"]:
        for rec in r["audit"]:
            groups = rec["groups"]
            assert groups["tp"]["reduction_bytes"] > 0 and groups["shard"]["reduction_bytes"] > 0
            assert ("replicate" in groups and groups["replicate"]["reduction_bytes"] > 0) == rec[
                "boundary"
            ]
