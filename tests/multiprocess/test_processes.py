"""Cross-rank helpers on 2 real gloo ranks, one group for every scenario: reduce (every
reduction, scale, the op alias), gather_object, gather_for_metrics of objects over a
prepared evaluation loader of 45 samples (the padded duplicate dropped, the sampler's
order), split_between_processes, the on_*_process decorators and goes_first; where
Accelerate has the same call, its PartialState on the same group gives the same answer."""

from __future__ import annotations

import pytest

from harness import Scenario, Shared
from scenarios import processes as sc

SCENARIOS = {
    "reductions": Scenario(sc.reductions),
    "objects": Scenario(sc.objects),
    "evaluation": Scenario(sc.evaluation, shuffle=False),
    "evaluation_shuffled": Scenario(sc.evaluation, shuffle=True),
    "splits": Scenario(sc.splits),
    "decorators": Scenario(sc.decorators),
    "accelerate": Scenario(sc.accelerate_reference),  # last: it sets up Accelerate's state
}


SHARED = Shared("gloo2", SCENARIOS)


@pytest.fixture(scope="module")
def results(shared):
    return shared(SHARED)


def values(entry):
    return entry["values"]


# -- reduce ---------------------------------------------------------------------------------


def test_reduce_gives_every_rank_the_reduction(results):
    # rank 0 holds [1, 10], rank 1 holds [2, 9]
    for r in results["reductions"]:
        assert values(r["sum"]) == [3.0, 19.0]
        assert values(r["mean"]) == [1.5, 9.5]
        assert values(r["max"]) == [2.0, 10.0]
        assert values(r["min"]) == [1.0, 9.0]
        assert r["sum_int"] == {"dtype": "int64", "values": [3, 19]}
        assert r["mean_int"] == {"dtype": "float64", "values": [1.5, 9.5]}
        assert r["max_int"] == {"dtype": "int64", "values": [2, 10]}
        assert r["min_int"] == {"dtype": "int64", "values": [1, 9]}
        assert r["nested"] == {
            "a": {"dtype": "float32", "values": [2.0, 10.0]},
            "b": [
                {"dtype": "int64", "values": [2, 10]},
                [{"dtype": "float32", "values": [4.0, 20.0]}],
            ],
        }


def test_none_is_no_collective_and_scale_applies_to_every_reduction(results):
    r0, r1 = results["reductions"]
    assert values(r0["none"]) == [1.0, 10.0] and values(r1["none"]) == [2.0, 9.0]
    assert values(r0["none_int"]) == [1, 10]
    for r in (r0, r1):
        assert values(r["sum_scaled"]) == [1.5, 9.5]
        assert values(r["mean_scaled"]) == [0.75, 4.75]
        assert values(r["max_scaled"]) == [1.0, 5.0]
        assert values(r["min_scaled"]) == [0.5, 4.5]
    assert values(r1["none_scaled"]) == [1.0, 4.5]


def test_op_is_an_alias_of_reduction(results):
    for r in results["reductions"]:
        for reduction in ("sum", "mean", "max", "min", "none"):
            assert r[f"{reduction}_op"] == r[reduction]
        assert r["unknown"] == (
            "ConfigError: reduce(reduction='median') is unknown; use one of "
            "'sum', 'mean', 'max', 'min', 'none'"
        )
        assert r["disagree"].startswith("ConfigError: reduce(reduction='mean', op='sum') disagree")


# -- gather_object ----------------------------------------------------------------------------


def test_gather_object_concatenates_lists_and_lists_other_objects(results):
    for r in results["objects"]:
        assert r["list"] == ["r0-0", "r1-0", "r1-1"]
        assert r["tuple"] == [0, "r0", 1, "r1"]
        assert r["empty_on_rank_0"] == ["x"]
        assert r["str"] == ["rank0", "rank1"]
        assert r["dict"] == [{"rank": 0, "ids": [0, 0]}, {"rank": 1, "ids": [1, 1]}]
        assert r["int"] == [0, 7]


# -- gather_for_metrics of objects -------------------------------------------------------------


def test_objects_come_back_once_each_in_the_datasets_order(results):
    expected = list(range(sc.EVAL_SAMPLES))
    for r in results["evaluation"]:
        assert r["ids"] == expected and r["ids_through_accel"] == expected
        assert r["texts"] == [f"sample-{i}" for i in expected]
        assert r["texts_forced"] == r["texts"]
        assert r["rows_forced"] == [[i] for i in expected]
        assert len(r["plain_objects"]) == sc.EVAL_SAMPLES + 1, (
            "plain gather_object keeps the duplicate"
        )
        assert sorted(r["plain_objects"]) != sorted(r["texts"])


