"""Checkpoints across processes (backend "single"): a run that stops, or is stopped by SIGTERM,
resumes bitwise in a fresh process; a process killed during a save, or during a background
commit, leaves the previous checkpoint usable; a background save is committed when the
script ends without end()."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gradsync
from gradsync import CheckpointError
from gradsync.checkpoint import MANIFEST

from scenarios.checkpoints import fresh, trained

#: Each test starts its own processes and shares nothing with the others: xdist may run
#: them on either worker (tests/conftest.py).
INDEPENDENT_TESTS = True

TESTS = Path(__file__).resolve().parents[1]
SCRIPT = TESTS / "scripts" / "resume_train.py"


def run_script(out: Path, *args: str) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GRADSYNC_", "TORCHELASTIC_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))
    }
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--backend", "single", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]


def bitwise_equal(out: Path) -> None:
    ref = torch.load(out / "reference.pt", weights_only=True)
    final = torch.load(out / "final.pt", weights_only=True)
    assert ref.keys() == final.keys()
    assert all(torch.equal(ref[k], final[k]) for k in ref), {
        k: float((ref[k] - final[k]).abs().max()) for k in ref
    }


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mid_window_checkpoint_resumes_bitwise_in_a_fresh_process(tmp_path, workers):
    """Saved at micro-step 5 (2nd micro-step of the 2nd window), the process exits at 7; a
    fresh process resumes from the latest checkpoint. With workers, each batch draws noise
    from its worker's seed, which the resumed pass must draw again."""
    w = ["--workers", str(workers)]
    run_script(tmp_path, "--mode", "reference", *w)
    run_script(tmp_path, "--stop", "7", *w)
    assert gradsync.latest_checkpoint(tmp_path / "ckpt") == str(tmp_path / "ckpt" / "micro-0005")
    manifest = json.loads((tmp_path / "ckpt" / "micro-0005" / MANIFEST).read_text())
    assert manifest["window"]["index"] == 1  # mid-window
    assert manifest["loaders"] == [{"epoch": 0, "consumed": 5, "read": 6}]  # one read ahead
    run_script(tmp_path, *w)
    assert json.loads((tmp_path / "final_rank0.json").read_text())["resumed_from"].endswith(
        "micro-0005"
    )
    bitwise_equal(tmp_path)


def test_sigterm_saves_at_the_next_window_and_exits_cleanly(tmp_path):
    run_script(tmp_path, "--mode", "reference")
    run_script(tmp_path, "--sigterm-at", "6")  # mid-window 2: saved when window 3 starts
    saved = gradsync.latest_checkpoint(tmp_path / "ckpt")
    assert saved == str(tmp_path / "ckpt" / "step-2"), saved
    assert not (tmp_path / "final.pt").exists()  # it stopped there
    manifest = json.loads((Path(saved) / MANIFEST).read_text())
    assert manifest["window"]["index"] == 0 and manifest["optimizer_steps"] == 2
    run_script(tmp_path)
    bitwise_equal(tmp_path)


def test_a_kill_during_save_leaves_the_previous_checkpoint_usable(tmp_path, clean_env):
    code = f"""
import os, signal, sys
sys.path.insert(0, {str(TESTS)!r})
import gradsync.checkpoint.state as ck
from scenarios.checkpoints import trained
accel, *_ = trained(micro=4)
accel.save_state({str(tmp_path / "good")!r})
accel, *_ = trained(micro=8)
real, calls = ck.save_file, []
def dying(obj, path):
    calls.append(path)
    real(obj, path)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
ck.save_file = dying
import gradsync.backends._plain_state as plain
plain.save_file = dying
accel.save_state({str(tmp_path / "broken")!r})
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == -9, proc.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".broken.gradsync-tmp", "good"], names
    assert gradsync.latest_checkpoint(tmp_path) == str(tmp_path / "good")
    with pytest.raises(CheckpointError, match="is not a gradsync checkpoint"):
        fresh()[0].load_state(tmp_path / ".broken.gradsync-tmp")
    _accel, model, *_ = trained(micro=4)
    a2, m2, *_ = fresh()
    a2.load_state(tmp_path / "good")
    assert all(torch.equal(v, m2.state_dict()[k]) for k, v in model.state_dict().items())


def test_a_background_save_is_committed_when_the_script_ends_without_end(tmp_path, clean_env):
    code = f"""
import sys, time
sys.path.insert(0, {str(TESTS)!r})
import gradsync.storage.commit as ck
from scenarios.checkpoints import trained
real = ck.mark_and_rename
def slow(*args):
    time.sleep(0.5)
    real(*args)
ck.mark_and_rename = slow
accel, *_ = trained(micro=6)
accel.save_state({str(tmp_path / "last")!r}, background=True)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0 and "failed" not in proc.stderr, proc.stderr
    assert gradsync.latest_checkpoint(tmp_path) == str(tmp_path / "last")
    fresh()[0].load_state(tmp_path / "last")


def test_a_kill_during_a_background_commit_leaves_the_previous_checkpoint_usable(
    tmp_path, clean_env
):
    code = f"""
import os, signal, sys, threading, time
sys.path.insert(0, {str(TESTS)!r})
import gradsync.storage.commit as ck
from scenarios.checkpoints import trained
accel, *_ = trained(micro=4)
accel.save_state({str(tmp_path / "good")!r})
real, committing = ck.mark_and_rename, threading.Event()
def slow(*args):
    committing.set()
    time.sleep(30)
    real(*args)
ck.mark_and_rename = slow
accel, *_ = trained(micro=8)
accel.save_state({str(tmp_path / "pending")!r}, background=True)
assert committing.wait(300), "the background commit never started"
os.kill(os.getpid(), signal.SIGKILL)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == -9, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [".pending.gradsync-tmp", "good"]
    assert gradsync.latest_checkpoint(tmp_path) == str(tmp_path / "good")
    a2, *_ = fresh()
    a2.load_state(tmp_path / "good")
    a2.save_state(tmp_path / "pending", background=True)  # the leftover is replaced
    assert a2.wait_for_checkpoint() == str(tmp_path / "pending")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good", "pending"]
