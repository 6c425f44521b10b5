"""On a real 2-rank gloo group that gradsync creates (counting wrapper, recorder off): the
deferral self-check, DDP with parameters used only in some micro-steps, and the data
pipelines gradsync shards, each checked against one process where it trains."""

from __future__ import annotations

import pytest

from harness import Scenario, run_scenarios
from harness.checks import assert_matches_one_process, max_diff, unused_reference
from scenarios import pipelines

SCENARIOS = {
    "check_correct": Scenario(pipelines.self_check, loop="correct"),
    "check_correct_fsdp": Scenario(pipelines.self_check, loop="correct", backend="fsdp"),
    "check_forward_outside": Scenario(pipelines.self_check, loop="forward_outside"),
    "check_own_no_sync": Scenario(pipelines.self_check, loop="own_no_sync"),
    "check_own_no_sync_around": Scenario(pipelines.self_check, loop="own_no_sync_around"),
    "check_inner_module": Scenario(pipelines.self_check, loop="inner_module"),
    "iterable45": Scenario(pipelines.loader_run, kind="iterable", samples=45, micro_batch=4),
    "weighted": Scenario(pipelines.loader_run, kind="weighted", samples=20, micro_batch=3),
    "bucketing": Scenario(pipelines.loader_run, kind="bucketing", samples=30, micro_batch=4),
    "unused_flag": Scenario(pipelines.unused, find_unused=True),
    # last: the model whose reduction never finished is left behind
    "unused_no_flag": Scenario(pipelines.unused, find_unused=False),
}


@pytest.fixture(scope="module")
def results():
    return run_scenarios(SCENARIOS)


@pytest.mark.parametrize("name", ["check_correct", "check_correct_fsdp"])
def test_self_check_is_silent_for_a_correct_loop_then_stops(results, name):
    for r in results[name]:
        assert r["policy"] == "defer"
        assert r["warnings"] == []
        assert r["audit_is_none"], "audit=False keeps accel.audit None"
        assert not r["checking"], "the check ends after its steps"
        assert r["after"] == {"enabled": False, "records": 0}, "nothing recorded after the check"


def test_self_check_warns_once_for_a_forward_outside_accumulate(results):
    for r in results["check_forward_outside"]:
        assert len(r["warnings"]) == 1, r["warnings"]
        message = r["warnings"][0]
        assert "off the boundary issued 1 gradient reduction(s)" in message
        assert "run the forward inside `with accel.accumulate(model):`" in message
        assert r["after"] == {"enabled": False, "records": 0}


def test_self_check_warns_when_the_boundary_reduces_nothing(results):
    for r in results["check_inner_module"]:  # a backward that never passes through DDP
        assert len(r["warnings"]) == 1, r["warnings"]
        assert "boundary micro-step ran accel.backward but reduced nothing" in r["warnings"][0]
        assert "not its inner module" in r["warnings"][0]


@pytest.mark.parametrize("name", ["check_own_no_sync", "check_own_no_sync_around"])
def test_self_check_is_silent_when_the_user_turned_the_sync_off(results, name):
    # A no_sync() of the user's own, inside the block or around the loop (as LocalSGD
    # enters it): the boundary reduces nothing because they asked for it.
    for r in results[name]:
        assert r["warnings"] == [], r["warnings"]
        assert r["after"] == {"enabled": False, "records": 0}


def test_unused_parameters_with_find_unused_train_like_one_process(results):
    ranks = results["unused_flag"]
    assert all(r["error"] is None and r["find_unused"] for r in ranks)
    sides = [mb[-1] == -1 for w in ranks[0]["windows"] for mb in w]
    assert any(sides) and not all(sides), "the side head must run in some micro-steps only"
    ref = unused_reference(ranks)
    for r in ranks:
        assert max_diff(r["state"], ref["state"]) < 1e-5
    assert max_diff(ranks[0]["state"], ranks[1]["state"]) == 0.0


def test_unused_parameters_without_the_flag_is_one_line(results):
    for r in results["unused_no_flag"]:
        message = r["error"]
        assert message is not None and "\n" not in message
        assert message.startswith("DDP: parameter(s) side.weight, side.bias got no gradient")
        assert "Accelerator(find_unused_parameters=True)" in message
        assert "ddp_kwargs={'find_unused_parameters': True}" in message
        assert len(r["windows"]) == 1, "it surfaces at the next window's forward"


def test_iterable_dataset_each_sample_once_per_epoch(results):
    ranks = results["iterable45"]
    # 45 = 5 rounds of 2 x 4, then 5 samples dealt 3 + 2: 6 batches on each rank
    assert ranks[0]["len"] == ranks[1]["len"] == 6
    for epoch in range(2):
        a, b = ([i for batch in r["epochs"][epoch] for i in batch] for r in ranks)
        assert len(ranks[0]["epochs"][epoch]) == len(ranks[1]["epochs"][epoch]) == 6
        assert sorted(a + b) == list(range(45)), "each sample exactly once per epoch"
    assert_matches_one_process(ranks, samples=45)


@pytest.mark.parametrize("name, samples, batches", [("weighted", 20, 3), ("bucketing", 30, 4)])
def test_samplers_are_sharded_by_batch(results, name, samples, batches):
    ranks = results[name]
    assert ranks[0]["len"] == ranks[1]["len"] == batches
    for epoch in range(2):
        steps0, steps1 = (r["epochs"][epoch] for r in ranks)
        assert len(steps0) == len(steps1) == batches
        for b0, b1 in zip(steps0, steps1):
            assert not set(b0) & set(b1), "disjoint batches at every step"
        seen = [i for batch in steps0 + steps1 for i in batch]
        assert len(seen) == len(set(seen)), "one batch sequence without repeats, split over ranks"
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1], "reseeded each epoch"
    assert_matches_one_process(ranks, samples=samples)
