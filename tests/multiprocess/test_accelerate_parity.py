"""An Accelerate user's script (``tests/scripts/accelerate_style.py``) runs on gradsync with
one import changed and ends where it ends under Accelerate itself.

Five launches of 2 CPU ranks (gloo): the script under Accelerate (torchrun, MULTI_CPU: DDP)
and under ``gradsync launch`` with DDP; then gradsync's FSDP2 against its DDP (Accelerate runs
FSDP only on accelerators), and DeepSpeed ZeRO 2 against DDP on the script's one-model
variant (``--merged``: one engine holds one model). Compared: the final parameters
(``get_state_dict``), the evaluation outputs gathered with ``gather_for_metrics`` (tensors and
strings), the values of ``reduce(..., reduction="mean")``, the losses logged to TensorBoard.

The evaluation loader uses the training loader's batch size (4): gradsync refuses a second
loader with another one (``test_an_evaluation_loader_may_have_its_own_batch_size``). With 11
evaluation samples the last batch is padded on both libraries, then dropped by
``gather_for_metrics``.

``accelerate launch --num_processes 2 --cpu`` starts ONE process (Accelerate starts several
CPU processes only through mpirun, with ``--mpirun_hostfile``); torchrun with
``ACCELERATE_USE_CPU=1`` gives Accelerate its MULTI_CPU state with 2 processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("tensorboard")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "accelerate_style.py"
ARGS = ("--eval-batch-size", "4")
TOL = 1e-5
EVAL_SAMPLES = 11

_OUTSIDE = ("GRADSYNC_", "ACCELERATE_", "PET_", "SLURM_", "PMI_", "OMPI_", "MV2_", "TORCHELASTIC_")
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env(library: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_OUTSIDE) and k not in _TORCHRUN}
    env.update({"OMP_NUM_THREADS": "1", "PARITY_LIBRARY": library, "DS_ACCELERATOR": "cpu", **extra})
    return env


def _run(command: list[str], env: dict[str, str], out: Path, *script_args: str) -> dict[str, Any]:
    out.mkdir()
    proc = subprocess.run([*command, str(SCRIPT), str(out), *ARGS, *script_args],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result: dict[str, Any] = torch.load(out / "result.pt", weights_only=True)
    result["folder"] = out
    return result


def _accelerate(out: Path) -> dict[str, Any]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    return _run(torchrun, _env("accelerate", ACCELERATE_USE_CPU="1"), out)


def _gradsync(out: Path, backend: str, *flags: str, merged: bool = False) -> dict[str, Any]:
    launch = [sys.executable, "-m", "gradsync", "launch", "--nproc-per-node", "2", "--backend", backend, *flags]
    return _run(launch, _env("gradsync"), out, *(["--merged"] if merged else []))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("parity")
    return {
        "accelerate": _accelerate(root / "accelerate"),
        "ddp": _gradsync(root / "ddp", "ddp"),
        "fsdp": _gradsync(root / "fsdp", "fsdp"),
        "ddp_merged": _gradsync(root / "ddp_merged", "ddp", merged=True),
        "zero2_merged": _gradsync(root / "zero2_merged", "deepspeed", "--zero-stage", "2", merged=True),
    }


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


def test_each_run_is_two_processes_with_its_backend(runs):
    wrapped = {name: set(r["wrapped"].values()) for name, r in runs.items()}
    assert wrapped["accelerate"] == wrapped["ddp"] == wrapped["ddp_merged"] == {"DistributedDataParallel"}
    assert all(w.startswith("FSDP") for w in wrapped["fsdp"]), wrapped["fsdp"]  # fully_shard's classes
    assert wrapped["zero2_merged"] == {"DeepSpeedEngine"}
    for r in runs.values():
        assert r["num_processes"] == 2
        assert r["optimizer_steps"] == 6  # 96 samples / (4 x 4 x 2), two epochs


@pytest.mark.parametrize("first, second", PAIRS)
def test_the_final_parameters_are_the_same(runs, first, second):
    worst = _max_param_diff(runs[first], runs[second])
    assert worst <= TOL, worst


@pytest.mark.parametrize("first, second", PAIRS)
def test_gather_for_metrics_gives_the_same_outputs_once_per_sample(runs, first, second):
    a, b = runs[first], runs[second]
    assert a["names"] == b["names"]
    assert len(a["names"]) == EVAL_SAMPLES  # the padded samples dropped
    assert [n.split(":")[0] for n in a["names"]] == [f"sample{i}" for i in range(EVAL_SAMPLES)]
    assert torch.equal(a["preds"], b["preds"])
    assert [n.split(":")[1] for n in a["names"]] == [f"class{int(p)}" for p in a["preds"]]
    assert a["logits"].shape == b["logits"].shape == (EVAL_SAMPLES, 3)
    assert (a["logits"] - b["logits"]).abs().max().item() <= TOL


@pytest.mark.parametrize("first, second", PAIRS)
def test_reduce_and_the_logged_losses_are_the_same(runs, first, second):
    a, b = runs[first], runs[second]
    assert a["rank_mean"].tolist() == b["rank_mean"].tolist() == [0.5]
    assert len(a["logged"]) == len(b["logged"]) == 6
    assert a["logged"] == pytest.approx(b["logged"], abs=TOL)
    read_a, read_b = _logged(a["folder"]), _logged(b["folder"])
    assert [s for s, _ in read_a] == [s for s, _ in read_b] == [1, 2, 3, 4, 5, 6]  # step=
    assert [v for _, v in read_a] == pytest.approx(a["logged"], rel=1e-6)
    assert [v for _, v in read_b] == pytest.approx(b["logged"], rel=1e-6)


def test_the_gradsync_backends_agree_on_the_evaluation_sums(runs):
    # each rank's (summed loss, samples), averaged by reduce(reduction="mean")
    for first, second in PAIRS[1:]:
        assert runs[first]["reduced"].tolist() == pytest.approx(runs[second]["reduced"].tolist(), abs=TOL)


def test_what_differs_from_accelerate(runs):
    """The two differences this script shows; the parameters and gathered outputs are equal.

    * Padding of the evaluation shards: Accelerate pads every process's last batch to the full
      batch size (11 samples, batch 4: 16 rows seen, 8 per process); gradsync's sampler pads
      only to an equal number of samples (12 rows, 6 per process). ``gather_for_metrics``
      drops both paddings; a per-process sum passed to ``reduce`` sees them.
    * The scheduler: Accelerate steps it once per process per optimizer step (its
      ``split_batches=False`` convention), gradsync once per optimizer step.
    """
    acc, gs = runs["accelerate"], runs["ddp"]
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
