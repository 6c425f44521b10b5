"""fp16 (window-aware GradScaler), bf16 and activation checkpointing on DDP and FSDP2: a real
2-rank gloo group, checked against one process on the same global windows."""

from __future__ import annotations

from dataclasses import replace

import pytest

from harness import Scenario, Shared
from harness.checks import assert_matches_one_process, max_diff, reference, reference_amp
from scenarios import amp
from scenarios.common import Loop

SAMPLES = 44  # 22 per rank, 11 micro-batches of 2: windows of 4, 4 and a partial 3
MICRO = 2
RUN = Loop(samples=SAMPLES, micro_batch=MICRO)
BACKENDS = ("ddp", "fsdp")
#: fp16 vs one process under the same autocast and GradScaler (docs/amp.md): the fp16
#: forward and backward are the same per micro-batch; what differs is the order in which
#: the fp32 gradients are summed (per rank, then across ranks), ~1e-7 relative per step.
FP16_TOLERANCE = 1e-5
#: bf16 autocast on DDP vs the fp32 reference, 6 steps (docs/amp.md).
BF16_TOLERANCE = 2e-3
POISON = 2  # the window (0-based) that overflows on rank 1 only
SCENARIOS = {
    **{f"{b}_fp16": Scenario(amp.train_amp, backend=b, steps=4, loop=RUN) for b in BACKENDS},
    **{
        f"{b}_fp16_adam_clip": Scenario(
            amp.train_amp,
            backend=b,
            steps=4,
            loop=replace(RUN, optimizer="adam", lr=0.01, clip=0.5, clip_value=0.02),
        )
        for b in BACKENDS
    },
    "fsdp_fp16_every_step": Scenario(
        amp.train_amp, backend="fsdp", steps=4, policy="every_step", loop=RUN
    ),
    **{
        f"{b}_fp16_{how}": Scenario(
            amp.train_amp, backend=b, steps=4, loop=RUN, **{f"{how}_window": POISON}
        )
        for b, how in (("ddp", "spike"), ("fsdp", "spike"), ("fsdp", "poison"))
    },
    "ddp_bf16": Scenario(amp.train_amp, backend="ddp", steps=4, mixed_precision="bf16", loop=RUN),
    **{
        f"{b}_ac_{name}": Scenario(
            amp.train_checkpointed, backend=b, steps=4, checkpointing=ac, loop=RUN
        )
        for b in BACKENDS
        for name, ac in (("none", None), ("block", ["Block"]))
    },
    **{f"{b}_errors": Scenario(amp.errors, backend=b) for b in BACKENDS},
}


SHARED = Shared("gloo2", SCENARIOS)


@pytest.fixture(scope="module")
def results(shared):
    return shared(SHARED)


def _off_boundary_reductions(records):
    return [r for r in records if not r["boundary"] and r["reductions"]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["", "_adam_clip"])
def test_fp16_equals_one_process_under_the_same_scaler(results, backend, variant):
    ranks = results[f"{backend}_fp16{variant}"]
    kw = {"optimizer": "adam", "lr": 0.01, "clip": 0.5} if variant else {}
    ref = reference_amp(ranks, samples=SAMPLES, **kw, **({"clip_value": 0.02} if variant else {}))
    for r in ranks:
        assert r["dtypes"] == ["torch.float16"], "the forward must run under fp16 autocast"
        assert r["eval_dtype"] == "torch.float16", "accel.autocast() is the same autocast"
        assert r["skipped"] == ref["skipped"] == [False] * 6
        assert r["scales"] == ref["scales"]
        diff = max_diff(r["state"], ref["state"])
        print(f"{backend}{variant} fp16: max diff vs one process {diff:.2e}")
        assert diff < FP16_TOLERANCE
        if variant:
            assert max(abs(a - b) for a, b in zip(r["norms"], ref["norms"])) < 1e-4
    assert max_diff(ranks[0]["state"], ranks[1]["state"]) == 0.0
    # fp16 really changes the result (the test would pass vacuously otherwise)
    assert max_diff(ranks[0]["state"], reference(ranks, samples=SAMPLES, **kw)["state"]) > 1e-5


