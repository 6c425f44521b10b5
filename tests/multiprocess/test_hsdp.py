"""FSDP2 on a 2-D mesh (HSDP) on a real 4-rank gloo group: meshes (2, 2), (1, 4) and (4, 1),
each policy checked against one process on the same global windows; replicas hold identical
shards; dropped windows, mid-window resume, and a (2, 2) checkpoint loaded on a 1-D 2-rank
group and in one process."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from harness import Scenario, Shared, run_scenarios
from harness.checks import (
    assert_clipping_matches_one_process,
    assert_dropped_window_leaks_nothing,
    assert_matches_one_process,
    max_diff,
    reference,
)
from scenarios import hsdp
from scenarios.common import DROPS, Loop

SAMPLES = 56  # 14 per rank, 7 micro-batches of 2: windows of 4 and a partial 3, two epochs
RUN = Loop(samples=SAMPLES, micro_batch=2)
ADAM_CLIP = replace(RUN, optimizer="adam", lr=0.01, clip=0.5)
BF16_TOLERANCE = 2e-3  # as on the 1-D mesh (tests/multiprocess/test_fsdp.py)
M22, M14, M41 = [2, 2], [1, 4], [4, 1]
UNITS = 3  # root, block 0, block 1: one reduce-scatter (and one replica all-reduce) each
FOLDER = Path(tempfile.mkdtemp(prefix="gradsync-hsdp-"))


def _train(mesh, steps, policy, loop=RUN, **options) -> Scenario:
    return Scenario(hsdp.train_hsdp, mesh=mesh, steps=steps, loop=loop, policy=policy, **options)


POLICIES = {"every_step": {}, "defer_replicate": {}, "defer": {}, "keep": {"keep": True}}
SCENARIOS = {
    **{
        f"{m[0]}x{m[1]}_k{k}_{p}": _train(m, k, "defer" if p == "keep" else p, **kw)
        for m in (M22, M41)
        for k in (1, 4)
        for p, kw in POLICIES.items()
    },
    **{f"1x4_k4_{p}": _train(M14, 4, p) for p in ("every_step", "defer")},
    "2x2_schedule": _train(M22, "0:2 2:4", "defer_replicate"),
    **{
        f"2x2_drop_{how}_{p}": _train(M22, 4, p, replace(RUN, **kw))
        for how, kw in DROPS.items()
        for p in ("defer_replicate", "defer")
    },
    "2x2_clip": _train(M22, 4, "defer_replicate", ADAM_CLIP),
    "2x2_bf16": _train(M22, 4, "defer_replicate", mixed_precision="bf16"),
    "2x2_auto_all": Scenario(hsdp.auto_choice, mesh=M22, budget=10**9),
    "2x2_auto_grads": Scenario(hsdp.auto_choice, mesh=M22, budget=2000),
    "2x2_auto_small": Scenario(hsdp.auto_choice, mesh=M22, budget=1000),
    "2x2_flags": Scenario(hsdp.restores_flags, mesh=M22),
    **{
        f"2x2_resume_{p}": Scenario(
            hsdp.resume_mid_window, mesh=M22, policy=p, folder=str(FOLDER / f"mid-{p}")
        )
        for p in ("defer_replicate", "defer", "every_step")
    },
    "2x2_save": Scenario(hsdp.save_at_boundary, mesh=M22, folder=str(FOLDER / "boundary")),
}
TRAINED = [
    n
    for n, s in SCENARIOS.items()
    if s.fn is hsdp.train_hsdp and "drop" not in n and n not in ("2x2_clip", "2x2_bf16")
]


SHARED = Shared("gloo4", SCENARIOS, nproc=4)


@pytest.fixture(scope="module")
def results(shared):
    return shared(SHARED)


@pytest.fixture(scope="module")
def loaded(results):
    """The (2, 2) boundary checkpoint loaded on a 1-D 2-rank group and in one process."""
    results["2x2_save"]  # saved (raises with the worker's error otherwise)
    load = {"load": Scenario(hsdp.load_boundary, folder=str(FOLDER / "boundary"))}
    return {2: run_scenarios(load, nproc=2)["load"], 1: run_scenarios(load, nproc=1)["load"]}


def _assert_all_ranks_agree(ranks):
    for r in ranks[1:]:
        assert max_diff(r["state"], ranks[0]["state"]) == 0.0


@pytest.mark.parametrize("name", TRAINED)
def test_equivalence_with_one_process(results, name):
    ranks = results[name]
    for r in ranks:
        assert r["optimizer_steps"] == len(r["windows"]) > 0
    assert_matches_one_process(ranks, samples=SAMPLES)
    _assert_all_ranks_agree(ranks)


def test_the_mesh_is_what_was_asked(results):
    assert [r["coords"] for r in results["2x2_k4_defer_replicate"]] == [
        [0, 0],
        [0, 1],
        [1, 0],
        [1, 1],
    ]
    assert results["2x2_k4_defer_replicate"][0]["mesh_shape"] == [2, 2]
    assert results["4x1_k4_defer_replicate"][0]["mesh_shape"] == [4, 1]
    assert results["1x4_k4_defer"][0]["mesh_shape"] == [4]  # R = 1 is 1-D
    for r in results["2x2_k4_defer_replicate"]:
        assert (
            r["policy"] == "defer_replicate"
            and r["memory"]["replicas"] == r["memory"]["shards"] == 2
        )
        assert (
            r["reason"].startswith("defer_replicate (requested): ")
            and "1/2 of the gradients" in r["reason"]
        )


@pytest.mark.parametrize(
    "name", ["2x2_k4_defer_replicate", "2x2_k4_defer", "4x1_k4_defer_replicate"]
)
def test_windows_include_the_partial_last_one(results, name):
    assert results[name][0]["sizes"] == [4, 3] * 2


def test_an_accumulation_schedule_equals_one_process(results):
    ranks = results["2x2_schedule"]
    assert ranks[0]["sizes"] == [2, 2, 3, 4, 3]
    assert_matches_one_process(ranks, samples=SAMPLES)


@pytest.mark.parametrize("name", [n for n in TRAINED if "1x4" not in n] + ["2x2_clip", "2x2_bf16"])
def test_replicas_hold_bit_identical_shards_after_every_step(results, name):
    ranks = results[name]
    by_shard: dict[int, list[dict]] = {}
    for r in ranks:
        by_shard.setdefault(r["coords"][1], []).append(r)
    assert all(len(peers) == ranks[0]["mesh_shape"][0] for peers in by_shard.values())
    for peers in by_shard.values():
        assert len(peers[0]["shards"]) == peers[0]["optimizer_steps"]
        for other in peers[1:]:
            assert other["shards"] == peers[0]["shards"], (
                f"replicas {peers[0]['coords']} and {other['coords']} differ"
            )


def _windows(r):
    """The audit records split into windows."""
    out, at = [], 0
    for size in r["sizes"]:
        out.append(r["audit"][at : at + size])
        at += size
    assert at == len(r["audit"])
    return out


def _replica_bytes(rec) -> int | None:
    groups = rec.get("groups")
    return None if groups is None else groups.get("replicate", {}).get("bytes", 0)


def test_defer_replicate_all_reduces_across_replicas_once_per_window(results):
    for r in results["2x2_k4_defer_replicate"]:
        for window in _windows(r):
            for rec in window:
                assert rec["ops"].get("reduce_scatter", 0) == UNITS, (
                    rec
                )  # inside the shard group, always
                if rec["boundary"]:
                    assert rec["ops"].get("allreduce", 0) >= UNITS, rec
                else:
                    assert rec["ops"].get("allreduce", 0) == 0, rec
                    assert _replica_bytes(rec) in (None, 0), rec


def test_every_step_all_reduces_every_micro_step(results):
    for r in results["2x2_k4_every_step"]:
        for rec in r["audit"]:
            assert (
                rec["ops"].get("reduce_scatter", 0) == UNITS
                and rec["ops"].get("allreduce", 0) >= UNITS
            ), rec


def test_defer_sends_nothing_off_the_boundary(results):
    for r in results["2x2_k4_defer"]:
        for rec in r["audit"]:
            if not rec["boundary"]:
                assert rec["reductions"] == 0, rec


def test_kept_parameters_gather_only_in_a_windows_first_micro_step(results):
    for r in results["2x2_k4_keep"]:
        assert "parameters kept gathered in the window" in r["reason"]
        for window in _windows(r):
            assert window[0]["ops"].get("allgather", 0) > 0
            for rec in window[1:]:
                assert rec["ops"].get("allgather", 0) == 0, rec
                if not rec["boundary"]:
                    assert rec["reductions"] == 0, rec


@pytest.mark.parametrize("how", sorted(DROPS))
@pytest.mark.parametrize("policy", ["defer_replicate", "defer"])
def test_a_dropped_window_leaks_nothing(results, how, policy):
    ranks = results[f"2x2_drop_{how}_{policy}"]
    assert_dropped_window_leaks_nothing(ranks, samples=SAMPLES)
    for r in ranks:
        assert r["partial_after"] == 0  # no partial buffer left behind


def test_clipping_returns_the_global_norm(results):
    assert_clipping_matches_one_process(results["2x2_clip"], samples=SAMPLES)
    norms = [r["norms"] for r in results["2x2_clip"]]
    assert all(n == norms[0] for n in norms)


def test_bf16_stays_within_the_documented_tolerance(results):
    ranks = results["2x2_bf16"]
    ref = reference(ranks, samples=SAMPLES)
    diff = max(max_diff(r["state"], ref["state"]) for r in ranks)
    assert 1e-6 < diff < BF16_TOLERANCE, diff
    _assert_all_ranks_agree(ranks)


def test_auto_chooses_by_the_budget_with_s_aware_numbers(results):
    everything, grads, small = (results[f"2x2_auto_{n}"][0] for n in ("all", "grads", "small"))
    assert (
        everything["policy"] == "defer"
        and "parameters kept gathered in the window" in everything["reason"]
    )
    assert grads["policy"] == "defer" and "(gradients only)" in grads["reason"]
    assert "1/2 shard" in grads["reason"]  # S = 2, not the world of 4
    assert small["policy"] == "every_step", small["reason"]
    assert (
        "defer_replicate holds a partial buffer of" in small["reason"]
        and "both exceed the budget" in small["reason"]
    )


def test_defer_replicate_sets_and_restores_fsdp_flags(results):
    for seen in results["2x2_flags"]:
        assert (
            seen["before"] == seen["after_off"] == seen["after_boundary"] == [[True, True]] * UNITS
        )
        assert seen["inside_off"] == [[True, False]] * UNITS
        assert seen["inside_boundary"] == [[True, True]] * UNITS


@pytest.mark.parametrize("policy", ["defer_replicate", "defer", "every_step"])
def test_a_mid_window_checkpoint_resumes_bitwise(results, policy):
    for seen in results[f"2x2_resume_{policy}"]:
        assert seen["steps"] == seen["resumed_steps"] == 2
        if policy == "defer_replicate":  # the window lives only in the partial buffers
            assert seen["partial_at_save"] == seen["partial_after_load"] == UNITS
            assert seen["sharded_grads_at_save"] == 0
        assert max_diff(seen["went_on"], seen["resumed"]) == 0.0


@pytest.mark.parametrize("world", [2, 1])
def test_a_2x2_boundary_checkpoint_loads_on_a_1d_mesh_and_in_one_process(results, loaded, world):
    saved = results["2x2_save"][0]
    for r in loaded[world]:
        assert r["world"] == world and r["mesh_ndim"] == 1
        assert r["steps"] == saved["steps"] == 2 and r["adam_steps"] == [2.0]
        assert max_diff(r["state"], saved["state"]) == 0.0


def test_the_self_check_stays_silent_on_the_mesh(results):
    # Every scenario above ran with the self-check on (the default) over labelled mesh groups,
    # defer_replicate's reduce-scatters off the boundary included: it found nothing to warn
    # about (tests/unit/test_audit_groups.py shows it warning for a replica all-reduce).
    assert "gradsync self-check" not in results.log
    assert any("defer_replicate" in name for name in SCENARIOS)
