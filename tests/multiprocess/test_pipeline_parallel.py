"""Pipeline parallelism composed with accumulation on a real 2-rank gloo group: pp=2 (one
stage per rank) with the GPipe and 1F1B schedules, k = 1 and 4 (the last window partial),
under every_step and defer, each against one process on the same global windows; clipping
with the global norm across stages; the pipeline's sends and receives audited on their own
line; misuse and bad settings as one line each. On backend='ddp' too (each stage in DDP over
its one data rank): 1F1B, k = 4, defer. A checkpoint saved without pp (by one process, a
1-rank launch before the group, and by FSDP2 on dp_shard=2) loads into the pipeline, which
trains on as one process loading it does (a 1-rank launch after); so does one saved in plain
files by backend='single', into FSDP2 and DDP stages.

Every scenario runs in the 2-rank group shared with the other 2-rank modules.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from harness import Scenario, Shared, run_scenarios
from harness.checks import (
    assert_decoder_pipeline_matches_one_process,
    assert_pipeline_matches_one_process,
    assert_saves_the_whole_model,
    max_diff,
)
from scenarios import pp, pp_decoder

SAMPLES = 28  # 7 micro-batches of 4: windows of 4 and a partial 3 with k = 4
MICRO = 4
SCHEDULES = ("GPipe", "1F1B")
POLICIES = ("every_step", "defer")
CLIP = 0.1


def _train(schedule: str, k: int, policy: str, microbatches: int = 2, **kw) -> Scenario:
    return Scenario(
        pp.train_pp,
        dims={"pp": 2},
        steps=k,
        policy=policy,
        schedule=schedule,
        microbatches=microbatches,
        samples=SAMPLES,
        micro_batch=MICRO,
        **kw,
    )


#: The Llama scenarios need transformers (the hf extra).
HF = importlib.util.find_spec("transformers") is not None

SCENARIOS = {
    **{f"pp2_{s}_k{k}_{p}": _train(s, k, p) for s in SCHEDULES for k in (1, 4) for p in POLICIES},
    "pp2_1F1B_k4_defer_m4": _train("1F1B", 4, "defer", microbatches=4),
    "pp2_clip": _train("1F1B", 4, "defer", clip=CLIP),
    **{f"pp2_tokens_{s}": _train(s, 4, "defer", tokens=True) for s in SCHEDULES},
    **{
        f"no_pipeline_{b}": Scenario(
            pp.train_pp,
            dims={},
            steps=4,
            policy="defer",
            schedule="1F1B",
            microbatches=2,
            samples=SAMPLES * 2,
            micro_batch=MICRO,
            backend=b,
        )
        for b in ("ddp", "fsdp")
    },
    "misuse": Scenario(pp.misuse),
    "no_module": Scenario(pp.refused, split=["9"]),
    "not_in_order": Scenario(pp.refused, split=["0"]),
    "no_params": Scenario(pp.refused, split=["1"], bare_tail=True),
    "two_cuts": Scenario(pp.refused, split=["2", "4"]),
    "m_not_dividing": Scenario(pp.refused, pp_microbatches=3, micro_batch=4),
    "no_split": Scenario(pp.refused, split=None),
    "interleaved": Scenario(pp.refused, pp_schedule="Interleaved1F1B"),
    "per_rank_1f1b": Scenario(pp.refused, pp_stages_per_rank=2),
    **{
        f"pp2_interleaved_k4_{p}": _train(
            "Interleaved1F1B", 4, p, split=["2", "4", "6"], per_rank=2
        )
        for p in POLICIES
    },
    "pp2_interleaved_callable_k4_defer": _train(
        "Interleaved1F1B", 4, "defer", split="slices", per_rank=2
    ),
    "deepspeed": Scenario(pp.refused, backend="deepspeed"),
    "fairscale": Scenario(pp.refused, backend="fairscale"),
    "ddp_sharded": Scenario(pp.refused, backend="ddp", dims={"pp": 2, "dp_shard": -1}),
    "ddp_interleaved": Scenario(
        pp.refused,
        backend="ddp",
        pp_schedule="Interleaved1F1B",
        pp_stages_per_rank=2,
        split=["2", "4", "6"],
    ),
    "ddp_oom_split": Scenario(pp.refused, backend="ddp", on_oom="split"),
    "pp2_ddp_1F1B_k4_defer": _train("1F1B", 4, "defer", backend="ddp"),
    # a callable's two fresh nn.Sequential, each numbered from 0
    "pp2_callable_k4_defer": _train("1F1B", 4, "defer", split="fresh"),
    "pp2_ddp_callable_k4_defer": _train("1F1B", 4, "defer", split="fresh", backend="ddp"),
    **(
        {
            "llama_1F1B": Scenario(pp_decoder.train, dims={"pp": 2}, schedule="1F1B", samples=32),
            "llama_tied": Scenario(pp_decoder.refused_tied),
            "llama_interleaved": Scenario(
                pp_decoder.train,
                dims={"pp": 2},
                schedule="Interleaved1F1B",
                samples=32,
                split=pp_decoder.SPLIT4,
                per_rank=2,
                padded=True,
            ),
            "llama_padded": Scenario(
                pp_decoder.train, dims={"pp": 2}, schedule="1F1B", samples=32, padded=True
            ),
            "llama_bad_mask": Scenario(pp_decoder.bad_mask),
        }
        if HF
        else {}
    ),
    **{f"canary_{b or 'holds'}": Scenario(pp.canary, broken=b) for b in ("", "renamed", "reduces")},
    "canary_interleaved": Scenario(pp.canary, broken="", per_rank=2),
    "world_label": Scenario(pp.world_label),  # after every pipeline above
}
TRAINED = [n for n in SCENARIOS if n.startswith("pp2_") and n != "pp2_clip" and "tokens" not in n]


def scenarios(folder: Path) -> dict[str, Scenario]:
    """The scenarios, after one process saved the whole model into ``folder / "whole"``; the
    loads into the pipeline before ``world_label``, which comes last."""
    alone = {"whole": {}, "single": {"backend": "single"}}  # FSDP2's DCP, and plain files
    run_scenarios(
        {
            name: Scenario(pp.save_at_boundary, dims=None, folder=str(folder / name), **options)
            for name, options in alone.items()
        },
        nproc=1,
    )
    loads = {
        "save_sharded": Scenario(
            pp.save_at_boundary, dims={"dp_shard": 2}, folder=str(folder / "sharded")
        ),
        **{
            f"from_{name}": Scenario(pp.load_pipeline, dims={"pp": 2}, folder=str(folder / name))
            for name in ("whole", "sharded")
        },
        **{
            f"from_single_{backend}": Scenario(
                pp.load_pipeline, dims={"pp": 2}, folder=str(folder / "single"), backend=backend
            )
            for backend in ("fsdp", "ddp")
        },
        **{
            f"from_whole_callable_{backend}": Scenario(
                pp.load_pipeline,
                dims={"pp": 2},
                folder=str(folder / "whole"),
                split="fresh",
                backend=backend,
            )
            for backend in ("fsdp", "ddp")
        },
        **{
            f"{name}_{backend}": Scenario(
                fn, folder=str(folder / f"{name}-{backend}"), backend=backend, **dims
            )
            for backend in ("fsdp", "ddp")
            for name, fn, dims in (
                ("save_model", pp.save_model, {"dims": {"pp": 2}}),
                ("accelerate", pp.accelerate_layout, {}),
                ("tampered", pp.tampered_load, {"dims": {"pp": 2}}),
            )
        },
    }
    before = {k: v for k, v in SCENARIOS.items() if k != "world_label"}
    return {**before, **loads, "world_label": SCENARIOS["world_label"]}


SHARED = Shared("gloo2", scenarios)


@pytest.fixture(scope="module")
def results(shared):
    return shared(SHARED)


@pytest.mark.parametrize("name", TRAINED)
def test_equivalence_with_one_process(results, name):
    ranks = results[name]
    assert sorted(r["stage"] for r in ranks) == [0, 1]
    ref = assert_pipeline_matches_one_process(ranks, samples=SAMPLES)
    k = SCENARIOS[name].params["steps"]
    assert len(ranks[0]["windows"]) == (7 if k == 1 else 2)
    # the last stage's loss of each window's first micro-step is the one process's
    last = next(r for r in ranks if r["stage"] == 1)
    firsts = [
        last["losses"][sum(len(w) for w in last["windows"][:i])]
        for i in range(len(ref["first_losses"]))
    ]
    assert max(abs(a - b) for a, b in zip(firsts, ref["first_losses"], strict=True)) < 1e-5


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_token_weighted_loss_equals_one_process(results, schedule):
    ranks = results[f"pp2_tokens_{schedule}"]
    ref = assert_pipeline_matches_one_process(ranks, samples=SAMPLES, tokens=True)
    last = next(r for r in ranks if r["stage"] == 1)
    assert abs(last["losses"][0] - ref["first_losses"][0]) < 1e-5  # the micro-batch's sum


@pytest.mark.parametrize("split", ["", "_callable"])
def test_interleaved_ranks_hold_two_stages_each(results, split):
    """Module paths or a callable's four slices: rank 0 runs stages 0 and 2, rank 1 1 and 3."""
    for r in results[f"pp2_interleaved{split}_k4_defer"]:
        layers = sorted({name.split(".")[0] for name in r["held"]})
        assert layers == (["0", "4"] if r["stage"] == 0 else ["2", "6"]), (r["stage"], layers)


