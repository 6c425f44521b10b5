"""A checkpoint in the plain format (``_plain_state``: backend single, or ddp without pp),
saved at a boundary, read by a pipeline's stages.

Each stage takes its own parameters and buffers out of ``model_<i>.pt`` (the whole model's
state dict, whose names a stage keeps), and its parameters' optimizer state out of
``optimizer_<j>.pt``, whose integer indices number the parameters in the order the optimizer
was given them (``_pipeline.Pipeline.orders``: each group's names before the cut). That state
becomes the stage's flattened form, keyed by names, each parameter taking the settings of
the saved group that lists it; every rank then cuts its shards out of the full tensors
it read (no collective) and sets them. Every
file is read and checked before anything is set, on every rank together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from gradsync.backends import _pipeline
from gradsync.backends.base import Held
from gradsync.errors import CheckpointError
from gradsync.storage.folder import load_file


def is_plain(path: Path) -> bool:
    """Whether the checkpoint in ``path`` is in the plain format (no DCP folder)."""
    return (path / "model_0.pt").is_file() and not (path / "dcp_0").is_dir()


def mid_window(where: str, saved_with: str) -> CheckpointError:
    """The refusal of a plain checkpoint saved mid-window (``saved_with``: by which backend),
    for a pipeline."""
    return CheckpointError(
        f"checkpoint {where!r} was saved mid-window with {saved_with} in its 'plain' "
        "format; its window gradients are per rank of another layout than a pipeline's: "
        "resume with the same parallelism, or from a checkpoint saved at a boundary"
    )


def load(
    path: Path,
    models: Sequence[nn.Module],
    optimizers: Sequence[Held],
    templates: Sequence[dict[str, Any]],
    *,
    window_open: bool,
    trusted: bool,
    together: Callable[[], AbstractContextManager[None]],
) -> None:
    """Set the stages' parameters, buffers and optimizer states from the plain files in
    ``path`` (``templates``: each optimizer's flattened state dict as it is; ``together``:
    raises an error of any rank on every rank)."""
    with together():
        if window_open:
            raise mid_window(str(path), "backend='single' or 'ddp'")
        model_states = [_model(path, i, m, trusted) for i, m in enumerate(models)]
        optim_states = [
            _optimizer(path, models, held, template, trusted)
            for held, template in zip(optimizers, templates, strict=True)
        ]
    for model, state in zip(models, model_states):
        set_model_state_dict(model, _local(state, get_model_state_dict(model)))
    for held, state, template in zip(optimizers, optim_states, templates):
        set_optimizer_state_dict(
            models[held.models[0]],
            held.optimizer,
            _local(state, template),
            options=StateDictOptions(flatten_optimizer_state_dict=True),
        )


def _local(full: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    """``full``'s tensors as this rank holds ``like``'s: its shards of a DTensor (cut from the
    full tensor every rank read, no collective), on the device and in the dtype."""
    out = dict(full)
    for key, value in full.items():
        own = like.get(key)
        if not isinstance(value, torch.Tensor) or not isinstance(own, torch.Tensor):
            continue
        if isinstance(own, DTensor):
            out[key] = distribute_tensor(
                value.to(own.device, own.dtype), own.device_mesh, own.placements, src_data_rank=None
            )
        else:
            out[key] = value.to(own.device, own.dtype)
    return out


def _file(path: Path, name: str, what: str, trusted: bool) -> Any:
    file = path / name
    if not file.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} has no {name} (it holds fewer {what}s)")
    return load_file(file, trusted=trusted)


def _model(path: Path, i: int, model: nn.Module, trusted: bool) -> dict[str, Any]:
    """This stage's part of ``model_<i>.pt``, having checked the file holds the whole
    model's names and this stage's shapes."""
    saved = _file(path, f"model_{i}.pt", "model", trusted)
    own = get_model_state_dict(model)  # this stage's tensors (DTensor shapes are global)
    names = _pipeline.whole_names(model) if _pipeline.is_stage(model) else list(own)
    if not isinstance(saved, dict):
        saved = {}
    missing = [n for n in names if n not in saved]
    unexpected = [n for n in saved if n not in set(names)]
    shapes = [
        f"{k} {tuple(saved[k].shape)} vs {tuple(v.shape)} here"
        for k, v in own.items()
        if isinstance(v, torch.Tensor) and k in saved and tuple(saved[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or shapes:
        raise CheckpointError(
            f"checkpoint file {str(path / f'model_{i}.pt')!r} holds another model: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}, shapes {shapes[:5]}; prepare the model "
            "it was saved from (the same parameter names) before load_state()"
        )
    return {k: saved[k] for k in own}


def _optimizer(
    path: Path, models: Sequence[nn.Module], held: Held, template: dict[str, Any], trusted: bool
) -> dict[str, Any]:
    mine = [models[i] for i in held.models]
    orders = _pipeline.of(mine[0]).orders if len(mine) == 1 and _pipeline.is_stage(mine[0]) else {}
    order = orders.get(id(held.optimizer))
    if order is None:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is in the plain format, which a pipeline reads for an "
            f"optimizer prepared with its one pipelined model; optimizer {held.index} holds "
            f"models {list(held.models)}: resume it without pp"
        )
    name = f"optimizer_{held.index}.pt"
    return stage_state(_file(path, name, "optimizer", trusted), order, template, path / name)


def stage_state(
    saved: Any, order: list[list[str | None]], template: dict[str, Any], file: Path
) -> dict[str, Any]:
    """A stage's flattened optimizer state (full tensors) from a saved ``optimizer.state_dict()``
    whose groups list the parameters of ``order`` (each group's names, in the optimizer's
    order before the cut): ``template`` (the stage's flattened state dict) names the keys;
    a parameter without saved state gets zeros (as fresh)."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    sizes = [len(g.get("params", ())) for g in groups] if isinstance(groups, list) else None
    want = [len(names) for names in order]
    if sizes != want:
        raise CheckpointError(
            f"checkpoint file {str(file)!r} does not fit the optimizer: parameter groups of "
            f"sizes {sizes}, the optimizer's are {want} (another model or optimizer?)"
        )
    assert isinstance(saved, dict) and isinstance(groups, list)
    where = {
        name: (index, group)
        for group, names in zip(groups, order)
        for index, name in zip(group["params"], names)
        if name is not None
    }
    states = saved.get("state") or {}
    out: dict[str, Any] = {}
    for key, value in template.items():
        kind, rest = key.split(".", 1)
        name, setting = rest.rsplit(".", 1)
        if name not in where:
            raise CheckpointError(
                f"checkpoint file {str(file)!r} holds no optimizer state for parameter {name!r}; "
                "prepare the model and optimizer it was saved from before load_state()"
            )
        index, group = where[name]
        if kind == "param_groups":
            out[key] = group.get(setting, value)  # a setting newer than the checkpoint
            continue
        found = states.get(index, {}).get(setting)
        if isinstance(value, torch.Tensor):
            if isinstance(found, torch.Tensor) and tuple(found.shape) != tuple(value.shape):
                raise CheckpointError(
                    f"checkpoint file {str(file)!r} does not fit the optimizer: {name}'s "
                    f"{setting} has shape {tuple(found.shape)}, here {tuple(value.shape)}"
                )
            found = torch.zeros(value.shape, dtype=value.dtype) if found is None else found
        out[key] = value if found is None else found
    return out
