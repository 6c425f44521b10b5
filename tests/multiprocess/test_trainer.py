"""Transformers' ``Trainer`` (tests/accelerate_scripts/trainer_clm.py: a GPT-2 from a config,
``gradient_accumulation_steps=4``, 2 ranks, an evaluation and a checkpoint every 3 steps)
under Accelerate itself (``accelerate launch --multi_gpu``) and under ``gradsync launch`` on
DDP and FSDP2, with ``Trainer`` and ``TrainingArguments`` imported from
``gradsync.accelerate.trainer`` (run_all.py's ``respell_trainer``), nothing else changed.

Each launch trains the whole run, then resumes from its own mid-epoch ``checkpoint-3`` in a
second run; on DDP each library also resumes the other's ``checkpoint-3``. Compared with Accelerate's: the final parameters, every logged loss, grad norm,
learning rate and evaluation loss, the final evaluation; each resume with its uninterrupted
run. On the CPU Accelerate's FSDP trains with DDP, so gradsync's FSDP2 is compared with that.
gradsync's audit shows the Trainer's windows: one gradient sync each, at its last micro-step;
``gradsync verify`` replays them in one process (k x N micro-batches a window).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "accelerate_scripts"
SCRIPT = SCRIPTS / "trainer_clm.py"
BIN = Path(sys.executable).parent
FSDP = ["--use_fsdp", "--fsdp_version", "2"]
#: 52 samples on 2 ranks, 2 a batch: 13 micro-batches an epoch, windows of 4, 4, 4 and 1
STEPS = 8
#: how far gradsync's FSDP2 may end from Accelerate's DDP (the reduce-scatter sums in
#: another order); DDP must be exact
FSDP_TOL = 1e-5
sys.path.insert(0, str(SCRIPTS))

from run_all import respell_trainer  # noqa: E402

from harness.cluster import free_port  # noqa: E402
from harness.verify import table  # noqa: E402


def resume(out: Path, checkpoint: Path) -> list[object]:
    return [str(SCRIPT), ["--out", str(out), "--resume_from_checkpoint", str(checkpoint)]]


def launch(
    tmp: Path,
    name: str,
    extra: list[str],
    gradsync: bool,
    crossed: Path | None = None,
    processes: int = 2,
    plan: list[list[object]] | None = None,
) -> Path:
    """The whole run and its resume from ``checkpoint-3``; with ``crossed``, only a resume
    from that (the other library's) checkpoint; or the ``plan`` given."""
    out = tmp / name
    full = out / "full"
    if plan is None:
        plan = [[str(SCRIPT), ["--out", str(full)]], resume(out / "resumed", full / "checkpoint-3")]
    if crossed is not None:
        plan = [resume(out / "crossed", crossed)]
    out.mkdir(parents=True)
    (out / "plan.json").write_text(json.dumps(plan))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "ACCELERATE_USE_CPU": "1",
        "GRADSYNC_DEVICE": "cpu",
        "TRANSFORMERS_VERBOSITY": "error",
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])
        ),
    }
    cli = [str(BIN / "gradsync")] if gradsync else [str(BIN / "accelerate")]
    cmd = [
        *cli,
        "launch",
        "--main_process_port",
        str(free_port()),
        "--num_processes",
        str(processes),
        *(extra or ["--multi_gpu"]),
        str(SCRIPTS / "run_all.py"),
        str(out / "plan.json"),
        *(["--gradsync"] if gradsync else []),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    (out / "log.txt").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{(done.stdout + done.stderr)[-4000:]}"
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("trainer")
    accelerate = launch(tmp, "accelerate", [], gradsync=False)
    ddp = launch(tmp, "ddp", ["--multi_gpu", "--audit"], gradsync=True)
    crossed = accelerate / "full" / "checkpoint-3"
    return {
        "accelerate": accelerate,
        "ddp": ddp,
        "fsdp": launch(tmp, "fsdp", [*FSDP, "--audit"], gradsync=True),
        # each library resumes the other's DDP checkpoint
        "ddp-from-accelerate": launch(tmp, "ddp-x", [], gradsync=True, crossed=crossed),
        "accelerate-from-ddp": launch(
            tmp, "accelerate-x", [], gradsync=False, crossed=ddp / "full" / "checkpoint-3"
        ),
    }


def params(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "final.pt")


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def logged(folder: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The logged history and the final evaluation, without what the clock measured."""
    found = json.loads((folder / "final.json").read_text())

    def timeless(entry: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in entry.items() if "runtime" not in k and "per_second" not in k}

    return [timeless(e) for e in found["history"]], timeless(found["final_eval"])


def test_only_the_trainer_import_is_respelled() -> None:
    before = SCRIPT.read_text()
    after = respell_trainer(before)
    assert set(after.splitlines()) - set(before.splitlines()) == {
        "from transformers import GPT2Config, GPT2LMHeadModel",
        "from gradsync.accelerate.trainer import Trainer, TrainingArguments",
    }
    assert len(after.splitlines()) == len(before.splitlines()) + 1


@pytest.mark.parametrize("part", ["full", "resumed"])
def test_ddp_equals_accelerate_exactly(runs: dict[str, Path], part: str) -> None:
    theirs, ours = runs["accelerate"] / part, runs["ddp"] / part
    assert worst(params(theirs), params(ours)) == 0.0
    assert logged(theirs) == logged(ours)


@pytest.mark.parametrize("part", ["full", "resumed"])
def test_fsdp2_equals_accelerate(runs: dict[str, Path], part: str) -> None:
    theirs, ours = runs["accelerate"] / part, runs["fsdp"] / part
    assert worst(params(theirs), params(ours)) <= FSDP_TOL
    (history_a, eval_a), (history_b, eval_b) = logged(theirs), logged(ours)
    assert [sorted(e) for e in history_a] == [sorted(e) for e in history_b]
    for a, b in [*zip(history_a, history_b), (eval_a, eval_b)]:
        assert a == pytest.approx(b, rel=FSDP_TOL), (a, b)


@pytest.mark.parametrize("run", ["ddp-from-accelerate", "accelerate-from-ddp"])
def test_a_ddp_checkpoint_resumes_under_the_other_library_exactly(
    runs: dict[str, Path], run: str
) -> None:
    ours, theirs = runs[run] / "crossed", runs["accelerate"] / "resumed"
    assert worst(params(theirs), params(ours)) == 0.0
    assert logged(theirs) == logged(ours)


def test_every_run_logs_every_step_and_evaluates(runs: dict[str, Path]) -> None:
    for run in (runs[name] for name in ("accelerate", "ddp", "fsdp")):
        history, final = logged(run / "full")
        assert [e["step"] for e in history if "loss" in e] == list(range(1, STEPS + 1))
        # every 3 steps, at the end of training, and the script's own evaluate()
        assert [e["step"] for e in history if "eval_loss" in e] == [3, 6, 8, 8]
        assert all(e["grad_norm"] > 0 for e in history if "loss" in e)
        assert final["eval_loss"] > 0
        resumed, _ = logged(run / "resumed")
        # the checkpoint's history (steps 1 to 3), then the steps trained after resuming
        assert [e["step"] for e in resumed if "loss" in e] == list(range(1, STEPS + 1))


@pytest.mark.parametrize("run", ["accelerate", "ddp", "fsdp"])
def test_a_resume_from_the_mid_epoch_checkpoint_equals_the_uninterrupted_run(
    runs: dict[str, Path], run: str
) -> None:
    assert worst(params(runs[run] / "full"), params(runs[run] / "resumed")) == 0.0


AUDIT = re.compile(
    r"\[gradsync audit\] rank 0 step \d+ \((\w+), (\w+)\): .*per micro-step \[([\d,]+)\]"
)


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_the_audit_sees_one_gradient_sync_per_trainer_window(
    runs: dict[str, Path], backend: str
) -> None:
    lines = AUDIT.findall((runs[backend] / "log.txt").read_text())
    windows = [[int(n) for n in counts.split(",")] for _, _, counts in lines]
    # the whole run's windows, then the resumed run's (from checkpoint-3, mid-epoch)
    sizes = [4, 4, 4, 1] * 2 + [1] + [4, 4, 4, 1]
    assert [len(w) for w in windows] == sizes
    assert all(w[-1] > 0 and not any(w[:-1]) for w in windows), windows
    assert {(b, policy) for b, policy, _ in lines} == {(backend, "defer")}


def test_gradsync_verify_replays_the_trainers_windows(
    run_verify: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADSYNC_DEVICE", "cpu")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    script = tmp_path / "trainer_clm.py"
    script.write_text(respell_trainer(SCRIPT.read_text()))
    words = ["--nproc-per-node", "2", "--backend", "fsdp", "--start-method", "fork"]
    code, out = run_verify(*words, "--steps", "3", script, "--out", tmp_path / "out")
    assert code == 0, out
    assert "k=4 per process, 8 micro-batches per window" in out
    rows = table(out)
    assert [r[0] for r in rows] == ["1", "2", "3"], out
    assert all(r[-1] == "ok" and r[5] == "0" for r in rows), out  # nothing reduced off it


BY_GROUP = re.compile(r"by group: shard \[([\d,]+)\] .*replicate \[([\d,]+)\]")


def test_hsdp_defers_only_the_replica_all_reduce_of_a_trainer_window(tmp_path: Path) -> None:
    """4 ranks, 2 replicas x 2 shards, ``defer_replicate``: the Trainer's micro-batches
    reduce-scatter inside their shard group every micro-step, and the replicas all-reduce
    once per window, at its last micro-step."""
    out = tmp_path / "hsdp"
    plan: list[list[object]] = [[str(SCRIPT), ["--out", str(out / "run"), "--max_steps", "2"]]]
    policy = ["--fsdp-mesh", "2,2", "--sync-policy", "defer_replicate", "--audit"]
    run = launch(tmp_path, "hsdp", [*FSDP, *policy], gradsync=True, processes=4, plan=plan)
    windows = [
        ([int(n) for n in shard.split(",")], [int(n) for n in replicate.split(",")])
        for shard, replicate in BY_GROUP.findall((run / "log.txt").read_text())
    ]
    assert [len(shard) for shard, _ in windows] == [4, 3], windows  # 7 micro-batches a rank
    for shard, replicate in windows:
        assert all(shard) and replicate[-1] > 0 and not any(replicate[:-1]), windows