@pytest.mark.skipif(not HF, reason="needs transformers (the hf extra)")
def test_a_llama_split_by_layer_names_equals_one_process(results):
    """``pp_split=["model.layers.2"]`` on a Transformers Llama, token-weighted, k = 4, defer."""
    assert_decoder_pipeline_matches_one_process(results["llama_1F1B"], samples=32)


@pytest.mark.skipif(not HF, reason="needs transformers (the hf extra)")
def test_an_interleaved_llama_split_by_layer_names_equals_one_process(results):
    """Four stages of one decoder layer each, two per rank (Interleaved1F1B), k = 4, defer,
    on left-padded batches: each rank hands the padding mask to both of its stages."""
    ranks = results["llama_interleaved"]
    assert_decoder_pipeline_matches_one_process(ranks, samples=32)
    for r in ranks:  # rank 0: the embedding and layers 0, 2; rank 1: layers 1, 3 and the head
        layers = sorted({n.split(".")[2] for n in r["held"] if n.startswith("model.layers.")})
        assert layers == (["0", "2"] if r["stage"] == 0 else ["1", "3"]), layers
        assert any(n.startswith("lm_head") for n in r["held"]) == (r["stage"] == 1)


@pytest.mark.skipif(not HF, reason="needs transformers (the hf extra)")
def test_a_padded_llama_batch_equals_one_process(results):
    """Left-padded sequences with their padding mask (``inputs`` a mapping), labels -100 on
    the padding, token-weighted: every stage applies the mask, as one process does."""
    assert_decoder_pipeline_matches_one_process(results["llama_padded"], samples=32)


