"""The "plain" checkpoint format of the replicated backends (single, DDP): the models'
and optimizers' state dicts written once, by rank 0 (``model_<i>.pt`` per model,
``optimizer_<j>.pt`` per optimizer; gradsync 0.1 numbered an optimizer by its model, which
``Held.index`` carries for such a checkpoint), and an open window's local gradients written
by every rank (the one thing that differs between ranks)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from gradsync.backends.base import Held
from gradsync.errors import CheckpointError, UsageError
from gradsync.storage.folder import load_file, save_file

Unwrap = Callable[[torch.nn.Module], torch.nn.Module]


def refuse_open_window(backend: str, why: str) -> None:
    """A UsageError: ``save_state()`` inside a window, on a backend that cannot save one."""
    raise UsageError(
        f"save_state() inside an accumulation window is not supported with backend={backend!r} "
        f"({why}); call it at a boundary, when accel.sync_gradients is True after the accumulate block"
    )


def window_file(path: Path, rank: int) -> Path:
    return path / f"window_rank{rank}.pt"


def local_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients this rank holds on ``module``'s parameters, by name."""
    return {
        n: p.grad.detach().cpu().clone() for n, p in module.named_parameters() if p.grad is not None
    }


def put_grads(module: torch.nn.Module, grads: dict[str, torch.Tensor]) -> None:
    for name, p in module.named_parameters():
        g = grads.get(name)
        p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype).clone()


def save(
    path: Path,
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[Held],
    unwrap: Unwrap,
    rank: int,
    *,
    window_open: bool,
    gathered_optimizers: bool = False,
) -> None:
    """``gathered_optimizers``: an optimizer's ``state_dict()`` is a collective that gathers
    its shards (fairscale's OSS): every rank calls it, rank 0 writes it."""
    if gathered_optimizers:
        states = [held.optimizer.state_dict() for held in optimizers]
    if rank == 0:
        for i, model in enumerate(models):
            save_file(unwrap(model).state_dict(), path / f"model_{i}.pt")
        for n, held in enumerate(optimizers):
            save_file(
                states[n] if gathered_optimizers else held.optimizer.state_dict(),
                path / f"optimizer_{held.index}.pt",
            )
    if window_open:
        save_file([local_grads(unwrap(m)) for m in models], window_file(path, rank))


def check_model(where: Path, module: torch.nn.Module, state: dict[str, Any]) -> None:
    """Refuse a state dict that does not fit ``module`` before anything is copied."""
    own = module.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint file {str(where)!r} does not fit the model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]} (another model?)"
        )
    for key, value in own.items():
        if isinstance(value, torch.Tensor) and tuple(state[key].shape) != tuple(value.shape):
            raise CheckpointError(
                f"checkpoint file {str(where)!r} does not fit the model: {key} has shape "
                f"{tuple(state[key].shape)}, the model's is {tuple(value.shape)}"
            )


def check_optimizer(where: Path, optimizer: Any, state: Any) -> None:
    groups = state.get("param_groups") if isinstance(state, dict) else None
    sizes = [len(g["params"]) for g in groups] if isinstance(groups, list) else None
    want = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != want:
        raise CheckpointError(
            f"checkpoint file {str(where)!r} does not fit the optimizer: parameter groups of "
            f"sizes {sizes}, the optimizer's are {want} (another model or optimizer?)"
        )


def load(
    path: Path,
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[Held],
    unwrap: Unwrap,
    rank: int,
    *,
    window_open: bool,
    trusted: bool = False,
) -> None:
    # Read and check everything first: nothing reaches a model unless all of it fits.
    states = []
    for i, model in enumerate(models):
        file = path / f"model_{i}.pt"
        if not file.is_file():
            raise CheckpointError(
                f"checkpoint {str(path)!r} has no {file.name} (it holds fewer models)"
            )
        state = load_file(file, trusted=trusted)
        check_model(file, unwrap(model), state)
        states.append(state)
    opt_states = []
    for held in optimizers:
        file = path / f"optimizer_{held.index}.pt"
        if not file.is_file():
            raise CheckpointError(
                f"checkpoint {str(path)!r} has no {file.name} (it holds fewer optimizers)"
            )
        opt_states.append(load_file(file, trusted=trusted))
        check_optimizer(file, held.optimizer, opt_states[-1])
    grads = load_file(window_file(path, rank), trusted=trusted) if window_open else None
    for model, state in zip(models, states):
        unwrap(model).load_state_dict(state)
    for held, opt_state in zip(optimizers, opt_states):
        held.optimizer.load_state_dict(opt_state)
    if grads is not None:
        for model, g in zip(models, grads):
            put_grads(unwrap(model), g)
