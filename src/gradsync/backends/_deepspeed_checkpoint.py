"""DeepSpeed checkpoints: the engine's own ``save_checkpoint`` / ``load_checkpoint`` (every
rank writes its ZeRO partitions), plus frozen models (no engine) as plain files from rank 0.
Only at a boundary: DeepSpeed keeps a window's gradients in its optimizer's private
buffers, which its checkpoints do not hold."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradsync.backends import _plain_state
from gradsync.checkpoint import CheckpointError, load_file, save_file

_TAG = "state"


def refuse_open_window() -> None:
    _plain_state.refuse_open_window("deepspeed", "its checkpoints cannot hold a window's gradients")


def save(path: Path, engine: Any, models: Sequence[torch.nn.Module]) -> None:
    engine.save_checkpoint(str(path / "deepspeed"), tag=_TAG, save_latest=False)
    if dist.get_rank() == 0:
        for i, model in enumerate(models):
            if model is not engine:
                save_file(model.state_dict(), path / f"model_{i}.pt")


def load(path: Path, engine: Any, models: Sequence[torch.nn.Module]) -> None:
    folder = path / "deepspeed"
    if not (folder / _TAG).is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} has no DeepSpeed engine state ({folder.name}/{_TAG})")
    frozen = {}
    for i, model in enumerate(models):
        if model is not engine:
            state = load_file(path / f"model_{i}.pt")
            _plain_state.check_model(path / f"model_{i}.pt", model, state)
            frozen[i] = state
    loaded, _ = engine.load_checkpoint(str(folder), tag=_TAG, load_optimizer_states=True,
                                       load_lr_scheduler_states=False)
    if loaded is None:
        raise CheckpointError(f"checkpoint {str(folder)!r}: DeepSpeed could not load it (see its log)")
    for i, state in frozen.items():
        models[i].load_state_dict(state)
