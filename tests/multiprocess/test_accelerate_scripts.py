"""Scripts written for Accelerate (tests/accelerate_scripts/) run under Accelerate itself and
under ``gradsync launch`` with only their import lines respelled (``from accelerate`` ->
``from gradsync.accelerate``): each runs to its end and ends with Accelerate's parameters
(1e-5), on DDP and on FSDP2; resumed mid-epoch through Accelerate's load_state +
skip_first_batches pattern, or from automatically named checkpoints, each equals its
uninterrupted run. One launch per launcher and backend runs every script (run_all.py).

The same launches run an Accelerate user's script (``tests/scripts/accelerate_style.py``) on
gradsync's own ``Accelerator`` with one import changed (``PARITY_LIBRARY``), which ends where
it ends under Accelerate itself: under Accelerate (MULTI_CPU: DDP) and under ``gradsync
launch`` with DDP; gradsync's FSDP2 against its DDP (Accelerate runs FSDP only on
accelerators), and, in one more launch, DeepSpeed ZeRO 2 against DDP on the script's
one-model variant (``--merged``: one engine holds one model). Compared: the final parameters
(``get_state_dict``), the evaluation outputs gathered with ``gather_for_metrics`` (tensors and
strings), the values of ``reduce(..., reduction="mean")``, the losses logged to TensorBoard.

The evaluation loader uses the training loader's batch size (4): gradsync refuses a second
loader with another one (``test_an_evaluation_loader_may_have_its_own_batch_size``). With 11
evaluation samples the last batch is padded on both libraries, then dropped by
``gather_for_metrics``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("tensorboard")

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "accelerate_scripts"
BIN = Path(sys.executable).parent
FSDP = ["--use_fsdp", "--fsdp_version", "2"]
PARITY = REPO / "tests" / "scripts" / "accelerate_style.py"
PARITY_ARGS = ["--eval-batch-size", "4"]
TOL = 1e-5
EVAL_SAMPLES = 11
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
    steps += [  # the Accelerate user's script, its library chosen by PARITY_LIBRARY
        [str(PARITY), [str(out / "parity"), *PARITY_ARGS]],
        [str(PARITY), [str(out / "parity-merged"), *PARITY_ARGS, "--merged"]],
    ]
    last = [  # end_training() ends the process group (Accelerate's too): last in the launch
        [str(clm), ["--out", str(out / "clm-tb"), "--with_tracking"]],
    ]
    if resume:  # interrupted runs and their resumes, under gradsync only
        steps += [
            [
                str(clm),
                ["--out", str(out / "clm-cut"), "--checkpointing_steps", "2", "--stop_after", "2"],
            ],
            [
                str(clm),
                [
                    "--out",
                    str(out / "clm-res2"),
                    "--checkpointing_steps",
                    "2",
                    "--resume_from_checkpoint",
                    str(out / "clm-cut" / "step_2"),
                ],
            ],
            # step_4 sits after an epoch with a partial window: the script's own arithmetic
            # asks to skip 3 batches where 2 were trained on; the checkpoint knows better
            [
                str(clm),
                [
                    "--out",
                    str(out / "clm-res4"),
                    "--checkpointing_steps",
                    "2",
                    "--resume_from_checkpoint",
                    str(out / "clm" / "step_4"),
                ],
            ],
            [str(cls), ["--out", str(out / "cls-cut"), "--stop_after_epoch", "0"]],
            [str(cls), ["--out", str(out / "cls-cut"), "--resume"]],
            # gradsync's own Accelerator on a schedule sized for Accelerate's rule: said once
            [str(clm), ["--out", str(out / "clm-core")], "core"],
        ]
    return steps + (last if resume else [])


def launch(tmp: Path, name: str, extra: list[str], gradsync: bool) -> Path:
    out = tmp / name
    for sub in (
        "clm",
        "clm-tb",
        "cls",
        "fb",
        "save",
        "clm-cut",
        "clm-res2",
        "clm-res4",
        "cls-cut",
        "clm-core",
        "parity",
        "parity-merged",
    ):
        (out / sub).mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan(out, resume=gradsync)))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "ACCELERATE_USE_CPU": "1",
        "GRADSYNC_DEVICE": "cpu",
        "TRANSFORMERS_VERBOSITY": "error",
        "DS_ACCELERATOR": "cpu",
        "PARITY_LIBRARY": "gradsync" if gradsync else "accelerate",
    }
    cli = [str(BIN / "gradsync")] if gradsync else [str(BIN / "accelerate")]
    cmd = [
        *cli,
        "launch",
        "--num_processes",
        "2",
        *(extra or ["--multi_gpu"]),
        str(SCRIPTS / "run_all.py"),
        str(out / "plan.json"),
        *(["--gradsync"] if gradsync else []),
    ]
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


def launch_zero2_merged(out: Path) -> Path:
    """The parity script's one-model variant under ``gradsync launch`` with DeepSpeed ZeRO 2."""
    out.mkdir(parents=True)
    outside = (
        "GRADSYNC_",
        "ACCELERATE_",
        "PET_",
        "SLURM_",
        "PMI_",
        "OMPI_",
        "MV2_",
        "TORCHELASTIC_",
    )
    torchrun = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(outside) and k not in torchrun}
    env.update({"OMP_NUM_THREADS": "1", "PARITY_LIBRARY": "gradsync", "DS_ACCELERATOR": "cpu"})
    cmd = [
        sys.executable,
        "-m",
        "gradsync",
        "launch",
        "--nproc-per-node",
        "2",
        "--backend",
        "deepspeed",
        "--zero-stage",
        "2",
        str(PARITY),
        str(out),
        *PARITY_ARGS,
        "--merged",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return out


@pytest.fixture(scope="module")
def parity(
    runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    folders = {
        "accelerate": runs["accelerate-ddp"] / "parity",
        "ddp": runs["gradsync-ddp"] / "parity",
        "fsdp": runs["gradsync-fsdp"] / "parity",
        "ddp_merged": runs["gradsync-ddp"] / "parity-merged",
        "zero2_merged": launch_zero2_merged(tmp_path_factory.mktemp("parity") / "zero2_merged"),
    }
    out = {}
    for name, folder in folders.items():
        out[name] = torch.load(folder / "result.pt", weights_only=True)
        out[name]["folder"] = folder
    return out


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
        assert changed and all(
            x.lstrip().startswith(("from accelerate", "import accelerate")) for x, _ in changed
        )


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
@pytest.mark.parametrize("script", ["clm", "cls", "fb", "save"])
def test_a_script_ends_with_accelerates_parameters(
    runs: dict[str, Path], backend: str, script: str
) -> None:
    theirs, ours = runs[f"accelerate-{backend}"] / script, runs[f"gradsync-{backend}"] / script
    assert_close(params(theirs), params(ours))
    if script == "save":  # what save_pretrained wrote is what trained, under either
        for folder in (theirs, ours):
            assert json.loads((folder / "final.json").read_text())["reloaded"] == {
                "plain": 0.0,
                "with_state_dict": 0.0,
            }
        return
    assert json.loads((theirs / "final.json").read_text()) == json.loads(
        (ours / "final.json").read_text()
    )


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
@pytest.mark.parametrize("resumed", ["clm-res2", "clm-res4"])
def test_a_resume_through_skip_first_batches_equals_the_uninterrupted_run(
    runs: dict[str, Path], backend: str, resumed: str
) -> None:
    run = runs[f"gradsync-{backend}"]
    assert_close(params(run / "clm"), params(run / resumed), tol=0.0)
    log = (run / "log.txt").read_text()
    if resumed == "clm-res4":  # one line for the run, not one per rank
        assert (
            log.count(
                "skip_first_batches(3) after load_state: the checkpoint was saved after batch 2"
            )
            == 1
        )


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_automatic_checkpoint_naming_resumes_and_keeps_total_limit(
    runs: dict[str, Path], backend: str
) -> None:
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
        assert json.loads((run / "fb" / "final.json").read_text())["tried"] == [
            32,
            28,
            25,
            22,
            19,
            17,
            15,
            13,
            11,
            9,
            8,
        ]
        assert list((run / "clm-tb").glob("**/events.out.tfevents.*"))
        assert_close(params(run / "clm"), params(run / "clm-tb"), tol=0.0)


def test_gradsyncs_own_accelerator_says_when_a_schedule_was_sized_for_accelerates_rule(
    runs: dict[str, Path],
) -> None:
    log = (runs["gradsync-ddp"] / "log.txt").read_text()
    said = [line for line in log.splitlines() if "sized for Accelerate's rule" in line]
    assert len(said) == 1, said  # once, on the main process, when the run ended
    assert "the run ended after 6 optimizer steps" in said[0] and "built for 10 steps" in said[0]
    final = json.loads((runs["gradsync-ddp"] / "clm-core" / "final.json").read_text())
    assert final["lr"] > 0  # the schedule stopped halfway: what the warning is about


def _max_param_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert sorted(a["params"]) == sorted(b["params"])
    worst = 0.0
    for name, value in a["params"].items():
        other = b["params"][name]
        assert value.shape == other.shape, name
        worst = max(worst, (value.float() - other.float()).abs().max().item())
    return worst


def _logged(folder: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list((folder / "logs" / "parity").glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # the main process's only
    events = EventAccumulator(str(files[0].parent))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("train_loss")]


PAIRS = [("accelerate", "ddp"), ("ddp", "fsdp"), ("ddp_merged", "zero2_merged")]


def test_each_run_is_two_processes_with_its_backend(parity):
    wrapped = {name: set(r["wrapped"].values()) for name, r in parity.items()}
    assert (
        wrapped["accelerate"]
        == wrapped["ddp"]
        == wrapped["ddp_merged"]
        == {"DistributedDataParallel"}
    )
    assert all(w.startswith("FSDP") for w in wrapped["fsdp"]), wrapped[
        "fsdp"
    ]  # fully_shard's classes
    assert wrapped["zero2_merged"] == {"DeepSpeedEngine"}
    for r in parity.values():
        assert r["num_processes"] == 2
        assert r["optimizer_steps"] == 6  # 96 samples / (4 x 4 x 2), two epochs


@pytest.mark.parametrize("first, second", PAIRS)
def test_the_final_parameters_are_the_same(parity, first, second):
    worst = _max_param_diff(parity[first], parity[second])
    assert worst <= TOL, worst


@pytest.mark.parametrize("first, second", PAIRS)
def test_gather_for_metrics_gives_the_same_outputs_once_per_sample(parity, first, second):
    a, b = parity[first], parity[second]
    assert a["names"] == b["names"]
    assert len(a["names"]) == EVAL_SAMPLES  # the padded samples dropped
    assert [n.split(":")[0] for n in a["names"]] == [f"sample{i}" for i in range(EVAL_SAMPLES)]
    assert torch.equal(a["preds"], b["preds"])
    assert [n.split(":")[1] for n in a["names"]] == [f"class{int(p)}" for p in a["preds"]]
    assert a["logits"].shape == b["logits"].shape == (EVAL_SAMPLES, 3)
    assert (a["logits"] - b["logits"]).abs().max().item() <= TOL


@pytest.mark.parametrize("first, second", PAIRS)
def test_reduce_and_the_logged_losses_are_the_same(parity, first, second):
    a, b = parity[first], parity[second]
    assert a["rank_mean"].tolist() == b["rank_mean"].tolist() == [0.5]
    assert len(a["logged"]) == len(b["logged"]) == 6
    assert a["logged"] == pytest.approx(b["logged"], abs=TOL)
    read_a, read_b = _logged(a["folder"]), _logged(b["folder"])
    assert [s for s, _ in read_a] == [s for s, _ in read_b] == [1, 2, 3, 4, 5, 6]  # step=
    assert [v for _, v in read_a] == pytest.approx(a["logged"], rel=1e-6)
    assert [v for _, v in read_b] == pytest.approx(b["logged"], rel=1e-6)


def test_the_gradsync_backends_agree_on_the_evaluation_sums(parity):
    # each rank's (summed loss, samples), averaged by reduce(reduction="mean")
    for first, second in PAIRS[1:]:
        assert parity[first]["reduced"].tolist() == pytest.approx(
            parity[second]["reduced"].tolist(), abs=TOL
        )


def test_what_differs_from_accelerate(parity):
    """The two differences this script shows; the parameters and gathered outputs are equal.

    * Padding of the evaluation shards: Accelerate pads every process's last batch to the full
      batch size (11 samples, batch 4: 16 rows seen, 8 per process); gradsync's sampler pads
      only to an equal number of samples (12 rows, 6 per process). ``gather_for_metrics``
      drops both paddings; a per-process sum passed to ``reduce`` sees them.
    * The scheduler: Accelerate steps it once per process per optimizer step (its
      ``split_batches=False`` convention), gradsync once per optimizer step.
    """
    acc, gs = parity["accelerate"], parity["ddp"]
    assert acc["reduced"][1].item() == 8.0 and gs["reduced"][1].item() == 6.0
    assert acc["scheduler_last_epoch"] == 2 * 6 and gs["scheduler_last_epoch"] == 6


def test_an_evaluation_loader_may_have_its_own_batch_size(clean_env):
    from torch.utils.data import DataLoader

    from gradsync import Accelerator

    accel = Accelerator(backend="single", gradient_accumulation_steps=4)
    model = torch.nn.Linear(2, 2)
    train = DataLoader(torch.arange(16.0).view(8, 2), batch_size=4)
    evaluation = DataLoader(torch.arange(16.0).view(8, 2), batch_size=2)
    try:
        model, train, evaluation = accel.prepare(model, train, evaluation)
        assert [len(b) for b in evaluation] == [2, 2, 2, 2]
    finally:
        accel.end()
