"""Tensor parallel x FSDP2 x replicas on one N-D mesh (``parallelism``), on a real 4-rank gloo
group: (dp_shard 2, tp 2) and (dp_replicate 2, tp 2), each policy checked against one process
on the same global windows; the ranks of a tp group read the same micro-batches; the audit
shows no gradient bytes off the boundary under defer and tensor parallel's traffic on its own
line; a Transformers tiny Llama through its own plan with token-weighted loss; checkpoints
that reshard between (dp_shard 2, tp 2), a 1-D mesh of 4 and one process.

Every 4-rank scenario runs in one group, shared with the other 4-rank modules (the reshards
included: a later scenario builds the other mesh in the same group); the one-process load is a
second, 1-rank launch.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from harness import Scenario, Shared, run_scenarios
from harness.checks import assert_nd_matches_one_process, data_ranks, max_diff
from scenarios import tp
from scenarios.common import DROPS, Loop

SAMPLES = 28  # 14 per data-parallel rank, 7 micro-batches of 2: windows of 4 and a partial 3
RUN = Loop(samples=SAMPLES, micro_batch=2)
ADAM_CLIP = replace(RUN, optimizer="adam", lr=0.01, clip=0.5)
BF16_TOLERANCE = 2e-3  # as on the 1-D mesh (tests/multiprocess/test_fsdp.py)
SHARD = {"dp_shard": 2, "tp": 2}
REPLICATE = {"dp_replicate": 2, "tp": 2}
MESHES = {"s2t2": SHARD, "r2t2": REPLICATE}
POLICIES = {
    "s2t2": ("every_step", "defer", "auto"),
    "r2t2": ("every_step", "defer", "defer_replicate", "auto"),
}
FOLDER = Path(tempfile.mkdtemp(prefix="gradsync-tp-"))
LLAMA_SAMPLES = 24
LLAMA_CLIP = 0.5  # its norms and layer norms are left out of the plan: gradients on two meshes


def _train(mesh: str, steps, policy, loop=RUN, **options) -> Scenario:
    return Scenario(
        tp.train_tp, dims=MESHES[mesh], steps=steps, loop=loop, policy=policy, **options
    )


SCENARIOS = {
    **{f"{m}_k{k}_{p}": _train(m, k, p) for m in MESHES for k in (1, 4) for p in POLICIES[m]},
    **{f"{m}_schedule": _train(m, "0:2 2:4", "defer") for m in MESHES},
    **{
        f"{m}_drop_{how}": _train(m, 4, p, replace(RUN, **kw))
        for m, p in (("s2t2", "defer"), ("r2t2", "defer_replicate"))
        for how, kw in DROPS.items()
    },
    **{f"{m}_clip": _train(m, 4, "defer", ADAM_CLIP) for m in MESHES},
    "s2t2_partial_clip": _train("s2t2", 4, "defer", ADAM_CLIP, partial=True),
    "s2t2_partial_clip_value": _train(
        "s2t2", 4, "defer", replace(RUN, clip_value=0.02), partial=True
    ),
    "s2t2_bf16": _train("s2t2", 4, "defer", mixed_precision="bf16"),
    "s2t2_auto_fits": Scenario(tp.auto_choice, dims=SHARD, budget=10**9),
    "s2t2_auto_small": Scenario(tp.auto_choice, dims=SHARD, budget=100),
    "r2t2_auto": Scenario(tp.auto_choice, dims=REPLICATE, budget=100),
    "s2t2_norm": Scenario(tp.clip_norms_are_global, dims=SHARD),
    "s2t2_metrics": Scenario(tp.metrics_over_data_ranks, dims=SHARD),
    **{
        f"{m}_llama": Scenario(
            tp.train_llama, dims=MESHES[m], steps=2, samples=LLAMA_SAMPLES, clip=LLAMA_CLIP
        )
        for m in MESHES
    },
    "s2t2_resume": Scenario(
        tp.resume_mid_window, dims=SHARD, policy="defer", folder=str(FOLDER / "mid-s")
    ),
    "r2t2_resume": Scenario(
        tp.resume_mid_window, dims=REPLICATE, policy="defer_replicate", folder=str(FOLDER / "mid-r")
    ),
    # (dp_shard 2, tp 2) -> a 1-D mesh of 4 (saved again there) -> back on (dp_shard 2, tp 2)
    "save_s2t2": Scenario(tp.save_at_boundary, dims=SHARD, folder=str(FOLDER / "s2t2")),
    "load_on_1d": Scenario(
        tp.load_boundary, dims=None, folder=str(FOLDER / "s2t2"), then_save=str(FOLDER / "1d")
    ),
    "load_back": Scenario(tp.load_boundary, dims=SHARD, folder=str(FOLDER / "1d")),
}
TRAINED = [
    n
    for n in SCENARIOS
    if SCENARIOS[n].fn is tp.train_tp
    and "drop" not in n
    and not n.endswith(("_clip", "_clip_value", "_bf16"))
]


SHARED = Shared("gloo4", SCENARIOS, nproc=4)


@pytest.fixture(scope="module")
def results(shared):
    return shared(SHARED)


@pytest.fixture(scope="module")
def one_process(results):
    """The (dp_shard 2, tp 2) boundary checkpoint loaded in one process."""
    results["save_s2t2"]  # saved (raises with the worker's error otherwise)
    load = {"load": Scenario(tp.load_boundary, dims=None, folder=str(FOLDER / "s2t2"))}
    return run_scenarios(load, nproc=1)["load"][0]


def assert_equals_one_process(ranks, tolerance=1e-5, **reference_kwargs):
    return assert_nd_matches_one_process(ranks, tolerance, samples=SAMPLES, **reference_kwargs)


@pytest.mark.parametrize("name", TRAINED)
def test_equivalence_with_one_process(results, name):
    ranks = results[name]
    for r in ranks:
        assert r["optimizer_steps"] == len(r["windows"]) > 0
    assert_equals_one_process(ranks)


@pytest.mark.parametrize("name", ["s2t2_k4_defer", "r2t2_k4_defer_replicate"])
def test_a_tp_group_reads_the_same_batches_and_data_ranks_distinct_ones(results, name):
    ranks = results[name]
    assert ranks[0]["data_size"] == 2
    for r in ranks:  # rank = (r * S + s) * T + t: tp innermost
        assert r["data_rank"] == r["coords"][0] * r["mesh_shape"][1] + r["coords"][1]
    by_data = {}
    for r in ranks:
        by_data.setdefault(r["data_rank"], []).append(r["windows"])
    assert all(len(w) == 2 and w[0] == w[1] for w in by_data.values())
    first_epoch = [
        [i for w in windows[0][:2] for mb in w for i in mb] for windows in by_data.values()
    ]
    assert sorted(first_epoch[0] + first_epoch[1]) == list(range(SAMPLES))  # windows of 4 and 3


def test_the_mesh_is_named_and_what_was_asked(results):
    ranks = results["s2t2_k4_defer"]
    assert [r["coords"] for r in ranks] == [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]]
    assert ranks[0]["mesh_names"] == ["dp_replicate", "dp_shard", "tp"] and ranks[0][
        "mesh_shape"
    ] == [1, 2, 2]
    assert [r["coords"] for r in results["r2t2_k4_defer"]] == [
        [0, 0, 0],
        [0, 0, 1],
        [1, 0, 0],
        [1, 0, 1],
    ]


@pytest.mark.parametrize("name", ["s2t2_k4_defer", "s2t2_k4_every_step", "r2t2_k4_defer_replicate"])
def test_windows_include_the_partial_last_one(results, name):
    assert results[name][0]["sizes"] == [4, 3] * 2


@pytest.mark.parametrize("mesh", MESHES)
def test_an_accumulation_schedule_equals_one_process(results, mesh):
    ranks = results[f"{mesh}_schedule"]
    assert ranks[0]["sizes"] == [2, 2, 3, 4, 3]
    assert_equals_one_process(ranks)


@pytest.mark.parametrize("name", [n for n in SCENARIOS if "_drop_" in n])
def test_a_dropped_window_leaks_nothing(results, name):
    ranks = results[name]
    for r in ranks:
        assert len(r["dropped"]) == 1 and len(r["dropped"][0]) >= 1, r["dropped"]
        assert r["optimizer_steps"] == len(r["windows"]) == r["scheduler_last_epoch"]
    assert_equals_one_process(ranks)


@pytest.mark.parametrize("name", ["s2t2_clip", "r2t2_clip", "s2t2_partial_clip"])
def test_clipping_returns_the_global_norm_and_equals_one_process(results, name):
    ranks = results[name]
    ref = assert_equals_one_process(ranks, optimizer="adam", lr=0.01, clip=0.5)
    assert any(n > 0.5 for n in ref["norms"]), "the test must actually clip"
    for r in ranks:
        assert len(r["norms"]) == len(ref["norms"]) == r["optimizer_steps"]
        assert max(abs(a - b) for a, b in zip(r["norms"], ref["norms"])) < 1e-5


def test_clipping_values_on_two_meshes_equals_one_process(results):
    assert_equals_one_process(results["s2t2_partial_clip_value"], clip_value=0.02)


def test_the_norm_is_the_gathered_gradients_norm(results):
    for r in results["s2t2_norm"]:
        assert abs(r["norm"] - r["gathered"]) < 1e-6 and r["norm"] > 0


def test_bf16_stays_within_the_1d_tolerance(results):
    assert_equals_one_process(results["s2t2_bf16"], tolerance=BF16_TOLERANCE)


@pytest.mark.parametrize("name", ["s2t2_k4_defer", "r2t2_k4_defer"])
def test_no_gradient_bytes_off_the_boundary_and_tp_on_its_own_line(results, name):
    for r in results[name]:
        records = r["audit"]
        assert records and any(not rec["boundary"] for rec in records)
        for rec in records:
            tp_bytes = rec["groups"]["tp"]["reduction_bytes"]
            assert tp_bytes > 0, (
                "tensor parallel reduces in every micro-step's forward and backward"
            )
            if not rec["boundary"]:
                assert rec["reductions"] == 0 and rec["reduction_bytes"] == 0, rec
            else:
                assert rec["reduction_bytes"] > 0
        assert all("; by group: " in s and " tp [" in s for s in r["summaries"])
        assert not [w for w in r["warnings"] if "self-check" in w], r["warnings"]


def test_defer_replicate_reduce_scatters_every_micro_step_and_all_reduces_at_the_boundary(results):
    for r in results["r2t2_k4_defer_replicate"]:
        for rec in r["audit"]:
            across = rec["groups"].get("replicate", {}).get("ops", {}).get("allreduce", 0)
            assert (across > 0) == rec["boundary"], rec


#: Of the net's 705 fp32 parameters a rank holds 361 once gathered under tp 2: every weight
#: and the colwise biases are split, the rowwise biases (16 + 1) replicated.
HELD = 64 + 8 + 128 + 16 + 128 + 8 + 8 + 1


def test_auto_divides_by_the_shards_and_counts_the_tp_share(results):
    fits = results["s2t2_auto_fits"][0]
    # gradients minus this rank's 1/2 shard, and the parameters kept gathered whole: 361 x 4 bytes each
    assert HELD == 361 and fits["policy"] == "defer"
    assert fits["memory"]["deferral_extra_bytes"] == HELD * 4 - HELD * 4 // 2 + HELD * 4
    small = results["s2t2_auto_small"][0]
    assert (
        small["policy"] == "every_step" and f"{HELD * 4 - HELD * 4 // 2} bytes" in small["reason"]
    )
    # one shard per replica (S = 1): deferring holds nothing beyond the shard itself
    assert results["r2t2_auto"][0]["policy"] == "defer"


def test_metrics_count_each_sample_once(results):
    for r in results["s2t2_metrics"]:
        assert sorted(r["seen"]) == list(range(20))
        assert r["sum"] == 2.0 and r["mean"] == 1.0  # over the 2 data-parallel ranks


@pytest.mark.parametrize("mesh", MESHES)
def test_a_transformers_llama_through_its_own_plan_is_exact_and_clips_globally(results, mesh):
    ranks = results[f"{mesh}_llama"]
    windows = [
        [mb for r in data_ranks(ranks) for mb in r["windows"][w]]
        for w in range(len(ranks[0]["windows"]))
    ]
    ref = tp.llama_reference(windows, LLAMA_SAMPLES, clip=LLAMA_CLIP)
    assert any(n > LLAMA_CLIP for n in ref["norms"]), "the test must actually clip"
    for r in ranks:
        assert r["optimizer_steps"] == len(windows) > 0
        assert max_diff(r["state"], ref["state"]) < 1e-5
        assert max(abs(a - b) for a, b in zip(r["norms"], ref["norms"], strict=True)) < 1e-5
        # the token-weighted loss of each window, over the data-parallel ranks' tokens
        assert (
            max(abs(a - b) for a, b in zip(r["window_losses"], ref["losses"], strict=True)) < 1e-5
        )


@pytest.mark.parametrize("name", ["s2t2_resume", "r2t2_resume"])
def test_a_mid_window_save_resumes_bitwise(results, name):
    for r in results[name]:
        assert r["resumed_steps"] == r["steps"]
        assert max_diff(r["resumed"], r["went_on"]) == 0.0


def test_a_checkpoint_reshards_to_1d_and_back(results):
    saved = results["save_s2t2"][0]
    for r in results["load_on_1d"]:
        assert (
            r["mesh"] == [4]
            and max_diff(r["state"], saved["state"]) == 0.0
            and r["steps"] == saved["steps"]
        )
        assert r["adam_steps"] == [float(saved["steps"])]
    for r in results["load_back"]:
        assert r["mesh"] == [1, 2, 2] and max_diff(r["state"], saved["state"]) == 0.0


def test_a_checkpoint_loads_in_one_process(results, one_process):
    saved = results["save_s2t2"][0]
    assert one_process["world"] == 1 and max_diff(one_process["state"], saved["state"]) == 0.0
    assert one_process["adam_steps"] == [float(saved["steps"])]
