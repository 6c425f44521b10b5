"""FSDP2 checkpoints through ``torch.distributed.checkpoint``: each rank writes its shards,
and a checkpoint saved on N ranks loads on M (DCP reshards). An open window's gradients
(this rank's unsharded local sums, or its reduced shards under "every_step") are written
per rank and load only on the same world size."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from gradsync import dist
from gradsync.backends import _fsdp_compat
from gradsync.checkpoint import safety
from gradsync.checkpoint.folder import load_file, save_file
from gradsync.errors import CheckpointError


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, [optimizer] if optimizer is not None else [])
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    return state


def _sharded_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            out[name] = g.detach().cpu().clone()
    return out


def _put_sharded_grads(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        g = grads.get(name)
        if g is None:
            p.grad = None
            continue
        p.grad = torch.zeros_like(p)
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        local.copy_(g)


def save(path: Path, models: Sequence[nn.Module], optimizers: Sequence[Any], *,
         window_open: bool, device: torch.device) -> None:
    for i, (model, opt) in enumerate(zip(models, optimizers)):
        dcp_save(_state(model, opt), checkpoint_id=str(path / f"dcp_{i}"))
    if window_open:
        window = [{"sharded": _sharded_grads(m),
                   "unsharded": _fsdp_compat.window_grads(m) if isinstance(m, FSDPModule) else []}
                  for m in models]
        save_file(window, path / f"window_rank{dist.rank()}.pt")


class _CheckedReader(FileSystemReader):
    """DCP's file reader, refusing a ``.metadata`` that names a global outside ``allowed``
    (checked without unpickling it) before DCP unpickles it."""

    def __init__(self, path: Path, allowed: Callable[[str], bool]) -> None:
        super().__init__(str(path))
        self._folder = path
        self._allowed = allowed

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        meta = self._folder / ".metadata"
        refused = safety.refused_in_file(meta, lambda g: g in safety.DCP_METADATA_GLOBALS or self._allowed(g))
        if refused is not None:
            raise CheckpointError(f"checkpoint file {str(meta)!r} names {refused}; refused")
        return super().read_metadata(*args, **kwargs)


class _CheckedPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor items as ``torch.load(weights_only=True)``
    would before handing them on."""

    def __init__(self, where: Path, allowed: Callable[[str], bool]) -> None:
        super().__init__()
        self._where = where
        self._allowed = allowed

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        refused = safety.refused_in_blob(value.getvalue(), self._allowed)
        if refused is not None:
            raise CheckpointError(
                f"checkpoint {str(self._where)!r}: item {read_item.dest_index.fqn} names {refused}; refused"
            )
        value.seek(0)
        super().load_bytes(read_item, value)


def load(path: Path, models: Sequence[nn.Module], optimizers: Sequence[Any], *,
         window_open: bool, device: torch.device, trusted: bool = False,
         allowed: Callable[[str], bool] | None = None) -> None:
    window = load_file(path / f"window_rank{dist.rank()}.pt", trusted=trusted) if window_open else None
    for i, (model, opt) in enumerate(zip(models, optimizers)):
        folder = path / f"dcp_{i}"
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint {str(path)!r} has no {folder.name} (it holds fewer models)")
        state = _state(model, opt)
        try:
            if trusted or allowed is None:
                dcp_load(state, checkpoint_id=str(folder))
            else:
                dcp_load(state, storage_reader=_CheckedReader(folder, allowed),
                         planner=_CheckedPlanner(folder, allowed))
        except CheckpointError:
            raise
        except Exception as err:
            text = " ".join(str(err).split())[:300]
            raise CheckpointError(f"checkpoint {str(folder)!r} does not fit the model: {text}") from None
        set_state_dict(model, [opt] if opt is not None else [], model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}))
    if window is not None:
        for model, saved in zip(models, window):
            _put_sharded_grads(model, saved["sharded"])
            if isinstance(model, FSDPModule):
                _fsdp_compat.put_window_grads(model, saved["unsharded"], device)
