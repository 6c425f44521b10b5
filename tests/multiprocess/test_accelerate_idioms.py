"""Accelerate idioms where the two libraries meet, each run under Accelerate itself and under
``gradsync launch`` (DDP, 2 gloo ranks) with only its import lines respelled, in one launch
per group of scripts and library (tests/accelerate_scripts/run_all.py): the idioms in one,
the communication hooks in another:

* cross-validation (``cross_validation.py``, Accelerate's by_feature/cross_validation.py
  pattern): a prepared validation loader per fold, whose last batch ``gather_for_metrics``
  trims, then a test loader that is never prepared, whose rows it must return whole (every
  process predicts every test sample), with folds of unequal (16, 16, 15) and of equal (15)
  sizes: the gathered rows are Accelerate's, fold by fold;
* LocalSGD (``local_sgd.py``, by_feature/local_sgd.py's pattern) with gradsync's self-check
  on: ``gradsync.accelerate.local_sgd.LocalSGD`` (the respelled import), and Accelerate's own
  ``accelerate.local_sgd.LocalSGD`` over ``gradsync.accelerate.Accelerator``: both train to
  Accelerate's parameters and the self-check, which watches the run, says nothing;
* DDP communication hooks (``ddp_comm_hook.py``, by_feature/ddp_comm_hook.py's pattern):
  ``DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=..., comm_state_option=...)``
  with each ``DDPCommunicationHookType`` that runs on gloo (bf16 needs NCCL under both:
  refused here in one line), PowerSGD compressing from the third step: each ends with
  Accelerate's parameters, and the compressing ones away from the uncompressed run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from harness.cluster import free_port

pytest.importorskip("accelerate")

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "accelerate_scripts"
BIN = Path(sys.executable).parent
TOL = 1e-5
POWER = '{"start_powerSGD_iter": 2, "matrix_approximation_rank": 1}'
#: A hook's run against Accelerate's (measured: equal bit for bit): well under what fp16
#: moves the parameters (1.3e-5), so a hook left out would show.
HOOK_TOL = 1e-6

#: group -> name -> (script, its arguments); one launch per group and library
GROUPS: dict[str, dict[str, tuple[str, list[str]]]] = {
    "idioms": {
        "cv-unequal": ("cross_validation.py", ["--train_samples", "47"]),
        "cv-equal": ("cross_validation.py", ["--train_samples", "45"]),
        "sgd": ("local_sgd.py", []),
        "sgd-accelerates-class": ("local_sgd.py", ["--local_sgd_from", "accelerate"]),
    },
    "hooks": {
        f"hook-{name}": ("ddp_comm_hook.py", flags)
        for name, flags in {
            "no": [],
            "fp16": ["--ddp_comm_hook", "fp16"],
            "power_sgd": ["--ddp_comm_hook", "power_sgd", "--comm_state_option", POWER],
            "power_sgd-fp16": [
                "--ddp_comm_hook",
                "power_sgd",
                "--ddp_comm_wrapper",
                "fp16",
                "--comm_state_option",
                POWER,
            ],
            # torch's own options (PowerSGD from step 1000): plain all-reduces in this run
            "batched_power_sgd": ["--ddp_comm_hook", "batched_power_sgd"],
        }.items()
    },
}
HOOKS = sorted(GROUPS["hooks"])
GROUP_OF = {name: group for group, runs in GROUPS.items() for name in runs}


def launch(out: Path, runs: dict[str, tuple[str, list[str]]], gradsync: bool) -> Path:
    plan = []
    for name, (script, args) in runs.items():
        (out / name).mkdir(parents=True)
        plan.append([str(SCRIPTS / script), ["--out", str(out / name), *args]])
    (out / "plan.json").write_text(json.dumps(plan))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "ACCELERATE_USE_CPU": "1",
        "GRADSYNC_DEVICE": "cpu",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])
        ),
    }
    port = ["--main_process_port", str(free_port())]
    cmd = [
        str(BIN / ("gradsync" if gradsync else "accelerate")),
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        *([] if gradsync else port),
        str(SCRIPTS / "run_all.py"),
        str(out / "plan.json"),
        *(["--gradsync"] if gradsync else []),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    (out / "log.txt").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{(done.stdout + done.stderr)[-4000:]}"
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """(group, library) -> the folder of that group's launch under that library (launched
    at the first test that asks for it)."""
    tmp = tmp_path_factory.mktemp("accelerate-idioms")
    done: dict[tuple[str, str], Path | AssertionError] = {}

    def get(group: str, library: str) -> Path:
        if (group, library) not in done:
            out = tmp / group / library
            try:
                done[group, library] = launch(out, GROUPS[group], gradsync=library == "gradsync")
            except AssertionError as failed:  # said again to every test that needs it
                done[group, library] = failed
        found = done[group, library]
        if isinstance(found, AssertionError):
            raise found
        return found

    return get


def results(folder: Path) -> dict:
    return json.loads((folder / "final.json").read_text())


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("name, sizes", [("cv-unequal", [16, 16, 15]), ("cv-equal", [15, 15, 15])])
def test_an_unprepared_test_loader_is_gathered_whole_after_each_fold(runs, name, sizes):
    theirs = results(runs(GROUP_OF[name], "accelerate") / name)
    ours = results(runs(GROUP_OF[name], "gradsync") / name)
    assert ours == theirs  # the same rows, fold by fold, and the same accuracy
    start = 0
    for fold, size in enumerate(sizes):
        # the prepared validation loader: each sample once, its last round's padding trimmed
        assert ours["eval_ids"][fold] == list(range(start, start + size))
        start += size
        # the test loader nobody prepared: both processes' 13 rows of every batch, untrimmed
        test = list(range(sum(sizes), sum(sizes) + 13))
        per_batch = [test[i : i + 4] for i in range(0, 13, 4)]
        assert ours["test_ids"][fold] == [i for batch in per_batch for i in batch * 2]


@pytest.mark.parametrize("name", ["cv-unequal", "cv-equal"])
def test_each_fold_trains_to_accelerates_parameters(runs, name):
    theirs = torch.load(runs(GROUP_OF[name], "accelerate") / name / "final.pt", weights_only=True)
    ours = torch.load(runs(GROUP_OF[name], "gradsync") / name / "final.pt", weights_only=True)
    for a, b in zip(theirs["folds"], ours["folds"], strict=True):
        assert worst(a["params"], b["params"]) <= TOL
    assert (theirs["averaged"] - ours["averaged"]).abs().max().item() <= TOL


@pytest.mark.parametrize("name", ["sgd", "sgd-accelerates-class"])
def test_local_sgd_trains_as_under_accelerate_and_the_self_check_stays_quiet(runs, name):
    accelerate, gradsync = runs(GROUP_OF[name], "accelerate"), runs(GROUP_OF[name], "gradsync")
    theirs, ours = results(accelerate / name), results(gradsync / name)
    assert ours["accuracies"] == theirs["accuracies"]
    assert ours["ranks_agree"] and theirs["ranks_agree"]  # averaged when each block ended
    assert ours["self_check"] is True and theirs["self_check"] is None  # watched under gradsync
    a = torch.load(accelerate / name / "final.pt", weights_only=True)
    b = torch.load(gradsync / name / "final.pt", weights_only=True)
    assert worst(a, b) <= TOL
    log = (gradsync / "log.txt").read_text()  # the launch's: every idiom's run stays quiet
    assert "gradsync self-check" not in log, log[-3000:]


@pytest.mark.parametrize("name", HOOKS)
def test_each_ddp_communication_hook_trains_to_accelerates_parameters(runs, name):
    theirs = torch.load(runs("hooks", "accelerate") / name / "final.pt", weights_only=True)
    ours = torch.load(runs("hooks", "gradsync") / name / "final.pt", weights_only=True)
    assert worst(theirs, ours) <= HOOK_TOL
    mine, accelerates = (
        results(runs("hooks", "gradsync") / name),
        results(runs("hooks", "accelerate") / name),
    )
    assert mine["accuracies"] == accelerates["accuracies"]
    assert mine["last_loss"] == pytest.approx(accelerates["last_loss"], abs=HOOK_TOL)
    if name in ("hook-fp16", "hook-power_sgd", "hook-power_sgd-fp16"):  # it really compressed
        plain = torch.load(runs("hooks", "gradsync") / "hook-no" / "final.pt", weights_only=True)
        assert worst(plain, ours) > 10 * HOOK_TOL  # measured 1.3e-5 (fp16), 2.2e-3 (PowerSGD)
