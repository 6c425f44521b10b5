"""Scripts written for Accelerate (tests/accelerate_scripts/) run under Accelerate itself and
under ``gradsync launch`` with only their import lines respelled (``from accelerate`` ->
``from gradsync.accelerate``): each runs to its end and ends with Accelerate's parameters
(1e-5), on DDP and on FSDP2; resumed mid-epoch through Accelerate's load_state +
skip_first_batches pattern, or from automatically named checkpoints, each equals its
uninterrupted run. One launch per launcher and backend runs every script (run_all.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "accelerate_scripts"
BIN = Path(sys.executable).parent
FSDP = ["--use_fsdp", "--fsdp_version", "2"]
sys.path.insert(0, str(SCRIPTS))

from run_all import respell  # noqa: E402


def plan(out: Path, resume: bool) -> list[list[object]]:
    clm, cls, fb = SCRIPTS / "causal_lm.py", SCRIPTS / "classify.py", SCRIPTS / "find_batch.py"
    steps = [
        [str(clm), ["--out", str(out / "clm"), "--checkpointing_steps", "2"]],
        [str(cls), ["--out", str(out / "cls")]],
        [str(fb), ["--out", str(out / "fb")]],
        [str(SCRIPTS / "save_final.py"), ["--out", str(out / "save")]],
    ]
    last = [  # end_training() ends the process group (Accelerate's too): last in the launch
        [str(clm), ["--out", str(out / "clm-tb"), "--with_tracking"]],
    ]
    if resume:  # interrupted runs and their resumes, under gradsync only
        steps += [
            [str(clm), ["--out", str(out / "clm-cut"), "--checkpointing_steps", "2", "--stop_after", "2"]],
            [str(clm), ["--out", str(out / "clm-res2"), "--checkpointing_steps", "2",
                        "--resume_from_checkpoint", str(out / "clm-cut" / "step_2")]],
            # step_4 sits after an epoch with a partial window: the script's own arithmetic
            # asks to skip 3 batches where 2 were trained on; the checkpoint knows better
            [str(clm), ["--out", str(out / "clm-res4"), "--checkpointing_steps", "2",
                        "--resume_from_checkpoint", str(out / "clm" / "step_4")]],
            [str(cls), ["--out", str(out / "cls-cut"), "--stop_after_epoch", "0"]],
            [str(cls), ["--out", str(out / "cls-cut"), "--resume"]],
            # gradsync's own Accelerator on a schedule sized for Accelerate's rule: said once
            [str(clm), ["--out", str(out / "clm-core")], "core"],
        ]
    return steps + (last if resume else [])


def launch(tmp: Path, name: str, extra: list[str], gradsync: bool) -> Path:
    out = tmp / name
    for sub in ("clm", "clm-tb", "cls", "fb", "save", "clm-cut", "clm-res2", "clm-res4", "cls-cut",
                "clm-core"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan(out, resume=gradsync)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "GRADSYNC_DEVICE": "cpu",
           "TRANSFORMERS_VERBOSITY": "error"}
    cli = [str(BIN / "gradsync")] if gradsync else [str(BIN / "accelerate")]
    cmd = [*cli, "launch", "--num_processes", "2", *(extra or ["--multi_gpu"]),
           str(SCRIPTS / "run_all.py"), str(out / "plan.json"), *(["--gradsync"] if gradsync else [])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    (out / "log.txt").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{(done.stdout + done.stderr)[-4000:]}"
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("accelerate-scripts")
    accelerate = launch(tmp, "accelerate-ddp", [], gradsync=False)
    # On the CPU `accelerate launch --use_fsdp` trains with DDP (its FSDP needs a GPU): the
    # same run as the one above, so gradsync's FSDP2 run is compared with that one.
    return {
        "accelerate-ddp": accelerate,
        "gradsync-ddp": launch(tmp, "gradsync-ddp", [], gradsync=True),
        "accelerate-fsdp": accelerate,
        "gradsync-fsdp": launch(tmp, "gradsync-fsdp", FSDP, gradsync=True),
    }


def params(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "final.pt")


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= tol, worst


def test_only_import_lines_are_respelled() -> None:
    for script in ("causal_lm.py", "classify.py", "find_batch.py", "save_final.py"):
        before = (SCRIPTS / script).read_text().splitlines()
        after = respell("\n".join(before)).splitlines()
        changed = [(x, y) for x, y in zip(before, after) if x != y]
        assert changed and all(x.lstrip().startswith(("from accelerate", "import accelerate"))
                               for x, _ in changed)


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
@pytest.mark.parametrize("script", ["clm", "cls", "fb", "save"])
def test_a_script_ends_with_accelerates_parameters(runs: dict[str, Path], backend: str, script: str) -> None:
    theirs, ours = runs[f"accelerate-{backend}"] / script, runs[f"gradsync-{backend}"] / script
    assert_close(params(theirs), params(ours))
    if script == "save":  # what save_pretrained wrote is what trained, under either
        for folder in (theirs, ours):
            assert json.loads((folder / "final.json").read_text())["reloaded"] == {
                "plain": 0.0, "with_state_dict": 0.0}
        return
    assert json.loads((theirs / "final.json").read_text()) == json.loads((ours / "final.json").read_text())


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
@pytest.mark.parametrize("resumed", ["clm-res2", "clm-res4"])
def test_a_resume_through_skip_first_batches_equals_the_uninterrupted_run(
        runs: dict[str, Path], backend: str, resumed: str) -> None:
    run = runs[f"gradsync-{backend}"]
    assert_close(params(run / "clm"), params(run / resumed), tol=0.0)
    log = (run / "log.txt").read_text()
    if resumed == "clm-res4":  # one line for the run, not one per rank
        assert log.count("skip_first_batches(3) after load_state: the checkpoint was saved after batch 2") == 1


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_automatic_checkpoint_naming_resumes_and_keeps_total_limit(runs: dict[str, Path], backend: str) -> None:
    run = runs[f"gradsync-{backend}"]
    assert_close(params(run / "cls"), params(run / "cls-cut"), tol=0.0)
    whole = json.loads((run / "cls" / "final.json").read_text())
    assert whole["checkpoints"] == ["checkpoint_1", "checkpoint_2"]  # total_limit=2 of 0, 1, 2
    resumed = json.loads((run / "cls-cut" / "final.json").read_text())
    assert resumed["checkpoints"] == whole["checkpoints"]
    assert resumed["accuracies"] == whole["accuracies"][1:]


def test_the_tracked_run_and_the_retried_batch_size(runs: dict[str, Path]) -> None:
    for backend in ("ddp", "fsdp"):
        run = runs[f"gradsync-{backend}"]
        assert json.loads((run / "fb" / "final.json").read_text())["tried"] == [32, 28, 25, 22, 19, 17, 15, 13, 11, 9, 8]
        assert list((run / "clm-tb").glob("**/events.out.tfevents.*"))
        assert_close(params(run / "clm"), params(run / "clm-tb"), tol=0.0)


def test_gradsyncs_own_accelerator_says_when_a_schedule_was_sized_for_accelerates_rule(
        runs: dict[str, Path]) -> None:
    log = (runs["gradsync-ddp"] / "log.txt").read_text()
    said = [line for line in log.splitlines() if "sized for Accelerate's rule" in line]
    assert len(said) == 1, said  # once, on the main process, when the run ended
    assert "the run ended after 6 optimizer steps" in said[0] and "built for 10 steps" in said[0]
    final = json.loads((runs["gradsync-ddp"] / "clm-core" / "final.json").read_text())
    assert final["lr"] > 0  # the schedule stopped halfway: what the warning is about
