"""Pipeline parallelism x FSDP2 on a real 4-rank gloo group: pp=2 x dp_shard=2 (each stage
sharded over the two data-parallel ranks of its pipeline coordinate), GPipe and 1F1B, k = 1
and 4, under defer and every_step, each against one process on the same global windows; the
data-parallel ranks read distinct micro-batches and both stages of a pipeline the same ones;
under defer no gradient byte moves between data-parallel ranks off the boundary. Checkpoints:
a mid-window save resumes bitwise; a boundary save (one stage per rank, and two) loads into
the whole model in one process (a 1-rank launch after the group), which trains on as the
pipeline did; and the way back: a checkpoint saved by one process (a 1-rank launch before
the group) or by FSDP2 without pp loads into the pipeline, which trains on as one process
loading it does; so does one in plain files (backend='single'), into FSDP2 and DDP stages.
Another model's checkpoint (DCP or plain files) and a plain-file one saved mid-window are one
line each. The same on
backend='ddp' (pp=2 x dp_replicate=2, each stage in DDP over its two data ranks): one
all-reduce per window under defer, one per schedule step under every_step.

Every scenario runs in the 4-rank group shared with the other 4-rank modules.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import pytest

from harness import Scenario, Shared, run_scenarios
from harness.checks import (
    assert_decoder_pipeline_matches_one_process,
    assert_pipeline_matches_one_process,
    assert_saves_the_whole_model,
    max_diff,
    pipeline_reference,
)
from scenarios import pp, pp_decoder
from scenarios.compression import POWER

SAMPLES = 56  # 7 micro-batches of 4 per data-parallel rank: windows of 4 and a partial 3
DIMS = {"pp": 2, "dp_shard": 2}
REPLICATE = {"pp": 2, "dp_replicate": 2}
CLIP = 0.1
FOLDER = Path(tempfile.mkdtemp(prefix="gradsync-pp-"))


def _train(schedule: str, k: int, policy: str, dims=DIMS, **kw) -> Scenario:
    return Scenario(
        pp.train_pp,
        dims=dims,
        steps=k,
        policy=policy,
        schedule=schedule,
        microbatches=2,
        samples=SAMPLES,
        micro_batch=4,
        **kw,
    )


def _resume(folder: str, dims=DIMS, policy: str = "defer", **kw) -> Scenario:
    """A mid-window save resumed (``pp.resume_mid_window``), into ``FOLDER / folder``."""
    return Scenario(
        pp.resume_mid_window, dims=dims, policy=policy, folder=str(FOLDER / folder), **kw
    )


def _data_bytes(rec) -> int:
    """A micro-step's reduction bytes on every group but the pipeline's ("dp" on DDP stages,
    "shard" on FSDP2 stages)."""
    return sum(g["reduction_bytes"] for n, g in rec["groups"].items() if n != "pp")


#: backend='ddp': (schedule, k, policy); k = 1 syncs every micro-step under either policy.
DDP = {
    f"ddp_{s}_k{k}_{p}": (s, k, p)
    for s, k, p in [
        ("GPipe", 1, "defer"),
        ("1F1B", 1, "every_step"),
        *((s, 4, p) for s in ("GPipe", "1F1B") for p in ("defer", "every_step")),
    ]
}

#: The Llama scenarios need transformers (the hf extra).
HF = importlib.util.find_spec("transformers") is not None

SCENARIOS = {
    **{
        f"pp2s2_{s}_k{k}_{p}": _train(s, k, p)
        for s in ("GPipe", "1F1B")
        for k in (1, 4)
        for p in ("every_step", "defer")
    },
    **{
        f"pp2s2_Interleaved1F1B_k4_{p}": _train(
            "Interleaved1F1B", 4, p, split=["2", "4", "6"], per_rank=2
        )
        for p in ("defer", "every_step")
    },
    "pp2s2_clip": _train("1F1B", 4, "defer", clip=CLIP),
    "pp2s2_tokens": _train("1F1B", 4, "defer", tokens=True),
    **{f"pp2s2_drop_{p}": _train("1F1B", 4, p, raise_at=(1, 1)) for p in ("defer", "every_step")},
    "pp2s2_auto_fits": _train("1F1B", 4, "auto", budget=10**9),
    "pp2s2_auto_small": _train("1F1B", 4, "auto", budget=100),
    **{
        f"pp2r2_1F1B_k4_{p}": _train("1F1B", 4, p, dims=REPLICATE)
        for p in ("defer", "defer_replicate")
    },
    **{f"resume_{p}": _resume(f"mid-{p}", policy=p) for p in ("defer", "every_step")},
    **(
        {
            "llama": Scenario(pp_decoder.train, dims=DIMS, schedule="GPipe", samples=64),
            "llama_interleaved": Scenario(
                pp_decoder.train,
                dims=DIMS,
                schedule="Interleaved1F1B",
                samples=64,
                split=pp_decoder.SPLIT4,
                per_rank=2,
            ),
        }
        if HF
        else {}
    ),
    "resume_interleaved": _resume("mid-interleaved", per_rank=2),
    "save": Scenario(pp.save_at_boundary, dims=DIMS, folder=str(FOLDER / "boundary")),
    "mid_other_split": Scenario(pp.refused_mid_other_split, folder=str(FOLDER / "mid-pp4")),
    "save_model_fsdp": Scenario(
        pp.save_model, dims=DIMS, folder=str(FOLDER / "model-fsdp"), backend="fsdp"
    ),
    "save_model_ddp": Scenario(
        pp.save_model, dims=REPLICATE, folder=str(FOLDER / "model-ddp"), backend="ddp"
    ),
    **{name: _train(s, k, p, dims=REPLICATE, backend="ddp") for name, (s, k, p) in DDP.items()},
    "hooked_ddp_fp16": _train("1F1B", 4, "defer", dims=REPLICATE, backend="ddp", comm_hook="fp16"),
    "hooked_fsdp_fp16": _train("1F1B", 4, "defer", comm_hook="fp16"),
    "hooked_ddp_power_sgd": _train(
        "1F1B",
        2,
        "defer",
        dims=REPLICATE,
        backend="ddp",
        comm_hook="power_sgd",
        comm_state_option=POWER,
    ),
    "ddp_clip": _train("1F1B", 4, "defer", dims=REPLICATE, backend="ddp", clip=CLIP),
    "ddp_drop_defer": _train("1F1B", 4, "defer", dims=REPLICATE, backend="ddp", raise_at=(1, 1)),
    "save_ddp": Scenario(
        pp.save_at_boundary, dims=REPLICATE, folder=str(FOLDER / "boundary-ddp"), backend="ddp"
    ),
    "buffers_ddp": Scenario(pp.buffers, dims=REPLICATE, backend="ddp"),
    "buffers_fsdp": Scenario(pp.buffers, dims=DIMS, backend="fsdp"),
    "resume_ddp": _resume("mid-ddp", dims=REPLICATE, backend="ddp"),
    # PowerSGD compressing from the third window: its error feedback and matrices resume too
    "resume_ddp_power_sgd": _resume(
        "mid-ddp-power-sgd",
        dims=REPLICATE,
        backend="ddp",
        windows=4,
        comm_hook="power_sgd",
        comm_state_option=POWER,
    ),
}
TRAINED = [
    n
    for n in SCENARIOS
    if n.startswith(("pp2", "ddp_")) and n not in ("pp2s2_clip", "pp2s2_tokens", "ddp_clip")
]
#: FSDP2 without pp on the 4 ranks: dp_shard 2, its shards replicated twice.
SHARDED = {"dp_replicate": 2, "dp_shard": 2}
#: Saved in one process before the group starts: the whole model (backend="fsdp"), the
#: same on backend="single" (plain files), and a model with one more layer (in both formats).
SAVED_ALONE = {
    "whole": {},
    "single": {"backend": "single"},
    "other": {"extra": True},
    "single_other": {"backend": "single", "extra": True},
}


def scenarios(folder: Path) -> dict[str, Scenario]:
    """The scenarios, after one process saved ``SAVED_ALONE`` into ``folder``."""
    saves = {
        name: Scenario(pp.save_at_boundary, dims=None, folder=str(folder / name), **options)
        for name, options in SAVED_ALONE.items()
    }
    run_scenarios(saves, nproc=1)
    return {
        **SCENARIOS,
        "save_interleaved": Scenario(
            pp.save_at_boundary, dims=DIMS, folder=str(folder / "interleaved"), per_rank=2
        ),
        "from_whole": Scenario(pp.load_pipeline, dims=DIMS, folder=str(folder / "whole")),
        "save_sharded": Scenario(pp.save_at_boundary, dims=SHARDED, folder=str(folder / "sharded")),
        "from_sharded": Scenario(pp.load_pipeline, dims=DIMS, folder=str(folder / "sharded")),
        "from_single": Scenario(pp.load_pipeline, dims=DIMS, folder=str(folder / "single")),
        "from_single_ddp": Scenario(
            pp.load_pipeline, dims=REPLICATE, folder=str(folder / "single"), backend="ddp"
        ),
        # plain files written by DDP without pp on these 4 ranks, inside a window
        "save_mid_plain": Scenario(
            pp.save_mid_window, folder=str(folder / "mid-plain"), backend="ddp"
        ),
        "refused": Scenario(
            pp.refused_loads,
            dims=DIMS,
            folders=[str(folder / n) for n in ("other", "single_other", "mid-plain")],
        ),
        "refused_ddp": Scenario(
            pp.refused_loads,
            dims=REPLICATE,
            folders=[str(folder / n) for n in ("single_other", "mid-plain")],
            backend="ddp",
        ),
        "refused_mid": Scenario(
            pp.refused_loads, dims={"dp_shard": 4}, folders=[str(FOLDER / "mid-defer")]
        ),
    }


SHARED = Shared("gloo4", scenarios, nproc=4)


@pytest.fixture(scope="module")
def results(shared):
    return shared(SHARED)


@pytest.mark.parametrize("name", TRAINED)
def test_equivalence_with_one_process(results, name):
    assert_pipeline_matches_one_process(results[name], samples=SAMPLES)


@pytest.mark.skipif(not HF, reason="needs transformers (the hf extra)")
def test_a_llama_split_by_layer_names_over_the_data_ranks_equals_one_process(results):
    """pp=2 x dp_shard=2 on a Transformers Llama cut at "model.layers.2", token-weighted."""
    ranks = results["llama"]
    assert sorted((r["stage"], r["data_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert_decoder_pipeline_matches_one_process(ranks, samples=64)


@pytest.mark.skipif(not HF, reason="needs transformers (the hf extra)")
def test_an_interleaved_llama_over_the_data_ranks_equals_one_process(results):
    """pp=2 x dp_shard=2, four decoder-layer stages, two per rank (Interleaved1F1B), k = 4,
    defer: equal to one process, and no gradient byte between data ranks off the boundary."""
    ranks = results["llama_interleaved"]
    assert_decoder_pipeline_matches_one_process(ranks, samples=64)
    for r in ranks:
        assert [rec["boundary"] for rec in r["audit"]] == [False] * 3 + [True] + [False] * 3 + [
            True
        ]
        for rec in r["audit"]:
            shard = rec["groups"].get("shard", {}).get("reduction_bytes", 0)
            assert (shard > 0) == rec["boundary"] == (rec["reduction_bytes"] > 0), rec


def test_a_token_weighted_loss_over_the_data_ranks_equals_one_process(results):
    assert_pipeline_matches_one_process(results["pp2s2_tokens"], samples=SAMPLES, tokens=True)


def test_the_mesh_puts_the_pipeline_outermost(results):
    ranks = results["pp2s2_1F1B_k4_defer"]
    assert [(r["stage"], r["data_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["data_size"] == 2 for r in ranks)


def test_data_ranks_read_distinct_batches_and_a_pipeline_the_same(results):
    ranks = results["pp2s2_1F1B_k4_defer"]
    for d in (0, 1):
        stages = [r["windows"] for r in ranks if r["data_rank"] == d]
        assert len(stages) == 2 and stages[0] == stages[1]
    seen = [i for r in ranks if r["stage"] == 0 for w in r["windows"] for mb in w for i in mb]
    assert sorted(seen) == list(range(SAMPLES))
    assert ranks[0]["windows"] != ranks[1]["windows"]


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe", "Interleaved1F1B"])
def test_no_gradient_bytes_between_data_ranks_off_the_boundary(results, schedule):
    for r in results[f"pp2s2_{schedule}_k4_defer"]:
        records = r["audit"]
        assert sum(not rec["boundary"] for rec in records) == 3 + 2  # windows of 4 and 3
        for rec in records:
            shard = rec["groups"].get("shard", {})
            assert rec["groups"]["pp"]["bytes"] > 0  # activations every micro-step
            if rec["boundary"]:
                assert rec["reductions"] >= 1 and rec["reduction_bytes"] > 0, rec
                assert shard["reduction_bytes"] > 0
            else:
                assert rec["reductions"] == 0 and rec["reduction_bytes"] == 0, rec
                assert shard.get("reduction_bytes", 0) == 0
        assert all(" pp [" in s for s in r["summaries"]), r["summaries"]


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_every_step_reduces_after_every_schedule_step(results, schedule):
    for r in results[f"pp2s2_{schedule}_k4_every_step"]:
        assert all(rec["reduction_bytes"] > 0 for rec in r["audit"])


def test_interleaved_ranks_hold_two_stages_each(results):
    """pp 2 x 2 stages per rank: the steps cut at "2", "4", "6" are stages 0-3; rank 0 of
    the pipeline runs stages 0 and 2, rank 1 stages 1 and 3."""
    for r in results["pp2s2_Interleaved1F1B_k4_defer"]:
        layers = sorted({name.split(".")[0] for name in r["held"]})
        assert layers == (["0", "4"] if r["stage"] == 0 else ["2", "6"]), (r["stage"], layers)


@pytest.mark.parametrize("name", ["pp2s2_clip", "ddp_clip"])
def test_clipping_uses_the_global_norm_across_stages_and_shards(results, name):
    ranks = results[name]
    ref = assert_pipeline_matches_one_process(ranks, samples=SAMPLES, clip=CLIP)
    assert any(n > CLIP for n in ref["norms"]), "the test must actually clip"
    for r in ranks:
        assert max(abs(a - b) for a, b in zip(r["norms"], ref["norms"], strict=True)) < 1e-5


def test_auto_weighs_each_stages_gradients_against_the_budget(results):
    assert {r["policy"] for r in results["pp2s2_auto_fits"]} == {"defer"}
    assert {r["policy"] for r in results["pp2s2_auto_small"]} == {"every_step"}


def test_replicas_all_reduce_once_per_window(results):
    for policy in ("defer", "defer_replicate"):
        for r in results[f"pp2r2_1F1B_k4_{policy}"]:
            for rec in r["audit"]:
                across = rec["groups"].get("replicate", {}).get("reduction_bytes", 0)
                assert (across > 0) == rec["boundary"], (policy, rec)


@pytest.mark.parametrize("policy", ["defer", "every_step", "interleaved", "ddp", "ddp_power_sgd"])
def test_a_mid_window_save_resumes_bitwise(results, policy):
    """Under defer and every_step, under defer with two stages per rank, and on ddp (with
    PowerSGD's state saved while it compresses: four windows)."""
    windows = 4 if policy.endswith("power_sgd") else 2
    for r in results[f"resume_{policy}"]:
        assert r["steps"] == [windows, windows]
        assert max_diff(r["went_on"], r["resumed"]) == 0.0


@pytest.fixture(scope="module")
def one_process(results):
    """One process (a 1-rank launch) loading each boundary checkpoint, then training the
    next two windows on the global batches of the pipeline's two data ranks."""
    folders = {
        "save": FOLDER / "boundary",
        "save_ddp": FOLDER / "boundary-ddp",
        "save_interleaved": results.folder / "interleaved",
        **{name: results.folder / name for name in ("sharded", "whole")},
    }
    loads = {
        name: Scenario(pp.load_whole, folder=str(folder), data_size=2)
        for name, folder in folders.items()
    }
    loads["single"] = Scenario(
        pp.load_whole, folder=str(results.folder / "single"), data_size=2, backend="single"
    )
    ran = run_scenarios(loads, nproc=1)
    return {name: ran[name][0] for name in loads}


@pytest.mark.parametrize("saved", ["save", "save_interleaved", "save_ddp"])
def test_a_pipeline_checkpoint_loads_into_the_whole_model_in_one_process(
    results, one_process, saved
):
    """One stage per rank, two (Interleaved1F1B), and DDP stages (the same DCP layout): the
    whole model's names, and the momentum came back too (the next two windows agree)."""
    ranks = results[saved]  # saved (raises with the worker's error otherwise)
    one = one_process[saved]
    assert one["steps"] == 4 and sorted(one["state"]) == sorted(
        {k for r in ranks for k in r["state"]}
    )
    for r in ranks:
        assert r["steps"] == 4
        assert max_diff(r["state"], {k: one["state"][k] for k in r["state"]}) < 1e-5


@pytest.mark.parametrize("saved", ["whole", "sharded", "single", "single_ddp"])
def test_a_checkpoint_saved_without_pp_loads_into_the_pipeline(results, one_process, saved):
    """Saved by one process, or by FSDP2 on dp_shard 2 x dp_replicate 2: each stage loads
    its part (parameters and momentum) and the pipeline trains on as one process does. The
    same from backend='single''s plain files, into pp 2 x dp_shard 2 (each stage's shards cut
    from the full tensors) and into DDP stages on pp 2 x dp_replicate 2, against one process
    loading those files."""
    ranks = results[f"from_{saved}"]
    one = one_process[saved.removesuffix("_ddp")]
    assert one["steps"] == 4
    assert sorted({k for r in ranks for k in r["state"]}) == sorted(one["state"])
    for r in ranks:
        assert r["steps"] == 4
        assert max_diff(r["state"], {k: one["state"][k] for k in r["state"]}) < 1e-5


@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
def test_save_model_writes_every_stage_and_shard(results, backend):
    """pp 2 x dp_shard 2 (each stage's shards gathered, then both stages) and pp 2 x
    dp_replicate 2: the whole model on every rank and in rank 0's file."""
    assert_saves_the_whole_model(results[f"save_model_{backend}"], FOLDER / f"model-{backend}")


def test_a_mid_window_checkpoint_of_another_split_is_refused_on_every_rank(results):
    """pp 4, the last two stages cut elsewhere than when saved: their ranks find other
    parameters, and the first two ranks, whose stages match, refuse too (naming the rank that
    found it) instead of waiting alone in the collective read."""
    errors = [r["error"] for r in results["mid_other_split"]]
    assert all(e and "saved mid-window with other parameters" in e for e in errors), errors
    assert errors[0] == errors[1] and errors[0].startswith("rank 2: "), errors
    assert not errors[2].startswith("rank ") and "\n" not in errors[0], errors


@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
def test_a_plain_file_checkpoint_the_pipeline_cannot_load_is_one_line(results, backend):
    """Into FSDP2 and DDP stages: plain files of another model (refused on every rank before
    anything is set), and plain files saved mid-window, whose per-rank window gradients a
    pipeline's ranks do not hold."""
    mid, other = results.folder / "mid-plain", results.folder / "single_other"
    for r in results["refused" if backend == "fsdp" else "refused_ddp"]:
        assert r[str(other)] == (
            f"CheckpointError: checkpoint file {str(other / 'model_0.pt')!r} holds another "
            "model: missing [], unexpected ['7.weight', '7.bias'], shapes []; prepare the "
            "model it was saved from (the same parameter names) before load_state()"
        )
        assert r[str(mid)] == (
            f"CheckpointError: checkpoint {str(mid)!r} was saved mid-window with backend='ddp' "
            "in its 'plain' format; its window gradients are per rank of another layout than a "
            "pipeline's: resume with the same parallelism, or from a checkpoint saved at a "
            "boundary"
        )


def test_a_checkpoint_the_pipeline_cannot_load_is_one_line(results):
    for r in results["refused"]:
        other = r[str(results.folder / "other")]
        assert other == (
            f"CheckpointError: checkpoint {str(results.folder / 'other' / 'dcp_0')!r} holds "
            "another model: missing [], unexpected ['7.weight', '7.bias'] (0 and 2 names); "
            "prepare the model it was saved from (the same parameter names) before load_state()"
        )


@pytest.mark.parametrize("name", ["pp2s2_drop_defer", "pp2s2_drop_every_step", "ddp_drop_defer"])
def test_a_dropped_window_leaks_nothing(results, name):
    ranks = results[name]
    for r in ranks:
        assert [len(w) for w in r["dropped"]] == [2]
    assert_pipeline_matches_one_process(ranks, samples=SAMPLES)


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_ddp_stages_all_reduce_once_per_window_under_defer(results, schedule):
    """Each stage's DDP all-reduces its gradients over its data ranks at the boundary alone:
    no gradient byte between them off it, and the self-check stays silent."""
    for r in results[f"ddp_{schedule}_k4_defer"]:
        assert r["policy"] == "defer" and r["data_size"] == 2
        records = r["audit"]
        assert sum(not rec["boundary"] for rec in records) == 3 + 2  # windows of 4 and 3
        for rec in records:
            assert rec["groups"]["pp"]["bytes"] > 0  # activations every micro-step
            data = rec["groups"].get("dp", {}).get("reduction_bytes", 0)
            if rec["boundary"]:
                assert rec["reductions"] == 1 and rec["reduction_bytes"] == data > 0, rec
            else:
                assert rec["reductions"] == 0 and rec["reduction_bytes"] == 0, rec
        assert not [w for w in r["warnings"] if "self-check" in w], r["warnings"]


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_ddp_stages_all_reduce_after_every_schedule_step_under_every_step(results, schedule):
    for r in results[f"ddp_{schedule}_k4_every_step"]:
        assert r["policy"] == "every_step"
        for rec in r["audit"]:
            assert rec["reductions"] == 1 and rec["groups"]["dp"]["reduction_bytes"] > 0, rec


@pytest.mark.parametrize(
    ("name", "plain"),
    [("hooked_ddp_fp16", "ddp_1F1B_k4_defer"), ("hooked_fsdp_fp16", "pp2s2_1F1B_k4_defer")],
)
def test_stages_take_a_comm_hook_at_the_boundary(results, name, plain):
    """comm_hook="fp16" on DDP and FSDP2 stages: each stage's boundary reduction, over its own
    data ranks, sends half the bytes of the uncompressed run, nothing off it, and the stages
    stay within fp16's tolerance of one process (2e-4, as tests/multiprocess/test_comm_hook.py
    takes without pp)."""
    ranks = results[name]
    assert_pipeline_matches_one_process(ranks, samples=SAMPLES, tolerance=2e-4)
    full_runs = {(r["stage"], r["data_rank"]): r for r in results[plain]}
    for r in ranks:
        half = [_data_bytes(rec) for rec in r["audit"]]
        full = [_data_bytes(rec) for rec in full_runs[r["stage"], r["data_rank"]]["audit"]]
        assert [2 * b for b in half] == full and sum(half) > 0, (half, full)


def test_ddp_stages_compress_with_power_sgd_over_their_data_ranks(results):
    """comm_hook="power_sgd" on DDP stages (PowerSGD from the third window, rank 1): each
    stage's all-reduce runs over its own data ranks, both replicas of a stage stay identical,
    the compressed windows send at most a quarter of the uncompressed ones' bytes, and the
    model stays near one process (measured 3.7e-3 after 4 windows)."""
    ranks = results["hooked_ddp_power_sgd"]
    ref = pipeline_reference(ranks, samples=SAMPLES)
    for r in ranks:
        assert max_diff(r["state"], ranks[0]["state"]) == 0.0
        assert max_diff(r["state"], ref["state"]) < 1e-2
        sent = [_data_bytes(rec) for rec in r["audit"]]
        boundaries = [b for b, rec in zip(sent, r["audit"]) if rec["boundary"]]
        assert sent == [b if rec["boundary"] else 0 for b, rec in zip(sent, r["audit"])]
        plain, compressed = boundaries[:2], boundaries[2:]
        assert len(set(plain)) == 1 and all(0 < c <= plain[0] / 4 for c in compressed), sent


def test_ddp_stages_each_hold_their_part_and_read_as_the_mesh_says(results):
    ranks = results["ddp_1F1B_k4_defer"]
    assert [(r["stage"], r["data_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    layers = {r["stage"]: sorted({k.split(".")[0] for k in r["held"]}) for r in ranks}
    assert layers == {0: ["0", "2"], 1: ["4", "6"]}
    assert all(r["opt_params"] == 4 for r in ranks)  # the other stage's left the optimizer


def test_a_pipelines_mid_window_checkpoint_refuses_another_split_in_one_line(results):
    """Its window gradients are per rank: FSDP2 without pp on the same 4 ranks refuses them
    before anything is set."""
    for r in results["refused_mid"]:
        assert r[str(FOLDER / "mid-defer")] == (
            f"CheckpointError: checkpoint {str(FOLDER / 'mid-defer')!r} was saved mid-window "
            "with other parameters on this rank (4 vs 8 here: another pipeline split or none); "
            "its window gradients resume only on the same parallelism: resume with it, or from "
            "a checkpoint saved at a boundary"
        )


@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
def test_the_first_schedule_step_leaves_the_buffers_as_they_were(results, backend):
    """The first schedule step infers the activations' shapes with a forward in training
    mode (on zeros or uninitialised memory), which updates a batch norm's running statistics;
    they are put back, so after the first schedule step each stage holds what one process
    holds after the same two parts of that micro-batch."""
    for r in results[f"buffers_{backend}"]:
        for got, want in zip(r["got"], r["want"], strict=True):
            assert got == pytest.approx(want, abs=1e-5), (r["stage"], got, want)
        assert all(abs(v) < 100 for step in r["at_step"] for v in step), r["at_step"]


def test_ddp_stages_broadcast_their_buffers_at_each_windows_first_forward(results):
    """As DDP without a pipeline: the first forward after a synchronised one broadcasts the
    buffers (batch norms' running statistics) from the data group's first rank, so both data
    ranks of a stage start each window from the same; off the boundary each keeps its own."""
    ranks = results["buffers_ddp"]
    for stage in (0, 1):
        first, second = (r["at_step"] for r in ranks if r["stage"] == stage)
        assert first[2] == second[2]  # the second window's first step: broadcast
        assert first[1] != second[1] and first[3] != second[3]  # each rank's own data
