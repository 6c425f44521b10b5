"""Worker side: several models in one prepare() call — one optimizer over two models (a UNet
and its text encoder), and two models with an optimizer each updated in one block (a GAN's
pattern) — on DDP and FSDP2, each compared with the same training written in one process
without gradsync; checkpoints of that layout, and those gradsync 0.1 wrote."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from gradsync import Accelerator

from scenarios.common import Indexed, make_model

SAMPLES, MICRO = 32, 2


def _head(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))


def _losses(
    pattern: str, g: nn.Module, d: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> list[torch.Tensor]:
    if pattern == "shared":  # one objective through both models
        return [F.mse_loss(d(g(x)), y)]
    # "gan": each model its own objective; the second model reads the first's output detached
    out = g(x)
    return [F.mse_loss(d(out.detach()), y), F.mse_loss(out, y)]


def _optimizers(pattern: str, g: nn.Module, d: nn.Module) -> list[torch.optim.Optimizer]:
    if pattern == "shared":
        return [torch.optim.Adam([*g.parameters(), *d.parameters()], lr=0.01)]
    return [
        torch.optim.Adam(d.parameters(), lr=0.01),
        torch.optim.SGD(g.parameters(), lr=0.05, momentum=0.9),
    ]


def _reference(
    pattern: str, k: int, world: int, windows: list[list[int]]
) -> dict[str, list[float]]:
    """The same training in one process, no gradsync: each window's samples as one batch."""
    g, d = make_model(), _head()
    opts = _optimizers(pattern, g, d)
    data = Indexed(SAMPLES)
    for ids in windows:
        x, y = data.x[ids], data.y[ids]
        for loss in _losses(pattern, g, d, x, y):
            loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return _flat(g, d)


def _flat(g: nn.Module, d: nn.Module) -> dict[str, list[float]]:
    return {
        "g": torch.cat([p.detach().reshape(-1) for p in g.parameters()]).tolist(),
        "d": torch.cat([p.detach().reshape(-1) for p in d.parameters()]).tolist(),
    }


def _full(accel: Accelerator, model: nn.Module) -> list[float]:
    state = accel.get_state_dict(model)
    return torch.cat([v.reshape(-1).float() for v in state.values()]).tolist()


def train(
    *, backend: str, pattern: str, k: int, save_at: int | None = None, folder: str | None = None
) -> dict[str, Any]:
    """Train G and D together (prepare in one call, one accumulate(G, D) block per batch);
    return their parameters, one process's, and the sample ids of every window."""
    accel = Accelerator(backend=backend, gradient_accumulation_steps=k, sync_policy="defer", seed=0)
    g, d = make_model(), _head()
    opts = _optimizers(pattern, g, d)
    loader = DataLoader(Indexed(SAMPLES), batch_size=MICRO, shuffle=False)
    g, d, *opts, loader = accel.prepare(g, d, *opts, loader)
    seen: list[int] = []
    windows: list[list[int]] = []
    blocks = 0
    for x, y, ids in loader:
        with accel.accumulate(g, d):
            blocks += 1
            seen.extend(ids.tolist())
            for loss in _losses(pattern, g, d, x, y):
                accel.backward(loss)
            for opt in opts:
                opt.step()
                opt.zero_grad()
        if accel.sync_gradients:
            windows.append(seen)
            seen = []
            if save_at is not None and accel.optimizer_steps == save_at and folder is not None:
                accel.save_state(folder)
    gathered = _all_gather(windows)
    global_windows = [[s for r in gathered for s in r[i]] for i in range(len(windows))]
    out = {
        "g": _full(accel, g),
        "d": _full(accel, d),
        "blocks": blocks,
        "steps": [o.steps_applied for o in opts],
        "optimizer_steps": accel.optimizer_steps,
        "reference": _reference(pattern, k, accel.world_size, global_windows),
    }
    accel.end()
    return out


def _all_gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def resume(*, backend: str, pattern: str, k: int, folder: str) -> dict[str, Any]:
    """Train the whole run saving at step 2, then in a new Accelerator resume from that
    checkpoint and train the rest: both end with the same parameters, bitwise."""
    whole = train(backend=backend, pattern=pattern, k=k, save_at=2, folder=folder)
    accel = Accelerator(backend=backend, gradient_accumulation_steps=k, sync_policy="defer", seed=0)
    g, d = make_model(5), _head(6)  # other weights: the checkpoint must bring them back
    opts = _optimizers(pattern, g, d)
    loader = DataLoader(Indexed(SAMPLES), batch_size=MICRO, shuffle=False)
    g, d, *opts, loader = accel.prepare(g, d, *opts, loader)
    accel.load_state(folder)
    for x, y, _ in loader:
        with accel.accumulate(g, d):
            for loss in _losses(pattern, g, d, x, y):
                accel.backward(loss)
            for opt in opts:
                opt.step()
                opt.zero_grad()
    out = {
        "whole_g": whole["g"],
        "whole_d": whole["d"],
        "g": _full(accel, g),
        "d": _full(accel, d),
        "steps": [o.steps_applied for o in opts],
        "whole_steps": whole["steps"],
    }
    accel.end()
    return out


def mismatch(*, backend: str, folder: str) -> dict[str, str]:
    """A checkpoint of one optimizer over G and D does not load into two optimizers."""
    train(backend=backend, pattern="shared", k=2, save_at=1, folder=folder)
    accel = Accelerator(backend=backend, gradient_accumulation_steps=2, sync_policy="defer")
    g, d = make_model(), _head()
    accel.prepare(g, d, *_optimizers("gan", g, d))
    try:
        accel.load_state(folder)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}
    return {"error": "no error"}


def load_release(*, backend: str, written_by: str) -> dict[str, Any]:
    """Load the checkpoint gradsync 0.1.0 wrote with ``written_by`` and train its 4th step:
    the student's parameters, which the test compares with that step computed in one process
    from the checkpoint's files (``scenarios.releases``)."""
    from scenarios import releases

    make = releases.make()
    accel = Accelerator(backend=backend, gradient_accumulation_steps=2)
    teacher, student, opt = make.models()
    teacher = accel.prepare(teacher)
    student, opt = accel.prepare(student, opt)
    accel.load_state(releases.RELEASES / written_by)
    loaded_steps = accel.optimizer_steps
    make.train_step(accel, teacher, student, opt, 3)
    got = accel.get_state_dict(student)
    accel.end()
    return {
        "loaded_steps": loaded_steps,
        "student": {k: v.float().tolist() for k, v in got.items()},
    }
