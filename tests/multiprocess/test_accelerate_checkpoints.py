"""Checkpoints cross between Accelerate and ``gradsync.accelerate`` in both directions, on
DDP over 2 gloo ranks (tests/accelerate_scripts/crossing.py: a shuffled loader, dropout, a
linear schedule, k=2 and a registered object; folders saved mid-epoch after batch 3 of
epoch 0 (inside a window), batch 4 of epoch 0 and batch 4 of epoch 1, resumed through
load_state and skip_first_batches).

Three launches, each running several scripts in one process group (run_all.py): Accelerate
trains the whole run and resumes its own folders; gradsync trains the whole run, resumes
Accelerate's folders and its own; Accelerate resumes gradsync's folders. Every resume
trains as many batches as Accelerate's own resume and ends no farther from the
uninterrupted run than it: gradsync from Accelerate's folder, and Accelerate from
gradsync's (or from gradsync's own files converted by ``to_accelerate``), end exactly where
Accelerate's own resume ends (their losses too); gradsync from its own folder ends exactly
where the uninterrupted run ends.

Accelerate runs FSDP and DeepSpeed only on accelerators (``accelerate launch --use_fsdp`` or
``--use_deepspeed`` trains with DDP on the CPU), so on FSDP2 and DeepSpeed ZeRO 2 only
gradsync's side is checked: it writes Accelerate's layout of that backend, and resuming
those files alone equals Accelerate's own (DDP) resume. On FSDP2 both of Accelerate's
state-dict types: SHARDED_STATE_DICT (gradsync's default), and FULL_STATE_DICT, whose files
the script also writes by Accelerate's own recipe (``--full_state_copy``) for gradsync to
resume, and which gradsync writes itself when asked (``fsdp_state_dict_type``): the same
files, resumed the same.
"""

from __future__ import annotations

import json
import os
import shutil
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
SCRIPT = SCRIPTS / "crossing.py"
BIN = Path(sys.executable).parent
#: Batches trained when saved (of 5 per epoch, windows of 2, 2, 1): epoch 0 batch 3 (inside
#: a window), epoch 0 batch 4, epoch 1 batch 4.
SAVED = (3, 4, 9)
SHARDED_SAVED = (4, 9)


def entry(
    out: Path,
    name: str,
    resume: Path | None = None,
    saved: tuple[int, ...] = SAVED,
    skip_by: str = "skip_first_batches",
    extra: tuple[str, ...] = (),
) -> list[object]:
    (out / name).mkdir(parents=True, exist_ok=True)
    args = ["--out", str(out / name), "--skip_by", skip_by, *extra]
    if resume is None:
        args += ["--save_at", *map(str, saved)]
    else:
        args += ["--resume_from_checkpoint", str(resume)]
    return [str(SCRIPT), args]


