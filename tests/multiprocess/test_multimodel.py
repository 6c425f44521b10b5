"""Several models in one prepare() call on 2 real ranks: one optimizer over two models, and
two models each with its optimizer updated in one ``accumulate(G, D)`` block, on DDP and
FSDP2, equal to the same training in one process; their checkpoints resume bitwise; a
checkpoint that gradsync 0.1.0 wrote still loads."""

from __future__ import annotations

import pytest
import torch

from harness import Scenario, Shared
from scenarios import multimodel as mm
from scenarios import releases

BACKENDS = ("ddp", "fsdp")
PATTERNS = ("shared", "gan")
KS = (1, 4, 3)  # 3: 8 batches per rank end with a partial window of 2


def scenarios(root):
    return {
        **{
            f"{b}_{p}_k{k}": Scenario(mm.train, backend=b, pattern=p, k=k)
            for b in BACKENDS
            for p in PATTERNS
            for k in KS
        },
        **{
            f"{b}_{p}_resume": Scenario(
                mm.resume, backend=b, pattern=p, k=2, folder=str(root / f"{b}-{p}")
            )
            for b in BACKENDS
            for p in PATTERNS
        },
        **{
            f"{b}_mismatch": Scenario(mm.mismatch, backend=b, folder=str(root / f"{b}-mismatch"))
            for b in BACKENDS
        },
        "fsdp_release_fsdp": Scenario(mm.load_release, backend="fsdp", written_by="fsdp"),
    }


SHARED = Shared("gloo2", scenarios)


@pytest.fixture(scope="module")
def results(shared):
    return shared(SHARED)


def _close(got, want, tol=1e-5):
    assert len(got) == len(want)
    worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(got, want))
    assert worst <= tol, f"max relative difference {worst:.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("k", KS)
def test_two_models_prepared_together_equal_one_process(results, backend, pattern, k):
    for r in results[f"{backend}_{pattern}_k{k}"]:
        _close(r["g"], r["reference"]["g"])
        _close(r["d"], r["reference"]["d"])
        windows = -(-8 // k)  # 8 batches per rank
        # One accumulate(G, D) block per batch: the window advances once per batch, and every
        # optimizer steps once per window.
        assert r["blocks"] == 8
        assert r["steps"] == [windows] * len(r["steps"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_checkpoint_of_several_models_and_optimizers_resumes_bitwise(results, backend, pattern):
    for r in results[f"{backend}_{pattern}_resume"]:
        assert r["g"] == r["whole_g"] and r["d"] == r["whole_d"]
        assert r["steps"] == r["whole_steps"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_of_other_optimizers_is_refused_in_one_line(results, backend):
    for r in results[f"{backend}_mismatch"]:
        assert r["error"].startswith("CheckpointError"), r["error"]
        assert "does not fit this training" in r["error"] and "\n" not in r["error"]


def test_an_fsdp_checkpoint_written_by_gradsync_0_1_0_still_loads(results):
    # (its optimizer lived in the model's DCP folder; tests/unit/test_checkpoint_releases.py
    # loads the plain format's)
    want = releases.continuation("fsdp", world=2)  # this machine, one process, plain torch
    stored = releases.stored("fsdp")  # the machine that wrote the checkpoint
    for r in results["fsdp_release_fsdp"]:
        assert r["loaded_steps"] == 3
        got = {k: torch.tensor(v) for k, v in r["student"].items()}
        assert got.keys() == want.keys()
        # 2 ranks reduce-scatter the gradients, one process sums them: the float32 additions
        # run in another order (a few ulps apart); 1e-6 bounds what one Adam step makes of that
        assert max(float((got[k] - want[k]).abs().max()) for k in want) <= 1e-6
        assert (
            max(float((got[k] - stored[k]).abs().max()) for k in stored)
            <= releases.STORED_TOLERANCE
        )