@pytest.mark.skipif(not HF, reason="needs transformers (the hf extra)")
def test_a_padding_mask_of_the_wrong_shape_is_one_line(results):
    for r in results["llama_bad_mask"]:
        assert r["error"] is not None and "\n" not in r["error"], r
        assert r["error"].startswith("UsageError") and "attention_mask" in r["error"], r
        assert "(4, 7)" in r["error"] and "(4, 8)" in r["error"], r["error"]


@pytest.mark.skipif(not HF, reason="needs transformers (the hf extra)")
def test_a_llama_with_tied_embeddings_is_refused_in_one_line(results):
    for r in results["llama_tied"]:
        assert r["error"] is not None and "\n" not in r["error"], r
        assert "tie_word_embeddings=True" in r["error"], r["error"]


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_the_same_loop_without_a_pipeline_equals_one_process(results, backend):
    ranks = results[f"no_pipeline_{backend}"]  # two data-parallel ranks, the whole model each
    assert [r["data_rank"] for r in ranks] == [0, 1]
    assert len(ranks[0]["windows"]) == 2  # windows of 4 and 3 micro-steps
    assert_pipeline_matches_one_process(ranks, samples=SAMPLES * 2)


def test_each_stage_optimizes_only_its_own_parameters(results):
    counts = {r["stage"]: r["opt_params"] for r in results["pp2_1F1B_k4_defer"]}
    assert counts == {0: 4, 1: 4}  # two Linear layers (weight, bias) on each stage


