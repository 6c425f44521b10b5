"""Accelerate's API on 2 real ranks: ``window_loss`` (the global window mean, equal on every
rank, token-weighted with ``reduction="sum"``, never hanging when only rank 0 reads it) and
manual ``no_sync`` / ``trigger_sync_in_backward`` (deferral seen by the audit, parameters
equal to one process's), on DDP and FSDP2."""

from __future__ import annotations

import pytest

from harness import Scenario, Shared
from scenarios import accelerate_api as api

BACKENDS = ("ddp", "fsdp")
STYLES = ("trigger", "plain", "backward_only")
SCENARIOS = {
    **{
        f"{b}_loss_k{k}": Scenario(api.window_loss, backend=b, k=k, samples=22, read_on="all")
        for b in BACKENDS
        for k in (1, 4)
    },
    **{
        f"{b}_loss_main_only": Scenario(api.window_loss, backend=b, k=2, samples=16, read_on="main")
        for b in BACKENDS
    },
    **{f"{b}_tokens": Scenario(api.token_window_loss, backend=b) for b in BACKENDS},
    **{f"ddp_manual_{s}": Scenario(api.manual, backend="ddp", style=s) for s in STYLES},
    "fsdp_manual_trigger": Scenario(api.manual, backend="fsdp", style="trigger"),
    "fsdp_manual_plain": Scenario(api.manual, backend="fsdp", style="plain"),
}


def scenarios(tensorboard_dir):
    return {
        **SCENARIOS,
        "ddp_logged": Scenario(
            api.window_loss,
            backend="ddp",
            k=4,
            samples=22,
            read_on="main",
            project_dir=str(tensorboard_dir / "ddp"),
        ),
        "gpt2_logged": Scenario(api.gpt2_tokens, project_dir=str(tensorboard_dir / "gpt2")),
    }


SHARED = Shared("gloo2", scenarios)


@pytest.fixture(scope="module")
def results(shared):
    return shared(SHARED)


@pytest.fixture(scope="module")
def tensorboard_dir(results):
    return results.folder


def _logged(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("loss")]


@pytest.mark.parametrize("name, folder", [("ddp_logged", "ddp/run"), ("gpt2_logged", "gpt2/gpt2")])
def test_the_logged_loss_read_back_from_tensorboard_is_the_global_window_mean(
    results, tensorboard_dir, name, folder
):
    expected = results[name][0]["expected"]
    logged = _logged(tensorboard_dir / folder)
    assert [step for step, _ in logged] == list(range(1, len(expected) + 1))  # optimizer steps
    assert [v for _, v in logged] == pytest.approx(expected, rel=1e-6)
    assert len(list((tensorboard_dir / folder).glob("events.out.tfevents.*"))) == 1  # rank 0's only


@pytest.mark.parametrize("name", [n for n in SCENARIOS if "_loss_" in n or n.endswith("_tokens")])
def test_window_loss_is_the_global_window_mean_on_every_rank(results, name):
    runs = results[name]
    expected = runs[0]["expected"]
    assert expected  # some windows closed
    for rank, r in enumerate(runs):
        if name.endswith("main_only") and rank > 0:
            assert r["read"] == []  # never read there, and the run still ended
            continue
        assert r["read"] == pytest.approx(expected, rel=1e-6, abs=1e-7)
    if not name.endswith("main_only"):
        assert runs[0]["read"] == runs[1]["read"]  # equal on every rank, bit for bit


def _gradient_bytes(record):
    return record["reduction_bytes"]


@pytest.mark.parametrize("name", [n for n in SCENARIOS if "_manual_" in n])
def test_manual_control_defers_where_told_and_equals_one_process(results, name):
    for r in results[name]:
        assert r["steps"] == 2  # 8 batches per rank, windows of 4
        worst = max(abs(a - b) for a, b in zip(r["params"], r["reference"]))
        assert worst <= 1e-5, worst
        off = [rec for rec in r["audit"] if not rec["boundary"]]
        on = [rec for rec in r["audit"] if rec["boundary"]]
        assert len(off) == 6 + (2 if name.endswith("backward_only") else 0)
        assert all(_gradient_bytes(rec) == 0 for rec in off), off
        if not name.endswith("plain"):  # a plain backward runs outside any micro-step
            assert len(on) == 2 and all(_gradient_bytes(rec) > 0 for rec in on), on
