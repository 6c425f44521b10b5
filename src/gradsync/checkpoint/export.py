"""Exporting a model's full weights as safetensors (``accel.save_model``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gradsync.errors import ConfigError

if TYPE_CHECKING:
    from gradsync.backends.base import Backend


def save_model(backend: Backend, model: torch.nn.Module, directory: str | os.PathLike[str],
               rank: int) -> str:
    """Gather ``model``'s full weights (a collective on sharded backends) and write them as
    ``directory/model.safetensors`` on rank 0, tied weights once. Returns the file's path."""
    folder = Path(directory)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(
            f"save_model(directory={str(folder)!r}): that path is an existing file; give a folder"
        )
    state = backend.state_dict(model)  # gathered (a collective on sharded backends)
    target = folder / "model.safetensors"
    if rank == 0:
        from safetensors.torch import save_file as save_safetensors

        module = backend.unwrap(model)
        first: dict[int, str] = {}
        tied: dict[str, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in first:
                tied[name] = first[id(p)]  # written once, under its first name
            else:
                first[id(p)] = name
        tensors: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for key, value in state.items():
            if key in tied:
                continue
            t = value.detach().cpu().contiguous()
            ptr = t.untyped_storage().data_ptr()
            if ptr in storages:  # safetensors refuses tensors that share memory
                t = t.clone()
            storages.add(t.untyped_storage().data_ptr())
            tensors[key] = t
        folder.mkdir(parents=True, exist_ok=True)
        part = folder / "model.safetensors.part"
        save_safetensors(tensors, str(part), metadata={"format": "pt", "tied": json.dumps(tied)})
        os.replace(part, target)
    backend.barrier()
    return str(target)