def test_clipping_uses_the_global_norm_across_stages(results):
    ranks = results["pp2_clip"]
    ref = assert_pipeline_matches_one_process(ranks, samples=SAMPLES, clip=CLIP)
    assert any(n > CLIP for n in ref["norms"]), "the test must actually clip"
    for r in ranks:
        assert max(abs(a - b) for a, b in zip(r["norms"], ref["norms"], strict=True)) < 1e-5


@pytest.mark.parametrize("policy", POLICIES)
def test_the_pipeline_traffic_is_audited_on_its_own_line(results, policy):
    for r in results[f"pp2_1F1B_k4_{policy}"]:
        for rec in r["audit"]:
            pipe = rec["groups"]["pp"]
            assert pipe["ops"].get("send", 0) > 0 and pipe["ops"].get("recv", 0) > 0
            assert rec["reductions"] == 0 or rec["boundary"] or policy == "every_step"
        assert all(" pp [" in s for s in r["summaries"]), r["summaries"]


def test_misuse_is_one_line_naming_pipeline_step(results):
    for r in results["misuse"]:
        assert r["forward"].startswith("UsageError") and "accel.pipeline_step(" in r["forward"]
        assert "\n" not in r["forward"]
        assert r["outside"].startswith("UsageError") and "accumulate" in r["outside"]
        assert (
            r["indivisible"].startswith("ConfigError") and "pp_microbatches=2" in r["indivisible"]
        )


REFUSALS = {
    "no_module": "'9' names no module",
    "not_in_order": "leaves stage 0 empty",
    "no_params": "leaves stage 1 without trainable parameters",
    "two_cuts": "names 2 module(s), and pp=2 needs 1",
    "m_not_dividing": "pp_microbatches=3 does not divide micro_batch_size=4",
    "no_split": "no pp_split says where the stages begin",
    "interleaved": "pp_stages_per_rank=1; give pp_stages_per_rank >= 2",
    "per_rank_1f1b": "pp_schedule='1F1B' runs one stage per rank, and pp_stages_per_rank=2",
    "deepspeed": "backend='deepspeed' cannot pipeline",
    "fairscale": "backend='fairscale' cannot pipeline",
    "ddp_sharded": "backend='ddp' replicates each stage over its data-parallel ranks",
    "ddp_oom_split": "on_oom='split' is not available: pp=2 run collectives",
    "ddp_interleaved": "pp_stages_per_rank=2 runs several stages on each rank, which backend='ddp'",
}


@pytest.mark.parametrize("name", REFUSALS)
def test_bad_settings_are_one_config_error_line(results, name):
    for r in results[name]:
        assert r["error"] is not None and REFUSALS[name] in r["error"], r["error"]
        assert "\n" not in r["error"]


def test_a_pipeline_over_the_whole_world_leaves_the_world_groups_label(results):
    # Other scenarios of the pooled group may have labelled the world group (an HSDP mesh
    # whose replicate dim spans the world); a pipeline never labels it "pp".
    labels = [r["label"] for r in results["world_label"]]
    assert len(labels) == 2 and "pp" not in labels, labels


@pytest.mark.parametrize("name", ["canary_holds", "canary_interleaved"])
def test_on_an_untested_torch_the_first_window_checks_the_stage_hooks(results, name):
    """torch taken as newer than the tested range: every schedule step of the first window
    is checked (no collective), finds the hooks acting, and the check ends at the boundary."""
    for r in results[name]:
        assert r["errors"] == [] and r["checked"], r