def launch(
    out: Path, name: str, plan: list[list[object]], gradsync: bool, flags: tuple[str, ...] = ()
) -> None:
    (out / f"{name}.json").write_text(json.dumps(plan))
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "ACCELERATE_USE_CPU": "1",
        "GRADSYNC_DEVICE": "cpu",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    cli = str(BIN / ("gradsync" if gradsync else "accelerate"))
    cmd = [cli, "launch", "--num_processes", "2", *(flags or ["--multi_gpu"])]
    cmd += [str(SCRIPTS / "run_all.py")]
    cmd += [str(out / f"{name}.json"), *(["--gradsync"] if gradsync else [])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    (out / f"{name}.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{(done.stdout + done.stderr)[-4000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("crossing")
    acc, gs = out / "acc-full", out / "gs-full"
    plan = [entry(out, "acc-full")]
    plan += [entry(out, f"acc-from-acc{s}", acc / f"step_{s}") for s in SAVED]
    launch(out, "accelerate", plan, gradsync=False)
    plan = [entry(out, "gs-full")]
    plan += [entry(out, f"gs-from-acc{s}", acc / f"step_{s}") for s in SAVED]
    plan += [entry(out, f"gs-from-gs{s}", gs / f"step_{s}") for s in SAVED]
    plan += [entry(out, f"gs-continue{s}", gs / f"step_{s}", skip_by="continue") for s in SAVED]
    launch(out, "gradsync", plan, gradsync=True)
    from gradsync.accelerate.convert import to_accelerate

    for s in SAVED:  # gradsync's own files alone, turned into Accelerate's layout
        to_accelerate(gs / f"step_{s}", out / "converted" / f"step_{s}")
    plan = [entry(out, f"acc-from-gs{s}", gs / f"step_{s}") for s in SAVED]
    plan += [entry(out, f"acc-from-conv{s}", out / "converted" / f"step_{s}") for s in SAVED]
    launch(out, "accelerate-again", plan, gradsync=False)
    return out


FSDP = ("--use_fsdp", "--fsdp_version", "2")
ZERO2 = ("--use_deepspeed", "--zero_stage", "2")
#: What Accelerate's save_state writes on each backend (this script's objects): FSDP2 with
#: SHARDED_STATE_DICT, DeepSpeed through the engine's save_checkpoint.
COMMON = ("scheduler.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl")
LAYOUT = {
    "fsdp": (FSDP, ("pytorch_model_fsdp_0", "optimizer_0", *COMMON)),
    "deepspeed": (ZERO2, ("pytorch_model", "latest", *COMMON)),
}
#: FSDP2's FULL_STATE_DICT files: rank 0's full model and optimizer state.
FULL_FILES = ("pytorch_model_fsdp.bin", "optimizer.bin")


def alone(src: Path, dst: Path, files: tuple[str, ...]) -> None:
    """``files`` of the folder ``src`` copied into ``dst`` (nothing of gradsync's own)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in files:
        (shutil.copytree if (src / name).is_dir() else shutil.copy)(src / name, dst / name)


@pytest.fixture(scope="module", params=sorted(LAYOUT))
def sharded_runs(runs: Path, request: pytest.FixtureRequest) -> tuple[str, Path]:
    """gradsync on FSDP2 / DeepSpeed ZeRO 2: the whole run, then resumes of its own folders
    and of the Accelerate-layout files of them alone (Accelerate trains neither on the
    CPU)."""
    backend = request.param
    flags, files = LAYOUT[backend]
    out = runs / backend
    full = out / "full"
    fsdp = backend == "fsdp"
    copy = ("--full_state_copy", str(out / "accelerates-recipe")) if fsdp else ()
    plan = [entry(out, "full", saved=SHARDED_SAVED, extra=copy)]
    if fsdp:  # the same run, asking for Accelerate's FULL_STATE_DICT layout
        ask = ("--state_dict_type", "FULL_STATE_DICT")
        plan.append(entry(out, "full-written", saved=SHARDED_SAVED, extra=ask))
    launch(out, backend, plan, gradsync=True, flags=flags)
    plan = []
    for s in SHARDED_SAVED:
        step = f"step_{s}"
        alone(full / step, out / "accelerate-layout" / step, files)
        plan += [
            entry(out, f"from-layout{s}", out / "accelerate-layout" / step),
            entry(out, f"from-own{s}", full / step),
        ]
        if fsdp:  # Accelerate's full layout by its recipe, and as gradsync writes it
            alone(full / step, out / "accelerates-recipe" / step, COMMON)
            alone(out / "full-written" / step, out / "written" / step, FULL_FILES + COMMON)
            plan += [
                entry(out, f"from-recipe{s}", out / "accelerates-recipe" / step),
                entry(out, f"from-written{s}", out / "written" / step),
            ]
    launch(out, f"{backend}-resumes", plan, gradsync=True, flags=flags)
    return backend, out


def params(runs: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(runs / name / "final.pt")


def distance(runs: Path, a: str, b: str) -> float:
    x, y = params(runs, a), params(runs, b)
    assert x.keys() == y.keys()
    return max((x[k] - y[k]).abs().max().item() for k in x)


def final(runs: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((runs / name / f"final_{r}.json").read_text()) for r in (0, 1)]


def test_the_uninterrupted_runs_are_the_same(runs: Path) -> None:
    assert distance(runs, "acc-full", "gs-full") <= 1e-6
    assert [f["trained"] for f in final(runs, "gs-full")] == [15, 15]


def test_gradsyncs_folder_holds_accelerates_files_beside_its_own(runs: Path) -> None:
    names = {p.name for p in (runs / "gs-full" / "step_4").iterdir()}
    accelerates = {p.name for p in (runs / "acc-full" / "step_4").iterdir()}
    assert accelerates <= names
    assert "gradsync_checkpoint.json" in names


@pytest.mark.parametrize("saved", SAVED)
@pytest.mark.parametrize("resumed", ["gs-from-acc", "acc-from-gs", "acc-from-conv"])
def test_a_crossed_resume_ends_where_accelerates_own_resume_ends(
    runs: Path, resumed: str, saved: int
) -> None:
    own = f"acc-from-acc{saved}"
    crossed = f"{resumed}{saved}"
    # as many batches, the same losses, the registered object and the schedule restored
    assert final(runs, crossed) == final(runs, own)
    assert [f["trained"] for f in final(runs, crossed)] == [15 - saved] * 2
    assert distance(runs, crossed, "acc-full") <= distance(runs, own, "acc-full")
    assert distance(runs, crossed, own) == 0.0


@pytest.mark.parametrize("saved", SAVED)
def test_gradsync_resumes_its_own_folder_exactly(runs: Path, saved: int) -> None:
    assert distance(runs, f"gs-from-gs{saved}", "gs-full") == 0.0
    whole, resumed = final(runs, "gs-full"), final(runs, f"gs-from-gs{saved}")
    for w, r in zip(whole, resumed):
        assert r["losses"] == w["losses"][saved:]
        assert (r["seen"], r["lr"]) == (w["seen"], w["lr"])
    # a registered object is saved from the main process (as Accelerate saves it)
    assert resumed[0]["total"] == whole[0]["total"]


@pytest.mark.parametrize("saved", SAVED)
def test_a_script_that_skips_in_its_own_loop_resumes_its_folder_exactly(
    runs: Path, saved: int
) -> None:
    """Under Accelerate's rules ``load_state`` leaves the loader at the start of the saved
    pass: a script that skips the consumed batches with ``continue`` (older examples) skips
    them once, not twice."""
    assert final(runs, f"gs-continue{saved}") == final(runs, f"gs-from-gs{saved}")
    assert distance(runs, f"gs-continue{saved}", "gs-full") == 0.0


def test_sharded_backends_resume_accelerates_layout(
    runs: Path, sharded_runs: tuple[str, Path]
) -> None:
    backend, out = sharded_runs
    assert distance(runs, f"{backend}/full", "acc-full") <= 1e-6
    for saved in SHARDED_SAVED:
        alone = {p.name for p in (out / "accelerate-layout" / f"step_{saved}").iterdir()}
        assert alone == set(LAYOUT[backend][1])  # no file of gradsync's own format
        resumed, own = f"{backend}/from-layout{saved}", f"acc-from-acc{saved}"
        assert [f["trained"] for f in final(runs, resumed)] == [15 - saved] * 2
        assert distance(runs, resumed, "acc-full") <= distance(runs, own, "acc-full") + 1e-6
        assert distance(runs, resumed, own) <= 1e-6
        assert final(runs, resumed)[0]["seen"] == final(runs, own)[0]["seen"]
        assert distance(runs, f"{backend}/from-own{saved}", f"{backend}/full") == 0.0


def same(a: Any, b: Any) -> bool:
    """Equal nested state: tensors bitwise, the rest by ==."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


@pytest.mark.parametrize("sharded_runs", ["fsdp"], indirect=True)
def test_fsdp_full_state_dict_layout_is_accelerates_and_resumes_as_accelerate_does(
    runs: Path, sharded_runs: tuple[str, Path]
) -> None:
    _, out = sharded_runs
    assert distance(runs, "fsdp/full-written", "fsdp/full") == 0.0
    for saved in SHARDED_SAVED:
        step = f"step_{saved}"
        written = {p.name for p in (out / "full-written" / step).iterdir()}
        assert set(FULL_FILES) <= written and "pytorch_model_fsdp_0" not in written
        assert "gradsync_checkpoint.json" in written
        for name in FULL_FILES:  # gradsync writes what Accelerate's recipe writes
            ours = torch.load(out / "written" / step / name, weights_only=True)
            theirs = torch.load(out / "accelerates-recipe" / step / name, weights_only=True)
            assert same(ours, theirs), name
        own = f"acc-from-acc{saved}"
        for resumed in (f"fsdp/from-recipe{saved}", f"fsdp/from-written{saved}"):
            assert [f["trained"] for f in final(runs, resumed)] == [15 - saved] * 2
            assert distance(runs, resumed, "acc-full") <= distance(runs, own, "acc-full") + 1e-6
            assert distance(runs, resumed, own) <= 1e-6
            assert final(runs, resumed)[0]["seen"] == final(runs, own)[0]["seen"]
        # a resume of the full layout ends where a resume of the sharded one ends
        assert distance(runs, f"fsdp/from-recipe{saved}", f"fsdp/from-layout{saved}") == 0.0
