"""The continuation of a gradsync 0.1.0 run (tests/data/release-0.1.0/make.py), computed here
with plain torch from the files of the checkpoint that release wrote: the reference a run that
resumes from that checkpoint with this gradsync must reproduce.

It is computed on the machine that runs the tests: the floats that make.py stored
(``<backend>-expected.pt``) came from another machine, whose CPU kernels may round
differently (vector widths, fused multiply-adds), so they are compared only within a stated
tolerance (``STORED_TOLERANCE``).
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

RELEASES = Path(__file__).resolve().parents[1] / "data" / "release-0.1.0"

#: Against the parameters make.py stored on the machine that wrote the checkpoints: a 4th
#: Adam step of a 49-parameter student, where another CPU's kernels round differently (a few
#: float32 ulps in the gradients); Adam's update, lr 0.05, moves each parameter by up to 0.05,
#: so 1e-5 is far below a wrong step yet above any rounding of that one step.
STORED_TOLERANCE = 1e-5


def make() -> ModuleType:
    """tests/data/release-0.1.0/make.py, the script that wrote the checkpoints."""
    spec = importlib.util.spec_from_file_location("release_make", RELEASES / "make.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _from_dcp(folder: Path) -> dict[str, object]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder, Path(tmp) / "state.pt")
        state: dict[str, object] = torch.load(Path(tmp) / "state.pt", weights_only=False)
    return state


def _saved(
    backend: str,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, object]]:
    """The teacher's and the student's parameters and the student's Adam state, read from the
    checkpoint's files as 0.1.0 laid them out: plain files (model_<i>.pt, optimizer_<i>.pt) or
    one DCP folder per model holding its optimizer keyed by parameter name."""
    folder = RELEASES / backend
    if backend == "single":
        teacher = torch.load(folder / "model_0.pt", weights_only=True)
        student = torch.load(folder / "model_1.pt", weights_only=True)
        return teacher, student, torch.load(folder / "optimizer_1.pt", weights_only=True)
    teacher = _from_dcp(folder / "dcp_0")["model"]
    both = _from_dcp(folder / "dcp_1")
    student, optim = both["model"], both["optim"]
    assert isinstance(teacher, dict) and isinstance(student, dict) and isinstance(optim, dict)
    names = list(student)
    groups = [{**g, "params": [names.index(n) for n in g["params"]]} for g in optim["param_groups"]]
    state = {names.index(n): s for n, s in optim["state"].items()}
    return teacher, student, {"state": state, "param_groups": groups}


def continuation(backend: str, world: int) -> dict[str, torch.Tensor]:
    """The student's parameters after make.py's 4th optimizer step (k=2 on ``world`` ranks),
    trained in one process from the 0.1.0 checkpoint of ``backend``: the mean of the loss
    over the step's 2 x ``world`` micro-batches."""
    release = make()
    teacher, student, opt = release.models()
    saved_teacher, saved_student, saved_opt = _saved(backend)
    teacher.load_state_dict(saved_teacher)
    student.load_state_dict(saved_student)
    opt.load_state_dict(saved_opt)
    micro = [mb for rank in range(world) for mb in release.batches(world, rank, 3)]
    for x, y in micro:
        (F.mse_loss(student(teacher(x)), y) / len(micro)).backward()
    opt.step()
    return {k: v.detach().clone() for k, v in student.state_dict().items()}


def stored(backend: str) -> dict[str, torch.Tensor]:
    """What make.py stored for that 4th step on the machine that wrote the checkpoints."""
    expected: dict[str, torch.Tensor] = torch.load(
        RELEASES / f"{backend}-expected.pt", weights_only=True
    )
    return expected
