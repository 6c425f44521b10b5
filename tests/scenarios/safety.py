"""Checkpoints rewritten with a pickle payload and a matching manifest, on every backend's
format: the payload never runs, ``load_state`` fails in one line naming the file, nothing is
loaded; ``load_state(path, trusted=True)`` runs it and loads (run inside the workers)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from gradsync import Accelerator, CheckpointError
from payload import tamper_dcp_item, tamper_pickle_file, tamper_torch_file

from scenarios.common import DEEPSPEED_PRELOAD as PRELOAD  # noqa: F401  (mp_worker.py)
from scenarios.common import Indexed, make_model


def _accelerator(backend: str, stage: int | None) -> Accelerator:
    if backend == "deepspeed":
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        config = {
            "zero_optimization": {"stage": stage},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
            "gradient_clipping": 0.0,
        }
        return Accelerator(
            backend="deepspeed", gradient_accumulation_steps=2, seed=0, deepspeed_config=config
        )
    return Accelerator(backend=backend, gradient_accumulation_steps=2, seed=0)


def _prepared(backend: str, stage: int | None, seed: int) -> tuple[Accelerator, Any, Any, Any]:
    accel = _accelerator(backend, stage)
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader = DataLoader(Indexed(16), batch_size=2)
    model, opt, loader = accel.prepare(model, opt, loader)
    return accel, model, opt, loader


def _weights(accel: Accelerator, model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in accel.get_state_dict(model).items()}


def tampered_loads(
    backend: str, folder: str, targets: list[str], stage: int | None = None
) -> dict[str, Any]:
    """Train 4 micro-steps (k=2) and save; then for each target (a file of the checkpoint,
    ``dcp-item:<dcp folder>`` for a non-tensor item of a DCP folder, ``pickle:<file>`` for a
    plain pickle) a copy is rewritten with a payload on rank 0, and a fresh Accelerator loads
    it: refused, then trusted."""
    root = Path(folder)
    accel, model, opt, loader = _prepared(backend, stage, seed=0)
    for i, (x, y, _) in enumerate(loader):
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        if i == 3:
            break
    saved = Path(accel.save_state(root / "saved"))
    trained = _weights(accel, model)
    out: dict[str, Any] = {
        "files": sorted(str(p.relative_to(saved)) for p in saved.rglob("*") if p.is_file())
    }
    for n, target in enumerate(targets):
        copy, marker = root / f"tampered-{n}", root / f"ran-{n}"  # any rank that runs it writes it
        if dist.get_rank() == 0:
            shutil.copytree(saved, copy)
            kind, _, name = target.rpartition(":")
            tamper = {"dcp-item": tamper_dcp_item, "pickle": tamper_pickle_file}.get(
                kind, tamper_torch_file
            )
            tamper(copy, name, marker)
        dist.barrier()
        fresh, fresh_model, _opt, _loader = _prepared(backend, stage, seed=n + 1)
        before = _weights(fresh, fresh_model)
        error = ""
        try:
            fresh.load_state(copy)
        except CheckpointError as err:
            error = str(err)
        after = _weights(fresh, fresh_model)
        dist.barrier()
        ran_untrusted = marker.exists()
        dist.barrier()
        fresh.load_state(copy, trusted=True)
        loaded = _weights(fresh, fresh_model)
        dist.barrier()
        out[target] = {
            "error": error,
            "ran_when_refused": ran_untrusted,
            "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "ran_when_trusted": marker.exists(),
            "trusted_loads_the_training": all(torch.equal(trained[k], loaded[k]) for k in trained),
            "steps_after_trusted": fresh.optimizer_steps,
        }
    return out
