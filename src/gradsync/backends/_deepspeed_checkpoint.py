"""DeepSpeed checkpoints: the engine's own ``save_checkpoint`` / ``load_checkpoint`` (every
rank writes its ZeRO partitions), plus frozen models (no engine) as plain files from rank 0;
and the full fp32 weights that ``save_model`` exports.
Only at a boundary: DeepSpeed keeps a window's gradients in its optimizer's private
buffers, which its checkpoints do not hold."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gradsync._support import dist
from gradsync.backends import _deepspeed_compat, _plain_state
from gradsync.errors import CheckpointError
from gradsync.storage import safety
from gradsync.storage.folder import load_file, save_file
from gradsync.storage.safety import allow_list

_TAG = "state"


def refuse_open_window() -> None:
    _plain_state.refuse_open_window("deepspeed", "its checkpoints cannot hold a window's gradients")


def save(path: Path, engine: Any, models: Sequence[torch.nn.Module]) -> None:
    # A failed write is raised once save_checkpoint returned on every rank: raised inside
    # it, the other ranks would wait for this one in DeepSpeed's barriers until the timeout.
    with _deepspeed_compat.deferred_write_errors(engine, save_file) as failed:
        engine.save_checkpoint(str(path / "deepspeed"), tag=_TAG, save_latest=False)
    if failed:
        raise failed[0]
    if dist.rank() == 0:
        for i, model in enumerate(models):
            if model is not engine:
                save_file(model.state_dict(), path / f"model_{i}.pt")


def load(
    path: Path, engine: Any, models: Sequence[torch.nn.Module], *, trusted: bool = False
) -> None:
    folder = path / "deepspeed"
    if not (folder / _TAG).is_dir():
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no DeepSpeed engine state ({folder.name}/{_TAG})"
        )
    frozen = {}
    for i, model in enumerate(models):
        if model is not engine:
            state = load_file(path / f"model_{i}.pt", trusted=trusted)
            _plain_state.check_model(path / f"model_{i}.pt", model, state)
            frozen[i] = state
    checked = (
        contextlib.nullcontext() if trusted else _deepspeed_compat.checked_loads(engine, _check)
    )
    with checked:
        loaded, _ = engine.load_checkpoint(
            str(folder), tag=_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )
    if loaded is None:
        raise CheckpointError(
            f"checkpoint {str(folder)!r}: DeepSpeed could not load it (see its log)"
        )
    for i, state in frozen.items():
        models[i].load_state_dict(state)


#: Accelerate's DeepSpeed layout: the engine's checkpoint under the tag ``pytorch_model``
#: (``pytorch_model/``, with ``latest`` naming it), beside Accelerate's other files.
ACCELERATE_TAG = "pytorch_model"


def save_accelerate(path: Path, engine: Any) -> None:
    with _deepspeed_compat.deferred_write_errors(engine, save_file) as failed:
        engine.save_checkpoint(str(path), tag=ACCELERATE_TAG)
    if failed:
        raise failed[0]


def load_accelerate(path: Path, engine: Any, *, trusted: bool = False) -> None:
    checked = (
        contextlib.nullcontext() if trusted else _deepspeed_compat.checked_loads(engine, _check)
    )
    with checked:
        loaded, _ = engine.load_checkpoint(
            str(path),
            tag=ACCELERATE_TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
    if loaded is None:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: DeepSpeed could not load it (see its log)"
        )


def _check(file: str) -> None:
    """Refuse a DeepSpeed file naming a global outside its format's allow-list."""
    refused = safety.refused_in_file(
        Path(file), allow_list(_deepspeed_compat.CHECKPOINT_GLOBALS).__contains__
    )
    if refused is not None:
        raise CheckpointError(f"checkpoint file {file!r} names {refused}; refused")


def full_weights(engine: Any, module: torch.nn.Module) -> dict[str, Any]:
    """The full fp32 weights of ``module`` (the engine's, unwrapped) on every rank, on the CPU
    (a collective: call it on all ranks)."""
    from deepspeed.utils import safe_get_full_fp32_param

    params = dict(module.named_parameters())
    masters = _deepspeed_compat.flat_fp32_masters(engine)
    out: dict[str, Any] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if key in params:
            full = safe_get_full_fp32_param(params[key])
            full = masters.get(id(params[key])) if full is None else full
            out[key] = (full if full is not None else params[key]).detach().float().cpu().clone()
        else:
            out[key] = value.detach().cpu().clone()
    return out