@pytest.mark.parametrize("name", ["ddp_fp16", "fsdp_fp16"])
def test_fp16_keeps_deferral(results, name):
    for r in results[name]:
        assert len(r["audit"]) == 22
        assert not _off_boundary_reductions(r["audit"])
        assert all(rec["reductions"] >= 1 for rec in r["audit"] if rec["boundary"])


@pytest.mark.parametrize(
    ("backend", "how"), [("ddp", "spike"), ("fsdp", "spike"), ("fsdp", "poison")]
)
def test_an_overflow_on_one_rank_skips_one_step_on_both(results, backend, how):
    """spike: rank 1's loss spikes in a deferred micro-step (its backward overflows fp16);
    poison: an inf lands in rank 1's shard of the reduced gradient, which only rank 1 holds."""
    ranks = results[f"{backend}_fp16_{how}"]
    ref = reference_amp(ranks, samples=SAMPLES, **{f"{how}_window": POISON})
    want = [w == POISON for w in range(6)]
    assert ref["skipped"] == want
    for r in ranks:
        assert r["skipped"] == want
        assert r["optimizer_steps"] == 5 == r["scheduler_last_epoch"] == ref["last_epoch"]
        assert r["scales"][POISON] == r["scales"][POISON - 1] / 2 == 32768.0
        assert r["scales"] == ref["scales"]
        assert r["scaler_state"]["scale"] == 32768.0
        assert r["last_lrs"] == pytest.approx([0.05 / 6])
        assert max_diff(r["state"], ref["state"]) < FP16_TOLERANCE  # training went on
    assert max_diff(ranks[0]["state"], ranks[1]["state"]) == 0.0


def test_fsdp_every_step_fp16(results):
    ranks = results["fsdp_fp16_every_step"]
    ref = reference_amp(ranks, samples=SAMPLES)
    for r in ranks:
        assert max_diff(r["state"], ref["state"]) < FP16_TOLERANCE


def test_bf16_on_ddp_within_its_tolerance(results):
    ranks = results["ddp_bf16"]
    ref = reference(ranks, samples=SAMPLES)
    for r in ranks:
        assert r["dtypes"] == ["torch.bfloat16"] and r["eval_dtype"] == "torch.bfloat16"
        diff = max_diff(r["state"], ref["state"])
        print(f"ddp bf16: max diff vs fp32 one process {diff:.2e}")
        assert 1e-6 < diff < BF16_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
def test_activation_checkpointing_changes_no_result_and_saves_memory(results, backend):
    plain, checkpointed = results[f"{backend}_ac_none"], results[f"{backend}_ac_block"]
    for a, b in zip(plain, checkpointed):
        assert max_diff(a["state"], b["state"]) < 1e-6
        print(
            f"{backend}: saved for backward {a['saved_bytes']} B plain, {b['saved_bytes']} B checkpointed"
        )
        assert b["saved_bytes"] < a["saved_bytes"]
        assert not _off_boundary_reductions(b["audit"][4:])
    assert_matches_one_process(checkpointed, samples=SAMPLES)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs(results, backend):
    for m in results[f"{backend}_errors"]:
        assert m["unknown_class"].startswith(
            "ConfigError: activation_checkpointing=['Transformer']"
        )
        assert "Block, Linear, ModuleList, Net" in m["unknown_class"]
        assert m["user_scaler"].startswith("ConfigError: prepare() got a GradScaler")
        assert "one loss scaler per run" in m["user_scaler"]
        assert m["wrapped"].startswith(
            "ConfigError: activation_checkpointing and compile with a model "
            f"already wrapped in {'DistributedDataParallel' if backend == 'ddp' else 'FSDPNet'}"
        )
