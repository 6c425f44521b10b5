"""DeepSpeed ZeRO 3 with ZeRO++ hpZ (``zero_hpz_partition_size=2``) on a real 4-rank gloo group
(two secondary partition groups of 2 ranks), checked against one process on the same global
windows, for ``native``, ``defer`` and ``auto``; the audit shows what each policy reduces."""

from __future__ import annotations

from dataclasses import replace

import pytest

from harness import Scenario, Shared
from harness.checks import (
    assert_dropped_window_leaks_nothing,
    assert_one_gradient_reduction,
    max_diff,
    reductions,
    reference,
)
from scenarios import deepspeed_hpz as hpz
from scenarios.common import DROPS, Loop

NPROC = 4
SAMPLES = 88  # 22 per rank, 11 micro-batches of 2: not a multiple of 3 or 4
RUN = Loop(samples=SAMPLES, micro_batch=2)
FITS = 10**9  # a memory budget the tiny model's gradients fit
GRAD_BYTES = 4 * 705  # fp32 gradients of scenarios.common.Net


def _run(policy: str, steps: int | str = 4, loop: Loop = RUN, **options):
    return Scenario(hpz.train_hpz, hpz=2, steps=steps, loop=loop, policy=policy, **options)


SCENARIOS = {
    **{f"{p}_k{k}": _run(p, k) for p in ("native", "defer") for k in (1, 4)},
    "auto_k4": _run("auto", budget=FITS),
    "defer_schedule": _run("defer", "0:2 2:4"),
    **{
        f"{p}_drop_{how}": _run(p, loop=replace(RUN, **kw))
        for how, kw in DROPS.items()
        for p in ("native", "defer")
    },
    "hpz_3_of_4": Scenario(hpz.refused, hpz=3),
}
TRAINED = [n for n in SCENARIOS if SCENARIOS[n].fn is hpz.train_hpz]
DEFERRED = ["defer_k1", "defer_k4", "auto_k4", "defer_schedule"]


SHARED = Shared(
    "gloo4", SCENARIOS, nproc=NPROC, env={"DS_ACCELERATOR": "cpu"}, requires=("deepspeed",)
)


@pytest.fixture(scope="module")
def results(shared):
    pytest.importorskip("deepspeed")
    return shared(SHARED)


def _assert_all_ranks_match_one_process(ranks):
    assert len(ranks) == NPROC
    ref = reference(ranks, samples=SAMPLES)
    diffs = [max_diff(r["state"], ref["state"]) for r in ranks]
    print(f"max |hpZ - one process| per rank: {[f'{d:.1e}' for d in diffs]}")
    assert max(diffs) < 1e-5
    for r in ranks[1:]:
        assert max_diff(ranks[0]["state"], r["state"]) == 0.0


@pytest.mark.parametrize("name", [n for n in TRAINED if "drop" not in n])
def test_equivalence_with_one_process(results, name):
    ranks = results[name]
    _assert_all_ranks_match_one_process(ranks)
    want = {"native": "native", "defer": "defer", "auto": "defer"}[name.split("_")[0]]
    assert all(r["policy"] == want for r in ranks), [r["reason"] for r in ranks]


@pytest.mark.parametrize("name", TRAINED)
def test_hpz_is_really_on(results, name):
    """Two secondary groups of consecutive ranks, every parameter partitioned (none kept
    whole), and every parameter holding its secondary partition after each backward."""
    for rank, r in enumerate(results[name]):
        assert r["secondary_group"] == ([0, 1] if rank < 2 else [2, 3])
        assert r["persistent"] == 0 and r["n_params"] == 8
        assert r["secondary_held"] and all(n == r["n_params"] for n in r["secondary_held"]), r[
            "secondary_held"
        ]


def test_windows_partial_last_and_schedule(results):
    for name in ("native_k4", "defer_k4", "auto_k4"):
        assert results[name][0]["sizes"] == [4, 4, 3] * 2
    assert results["native_k1"][0]["sizes"] == [1] * 22
    assert results["defer_schedule"][0]["sizes"] == [2, 2, 4, 3, 4, 4, 3]


@pytest.mark.parametrize("name", DEFERRED)
def test_defer_reduces_nothing_off_the_boundary_and_once_at_it(results, name):
    for r in results[name]:
        records = r["audit"]
        assert len(records) == len(r["audit_ops"]) == sum(r["sizes"])
        if name != "defer_k1":
            assert any(not rec["boundary"] for rec in records)
        for rec, ops in zip(records, r["audit_ops"]):
            if rec["boundary"]:
                assert_one_gradient_reduction(ops, GRAD_BYTES)
            else:
                assert rec["reductions"] == 0, (rec, ops)
    bytes_per_step = sum(rec["reduction_bytes"] for rec in results[name][0]["audit"]) / len(
        results[name][0]["sizes"]
    )
    print(f"{name}: reduction bytes per optimizer step per rank {bytes_per_step:.0f}")


@pytest.mark.parametrize("name", ["native_k4", "native_drop_raise"])
def test_native_reduces_on_every_micro_step(results, name):
    for r in results[name]:
        assert any(not rec["boundary"] for rec in r["audit"])
        for rec, ops in zip(r["audit"], r["audit_ops"]):
            assert rec["reductions"] >= 1 and max(reductions(ops)) >= GRAD_BYTES, (rec, ops)
    r = results[name][0]
    print(
        f"{name}: reduction bytes per optimizer step per rank "
        f"{sum(rec['reduction_bytes'] for rec in r['audit']) / len(r['sizes']):.0f}"
    )


def test_auto_says_it_defers_and_why(results):
    for r in results["auto_k4"]:
        assert r["reason"].startswith("auto -> defer (one coalesced reduction per window)"), r[
            "reason"
        ]
        assert "full size minus this rank's 1/4 shard" in r["reason"]


@pytest.mark.parametrize("name", [n for n in TRAINED if "drop" in n])
def test_a_dropped_window_leaks_nothing(results, name):
    ranks = results[name]
    assert_dropped_window_leaks_nothing(ranks, samples=SAMPLES)
    _assert_all_ranks_match_one_process(ranks)


def test_an_hpz_size_that_does_not_divide_the_world_is_refused_on_every_rank(results):
    for message in results["hpz_3_of_4"]:
        assert message.startswith(
            "ConfigError: deepspeed_config zero_optimization.zero_hpz_partition_size=3 "
            "does not divide world_size=4"
        ), message
        assert "\n" not in message


def test_the_self_check_stays_silent(results):
    assert "gradsync self-check" not in results.log