@pytest.mark.parametrize(
    "broken, words",
    [
        ("renamed", ("PipelineStage.perform_reduce_grad) closed it 0 times",)),
        # torch 2.13 leaves its state for gradsync's end, which then sees the reduction;
        # torch 2.15 finalizes FSDP2's backward itself, and gradsync's end fails inside it
        (
            "reduces",
            (
                "the data-parallel reduction ran off the window boundary",
                "the end of a schedule step's backward failed inside torch (AssertionError: ",
            ),
        ),
    ],
)
def test_a_stage_hook_that_no_longer_acts_is_one_line_naming_torch(results, broken, words):
    """A planted hook: torch's own end of backward (as if torch had renamed the method
    gradsync replaces), or torch's reduction before gradsync's: the first schedule step
    raises one line naming the torch version and what to install."""
    for r in results[f"canary_{broken}"]:
        assert len(r["errors"]) == 1 and not r["checked"], r
        error = r["errors"][0]
        assert any(w in error for w in words) and "\n" not in error, error
        assert error.startswith(f"torch {torch.__version__} is newer") and "pip install" in error


@pytest.fixture(scope="module")
def one_process(results):
    """One process (a 1-rank launch) loading each checkpoint saved without pp, then training
    the next two windows on the same batches as the pipeline."""
    loads = {
        name: Scenario(pp.load_whole, folder=str(results.folder / name), data_size=1, **options)
        for name, options in (("whole", {}), ("sharded", {}), ("single", {"backend": "single"}))
    }
    ran = run_scenarios(loads, nproc=1)
    return {name: ran[name][0] for name in loads}


@pytest.mark.parametrize(
    "saved",
    [
        "whole",
        "sharded",
        "whole_callable_fsdp",
        "whole_callable_ddp",
        "single_fsdp",
        "single_ddp",
    ],
)
def test_a_checkpoint_saved_without_pp_loads_into_the_pipeline(results, one_process, saved):
    """Saved by one process or by FSDP2 on dp_shard=2: each stage loads its part of the
    parameters and the momentum, and the next two windows agree with one process's; the same
    into the stages of a callable split (fresh nn.Sequential, on fsdp and ddp), which carry
    the whole model's names. Saved by backend='single' (plain files: the optimizer's state
    numbered by its parameters' order) into FSDP2 and DDP stages: the same, against one
    process loading those files."""
    ranks, one = results[f"from_{saved}"], one_process[saved.split("_")[0]]
    assert one["steps"] == 4
    for r in ranks:  # get_state_dict: the whole model on every rank
        assert sorted(r["state"]) == sorted(one["state"])
        assert r["steps"] == 4
        assert max_diff(r["state"], {k: one["state"][k] for k in r["state"]}) < 1e-5


@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
def test_save_model_writes_every_stage(results, backend):
    """``save_model`` and ``get_state_dict`` on a pipeline: the whole model, gathered from
    both stages, on every rank and in rank 0's file, under the whole model's names."""
    ranks = results[f"save_model_{backend}"]
    assert_saves_the_whole_model(ranks, results.folder / f"save_model-{backend}")


@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
def test_gradsync_accelerate_saves_a_pipeline_in_gradsyncs_format_only(results, backend):
    """Accelerate has no pipeline to resume: no Accelerate layout (one warning on rank 0,
    saying why), gradsync's checkpoint, which a fresh pipeline loads back."""
    ranks = results[f"accelerate_{backend}"]
    first = ranks[0]
    assert len(first["warnings"]) == 1 and "without a pipeline (pp)" in first["warnings"][0]
    assert not any(f.startswith(("model", "optimizer", "pytorch_model")) for f in first["files"])
    assert all(r["same"] for r in ranks)


@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
def test_a_tampered_pipeline_checkpoint_is_refused_and_its_payload_never_runs(results, backend):
    """A payload in the stages' DCP metadata: refused in one line naming the file, on the
    FSDP2 stages and on the DDP stages (which load through the same path)."""
    for r in results[f"tampered_{backend}"]:
        assert not r["ran"], "the payload ran"
        error = r["error"]
        assert "payload.plant" in error and "dcp_0/.metadata" in error, error
        assert "\n" not in error, error
