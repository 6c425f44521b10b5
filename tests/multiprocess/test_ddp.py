"""DDP on a real 2-rank gloo group, checked against one process on the same global windows."""

from __future__ import annotations

from dataclasses import replace

import pytest

from harness import Scenario, Shared
from harness.checks import (
    assert_dropped_window_leaks_nothing,
    assert_export_is_the_gathered_model,
    assert_matches_one_process,
    max_diff,
    reference,
)
from scenarios import ddp
from scenarios.common import DROPS, Loop

SAMPLES = 44  # 22 per rank, 11 micro-batches of 2: not a multiple of 3 or 4
MICRO = 2
RUN = Loop(samples=SAMPLES, micro_batch=MICRO)


def _train(steps: int | str, loop: Loop = RUN, policy: str = "auto") -> Scenario:
    return Scenario(ddp.train_ddp, steps=steps, loop=loop, policy=policy)


SCENARIOS = {
    "export": Scenario(ddp.export_model),
    **{f"k{k}": _train(k) for k in (1, 3, 4)},
    "k4_adam_clip": _train(4, replace(RUN, optimizer="adam", lr=0.01, clip=0.5)),
    "k4_zero_grad_first": _train(4, replace(RUN, calls="zero_grad_first")),
    "k4_to_3": _train(4, replace(RUN, change_steps_at=(2, 3))),
    "k4_every_step": _train(4, policy="every_step"),
    "k4_after_block": _train(4, replace(RUN, calls="after_block")),
    **{
        f"drop_{how}_{p}": _train(4, replace(RUN, **kw), policy=p)
        for how, kw in DROPS.items()
        for p in ("defer", "every_step")
    },
    "schedule": _train("0:2 2:4"),
    "misuse": Scenario(ddp.misuse),
    "sharding": Scenario(ddp.sharding, samples=45, micro_batch=2),
}


SHARED = Shared("gloo2", SCENARIOS)


@pytest.fixture(scope="module")
def results(shared):
    return shared(SHARED)


@pytest.mark.parametrize(
    "name", ["k1", "k3", "k4", "k4_zero_grad_first", "k4_to_3", "k4_every_step", "k4_after_block"]
)
def test_equivalence_with_one_process(results, name):
    assert_matches_one_process(results[name], samples=SAMPLES)


@pytest.mark.parametrize("how", sorted(DROPS))
@pytest.mark.parametrize("policy", ["defer", "every_step"])
def test_a_dropped_window_leaks_nothing(results, how, policy):
    assert_dropped_window_leaks_nothing(results[f"drop_{how}_{policy}"], samples=SAMPLES)


def test_an_accumulation_schedule_equals_one_process(results):
    ranks = results["schedule"]
    assert ranks[0]["sizes"] == [2, 2, 4, 3, 4, 4, 3]  # k=2 for steps 0-1, then 4; partial windows
    assert_matches_one_process(ranks, samples=SAMPLES)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_windows_include_the_partial_last_one(results, k):
    r = results[f"k{k}"][0]
    per_epoch = [k] * (11 // k) + ([11 % k] if 11 % k else [])
    assert r["sizes"] == per_epoch * 2
    assert [len(w) for w in r["windows"]] == per_epoch * 2


def test_changed_accumulation_takes_effect_at_the_next_window(results):
    r = results["k4_to_3"][0]
    # two windows of 4, then 3s; each epoch's 11 batches end in a partial window
    assert r["sizes"] == [4, 4, 3, 3, 3, 3, 2]


def test_clipping_returns_the_global_norm(results):
    ranks = results["k4_adam_clip"]
    ref = reference(ranks, samples=SAMPLES, optimizer="adam", lr=0.01, clip=0.5)
    for r in ranks:
        assert len(r["norms"]) == len(ref["norms"]) == r["optimizer_steps"]
        assert max(abs(a - b) for a, b in zip(r["norms"], ref["norms"])) < 1e-5
        assert max_diff(r["state"], ref["state"]) < 1e-5


@pytest.mark.parametrize("name", ["k1", "k3", "k4", "k4_adam_clip"])
def test_scheduler_steps_once_per_optimizer_step(results, name):
    for r in results[name]:
        assert r["scheduler_last_epoch"] == r["optimizer_steps"] == len(r["windows"])
        assert r["scheduler_calls"] == sum(
            r["sizes"]
        )  # called every micro-step, stepped per window
        assert r["lrs"] == pytest.approx(
            [
                SCENARIOS[name].params["loop"].lr / (1 + s)
                for s in range(1, r["optimizer_steps"] + 1)
            ]
        )


def _after(records, windows):
    """The records after the first ``windows`` windows."""
    syncs = [i for i, rec in enumerate(records) if rec["boundary"]]
    return records[syncs[windows - 1] + 1 :]


def test_deferral_no_reduction_off_the_boundary(results):
    for r in results["k4"]:
        records = r["audit"]
        assert len(records) == sum(r["sizes"]), "audit must record every micro-step"
        grad_bytes = 4 * sum(len(torch_flat(v)) for v in r["state"].values())
        for rec in records:
            if rec["boundary"]:
                assert rec["reductions"] == 1, rec
                assert rec["reduction_bytes"] == grad_bytes
            else:
                assert rec["reductions"] == 0, rec
        # DDP broadcasts its rebuilt bucket layout once, early in the second step; after that
        # a micro-step off the boundary issues nothing at all.
        later = _after(records, 2)
        assert later and all(rec["bytes"] == 0 for rec in later if not rec["boundary"])


def test_every_step_reduces_on_every_micro_step(results):
    for r in results["k4_every_step"]:
        assert r["policy"] == "every_step"
        records = _after(r["audit"], 1)
        assert records and all(rec["reductions"] == 1 for rec in records)
        assert any(not rec["boundary"] for rec in records)


def test_misuse_gives_clear_errors(results):
    for messages in results["misuse"]:
        assert "prepared model" in messages["unprepared"]
        assert "outside `with accel.accumulate(model):`" in messages["outside"]
        assert "gradient_accumulation_steps=4" in messages["outside"]
        assert messages["foreign_optimizer"].startswith("ConfigError")
        assert "belong to no model prepared" in messages["foreign_optimizer"]


def torch_flat(value):
    if isinstance(value, list):
        return [x for v in value for x in torch_flat(v)]
    return [value]


def test_each_rank_gets_its_own_shard_reshuffled_per_epoch(results):
    ranks = results["sharding"]
    # 45 samples on 2 ranks: 23 each (one padded repeat), 12 batches of 2 on every rank
    assert ranks[0]["len"] == ranks[1]["len"] == 12
    for epoch in range(2):
        a, b = (set(r["epochs"][epoch]) for r in ranks)
        assert len(ranks[0]["epochs"][epoch]) == len(ranks[1]["epochs"][epoch]) == 23
        assert a | b == set(range(45))
        assert len(a & b) <= 1  # only the padding sample may repeat
    for r in ranks:
        assert r["epochs"][0] != r["epochs"][1], "the shard must be reshuffled each epoch"


def test_the_self_check_stays_silent(results):
    """Every loop here is a correct one: the deferral self-check must not warn."""
    assert "gradsync self-check" not in results.log


def test_save_model_writes_the_gathered_weights_once_on_rank_0(results):
    """``save_model`` of a tied model after one window."""
    assert_export_is_the_gathered_model(results["export"])