def test_objects_follow_the_tensor_path_when_shuffled(results):
    for r in results["evaluation_shuffled"]:
        assert r["ids"] == r["ids_through_accel"]
        assert sorted(r["ids"]) == list(range(sc.EVAL_SAMPLES)) and r["ids"] != sorted(r["ids"])
        assert r["texts"] == [f"sample-{i}" for i in r["ids"]]
        assert r["rows_forced"] == [[i] for i in r["ids"]]
    r0, r1 = results["evaluation_shuffled"]
    assert r0["texts"] == r1["texts"]


def test_objects_that_are_not_one_per_sample_are_gathered_as_they_are(results):
    for r in results["evaluation"]:
        batches = r["per_batch_lists"]
        assert len(batches) == 6 and all(len(b) == 2 and set(b[0]) == {"texts"} for b in batches)
        assert batches[-1][0]["texts"] == ["sample-40", "sample-42", "sample-44"]
        assert batches[-1][1]["texts"] == [
            "sample-41",
            "sample-43",
            "sample-0",
        ]  # the padding stays
        assert r["not_per_sample"] == ["r0"] * 5 + ["r1"] * 5


# -- split_between_processes ---------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 6))
def test_split_gives_contiguous_shares_the_first_rank_the_larger(results, n):
    r0, r1 = results["splits"]
    items = [f"p{k}" for k in range(n)]
    cut = (n + 1) // 2
    assert r0[f"list_{n}_plain"] == items[:cut] and r1[f"list_{n}_plain"] == items[cut:]
    assert r0[f"tuple_{n}_plain"] + r1[f"tuple_{n}_plain"] == list(range(n))
    padded = r1[f"list_{n}_pad"]
    assert r0[f"list_{n}_pad"] == items[:cut]
    assert padded == items[cut:] + [items[-1]] * (cut - (n - cut))
    assert len(padded) == cut
    assert r1[f"dict_{n}_pad"]["text"] == padded
    assert values(r1[f"dict_{n}_pad"]["id"]) == [int(p[1:]) * 10 for p in padded]
    rows = [[2.0 * k, 2.0 * k + 1] for k in range(n)]
    assert values(r0[f"tensor_{n}_plain"]) == rows[:cut]
    assert values(r1[f"tensor_{n}_plain"]) == rows[cut:]
    assert values(r1[f"tensor_{n}_pad"]) == rows[cut:] + [rows[-1]] * (cut - (n - cut))
    assert r0["bad"].startswith(
        "ConfigError: split_between_processes cannot split the inputs, a str"
    )


def test_split_matches_accelerate(results):
    pytest.importorskip("accelerate")
    for r in results["accelerate"]:
        assert r["num_processes"] == 2
        for pair in r["splits"]:
            assert pair["ours"] == pair["theirs"], pair["case"]


def test_reduce_and_gather_object_match_accelerate(results):
    pytest.importorskip("accelerate")
    for r in results["accelerate"]:
        for reduction in ("sum", "mean", "max"):
            assert r[f"{reduction}_ours"] == r[reduction]
        assert r["list_ours"] == r["list"]


# -- decorators, goes_first ---------------------------------------------------------------------


def test_each_decorator_runs_on_its_rank_only(results):
    r0, r1 = results["decorators"]
    where = {"main": 0, "local_main": 0, "last": 1, "process_0": 0, "process_1": 1, "local_1": 1}
    for facts in ("accel", "dist"):
        for name, rank in where.items():
            mine, other = (r0, r1) if rank == 0 else (r1, r0)
            assert mine[f"{facts}_{name}"] == rank, (facts, name)
            assert f"{facts}_{name}" not in other, (facts, name)
            assert mine[f"{facts}_returned"][name] == name
            assert other[f"{facts}_returned"][name] is None
    for r in (r0, r1):
        assert r["out_of_range"] == (
            "ConfigError: on_process(process_index=2) names no process: "
            "there are 2 (indices 0 to 1)"
        )


def test_the_local_main_process_goes_first(results):
    r0, r1 = results["decorators"]
    assert r1["saw_first"] is True
    assert "saw_first" not in r0
