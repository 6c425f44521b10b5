"""FSDP2 checkpoints through ``torch.distributed.checkpoint``: each rank writes its shards,
and a checkpoint saved on N ranks loads on M (DCP reshards; a 2-D mesh's replicated shards
are written once and load on a 1-D mesh or in one process). An open window's gradients
(this rank's unsharded local sums, its reduced shards under "every_step", or its partial
buffers under "defer_replicate") are written per rank and load only on the same mesh.

Layout: ``dcp_<i>`` holds model ``i``, ``dcp_optimizer_<j>`` optimizer ``j``, keyed by the
names of the parameters of the models it holds (prefixed by their position among them when
it holds several). gradsync 0.1 kept a model's one optimizer in the model's ``dcp_<i>``:
a ``Held`` marked ``legacy`` is read from there."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from gradsync._support import dist
from gradsync.backends import _dcp_forms, _fsdp_compat, _pipeline, _plain_into_stage
from gradsync.backends.base import Held
from gradsync.errors import CheckpointError
from gradsync.storage import safety
from gradsync.storage.failure import PeerFailed, os_error, with_file
from gradsync.storage.folder import load_file, one_line, save_file


def _model_state(model: nn.Module) -> dict[str, Any]:
    model_sd, _ = get_state_dict(model, [])
    return {"model": model_sd}


def _holder(models: Sequence[nn.Module], held: Held) -> nn.Module:
    """The module whose parameter names key ``held``'s state: its one model, or its models
    side by side in a ModuleList (which leaves them as they are)."""
    mine = [models[i] for i in held.models]
    return mine[0] if len(mine) == 1 else nn.ModuleList(mine)


def _options(flat: bool) -> StateDictOptions | None:
    return StateDictOptions(flatten_optimizer_state_dict=True) if flat else None


def _optim_state(models: Sequence[nn.Module], held: Held, flat: bool = False) -> dict[str, Any]:
    """The optimizer's state dict; ``flat``: keyed by parameter names (torch's flattened
    form), which a pipeline stage saves, since the stages' param groups would otherwise
    share the keys ``param_groups.0.*``."""
    _, optim_sd = get_state_dict(_holder(models, held), [held.optimizer], options=_options(flat))
    return {"optim": optim_sd}


def _folder(path: Path, held: Held) -> Path:
    return path / (f"dcp_{held.index}" if held.legacy else f"dcp_optimizer_{held.index}")


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


def save(
    path: Path,
    models: Sequence[nn.Module],
    optimizers: Sequence[Held],
    *,
    window_open: bool,
    device: torch.device,
) -> None:
    for i, model in enumerate(models):
        _write(_model_state(model), path / f"dcp_{i}")
    for held in optimizers:
        flat = _pipeline.is_stage(_holder(models, held))
        _write(_optim_state(models, held, flat), _folder(path, held))
    if window_open:
        window = [
            {
                "names": [name for name, _ in m.named_parameters()],  # this rank's layout
                "sharded": _sharded_grads(m),
                "unsharded": _fsdp_compat.window_grads(m) if isinstance(m, FSDPModule) else [],
                "partial": _fsdp_compat.partial_buffers(m) if isinstance(m, FSDPModule) else [],
                "partial_layout": (
                    _fsdp_compat.partial_layouts(m) if isinstance(m, FSDPModule) else []
                ),
            }
            for m in models
        ]
        save_file(window, path / f"window_rank{dist.rank()}.pt")


def _write(state: dict[str, Any], folder: Path) -> None:
    """``dcp.save`` of ``state`` into ``folder``. DCP gathers every rank's failure and
    raises the same ``CheckpointException`` (a BaseException, with every traceback in its
    text) on every rank; here the rank that failed raises its own error (naming the folder
    when the error names no file) and the others raise ``PeerFailed``."""
    try:
        dcp_save(state, checkpoint_id=str(folder))
    except CheckpointException as err:
        own = err.failures.get(dist.rank())
        if own is None:
            raise PeerFailed(
                f"rank(s) {sorted(err.failures)} failed writing {folder.name}"
            ) from None
        found = os_error(own[0])
        if found is None:
            raise RuntimeError(
                f"writing {folder.name}: {type(own[0]).__name__}: {one_line(own[0])}"
            ) from None
        raise with_file(found, folder) from None


class _CheckedReader(FileSystemReader):
    """DCP's file reader, refusing a ``.metadata`` that names a global outside ``allowed``
    (checked without unpickling it) before DCP unpickles it."""

    def __init__(self, path: Path, allowed: Callable[[str], bool]) -> None:
        super().__init__(str(path))
        self._folder = path
        self._allowed = allowed

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        meta = self._folder / ".metadata"
        refused = safety.refused_in_file(
            meta, lambda g: g in safety.DCP_METADATA_GLOBALS or self._allowed(g)
        )
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


def _keys(folder: Path, *, trusted: bool, allowed: Callable[[str], bool] | None) -> list[str]:
    """The keys of the DCP checkpoint in ``folder`` (its metadata, checked as ``_read``
    checks it); none when there is no such folder (``_read`` then says so)."""
    if not folder.is_dir():
        return []
    reader = (
        FileSystemReader(str(folder))
        if trusted or allowed is None
        else _CheckedReader(folder, allowed)
    )
    try:
        return list(reader.read_metadata().state_dict_metadata)
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(
            f"checkpoint {str(folder)!r} has no readable DCP metadata: {one_line(err)}"
        ) from None


@contextlib.contextmanager
def _together() -> Iterator[None]:
    """An error raised inside the block on any rank is raised on every rank when it ends
    (the first such rank's, as a CheckpointError line naming that rank on the others), so that
    no rank goes on alone to a collective read the others never reach (a hang). The block
    holds no collective."""
    mine: Exception | None = None
    try:
        yield
    except Exception as err:
        mine = err
    line = None if mine is None else f"{type(mine).__name__}: {one_line(mine)}"
    found = dist.all_gather_object(str(mine) if isinstance(mine, CheckpointError) else line)
    if mine is not None:
        raise mine
    rank, first = next(((r, p) for r, p in enumerate(found) if p is not None), (None, None))
    if first is not None:
        raise CheckpointError(f"rank {rank}: {first}")


def _read(
    folder: Path,
    state: dict[str, Any],
    what: str,
    *,
    trusted: bool,
    allowed: Callable[[str], bool] | None,
) -> None:
    if not folder.is_dir():
        raise CheckpointError(
            f"checkpoint {str(folder.parent)!r} has no {folder.name} (it holds fewer {what}s)"
        )
    try:
        if trusted or allowed is None:
            dcp_load(state, checkpoint_id=str(folder))
        else:
            dcp_load(
                state,
                storage_reader=_CheckedReader(folder, allowed),
                planner=_CheckedPlanner(folder, allowed),
            )
    except CheckpointError:
        raise
    except Exception as err:
        text = " ".join(str(err).split())[:300]
        raise CheckpointError(
            f"checkpoint {str(folder)!r} does not fit the {what}: {text}"
        ) from None


def load(
    path: Path,
    models: Sequence[nn.Module],
    optimizers: Sequence[Held],
    *,
    window_open: bool,
    device: torch.device,
    trusted: bool = False,
    allowed: Callable[[str], bool] | None = None,
) -> None:
    if allowed is None:  # the globals gradsync's own checkpoints may name, never none
        allowed = safety.allow_list().__contains__
    if _plain_into_stage.is_plain(path):  # saved without pp by backend single or ddp
        templates = [_optim_state(models, held, flat=True)["optim"] for held in optimizers]
        _plain_into_stage.load(
            path,
            models,
            optimizers,
            templates,
            window_open=window_open,
            trusted=trusted,
            together=_together,
        )
        return
    # Read everything before anything is set: a file that does not fit changes nothing.
    model_states = [_model_state(model) for model in models]
    with _together():  # this rank's files and names, checked before the first collective read
        window = (
            load_file(path / f"window_rank{dist.rank()}.pt", trusted=trusted)
            if window_open
            else None
        )
        for model, saved in zip(models, window or []):
            names = [name for name, _ in model.named_parameters()]
            if saved.get("names", names) != names:  # older files name nothing
                raise CheckpointError(
                    f"checkpoint {str(path)!r} was saved mid-window with other parameters on "
                    f"this rank ({len(saved['names'])} vs {len(names)} here: another pipeline "
                    "split or none); its window gradients resume only on the same "
                    "parallelism: resume with it, or from a checkpoint saved at a boundary"
                )
        for i, (model, state) in enumerate(zip(models, model_states, strict=True)):
            stage = _pipeline.is_stage(model)
            whole = _pipeline.whole_names(model) if stage else list(state["model"])
            folder = path / f"dcp_{i}"
            _dcp_forms.check_names(folder, whole, _keys(folder, trusted=trusted, allowed=allowed))
    for i, state in enumerate(model_states):
        _read(path / f"dcp_{i}", state, "model", trusted=trusted, allowed=allowed)
    optim_states = []
    for held in optimizers:
        folder, stage = _folder(path, held), _pipeline.is_stage(_holder(models, held))
        with _together():
            keys = _keys(folder, trusted=trusted, allowed=allowed)
        saved_flat = _dcp_forms.is_flat(keys)
        state = _optim_state(models, held, stage or saved_flat)
        if stage and not saved_flat:  # saved without pp: read this stage's part of it
            mine = _dcp_forms.nested_request(state["optim"], keys)
            _read(folder, {"optim": mine}, "optimizer", trusted=trusted, allowed=allowed)
            with _together():
                state = {"optim": _dcp_forms.flattened(mine, state["optim"], folder)}
        else:
            _read(folder, state, "optimizer", trusted=trusted, allowed=allowed)
        optim_states.append((state, stage or saved_flat))
    _set(
        models,
        optimizers,
        model_states,
        [state["optim"] for state, _ in optim_states],
        [flat for _, flat in optim_states],
    )
    if window is not None:
        for model, saved in zip(models, window):
            _put_sharded_grads(model, saved["sharded"])
            if isinstance(model, FSDPModule):
                _fsdp_compat.put_window_grads(model, saved["unsharded"], device)
                if "partial" in saved:  # older files: no 2-D mesh, no partial buffers
                    _fsdp_compat.put_partial_buffers(
                        model, saved["partial"], device, saved.get("partial_layout")
                    )


def _set(
    models: Sequence[nn.Module],
    optimizers: Sequence[Held],
    model_states: list[dict[str, Any]],
    optim_states: list[Any],
    flats: Sequence[bool] = (),
) -> None:
    """Set the states read; ``flats``: which optimizer states are keyed by parameter names
    (a pipeline stage's; none when not given)."""
    for model, state in zip(models, model_states):
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    for i, (held, optim) in enumerate(zip(optimizers, optim_states)):
        set_state_dict(
            _holder(models, held),
            [held.optimizer],
            model_state_dict={},
            optim_state_dict=optim,
            options=_options(i < len(flats) and flats[i]),
        )


# -- Accelerate's layouts of FSDP2. SHARDED_STATE_DICT: model ``i`` in ``pytorch_model_fsdp_{i}``
# under "model", optimizer ``j`` in ``optimizer_{j}`` under "optimizer", both DCP folders.
# FULL_STATE_DICT: rank 0's ``torch.save`` of model ``i``'s full state dict in
# ``pytorch_model_fsdp.bin`` (then ``pytorch_model_fsdp_{i}.bin``) and of optimizer ``j``'s,
# keyed by parameter names, in ``optimizer.bin`` (then ``optimizer_{j}.bin``).
FULL_MODEL, FULL_OPTIMIZER = "pytorch_model_fsdp", "optimizer"


def full_name(stem: str, i: int) -> str:
    """The ``i``-th file of the FULL_STATE_DICT layout: ``stem.bin``, then ``stem_i.bin``."""
    return f"{stem}.bin" if i == 0 else f"{stem}_{i}.bin"


def save_accelerate(
    adapter: Any, path: Path, models: Sequence[nn.Module], optimizers: Sequence[Held]
) -> None:
    """Write ``adapter.accelerate_layout``'s files (the adapter's method; collective)."""
    if adapter.accelerate_layout == "full_state":
        _save_full(path, models, optimizers)
        return
    for i, model in enumerate(models):
        _write(_model_state(model), path / f"pytorch_model_fsdp_{i}")
    for held in optimizers:
        optim = _optim_state(models, held)["optim"]
        _write({"optimizer": optim}, path / f"optimizer_{held.index}")


def _full(cpu: bool = True) -> StateDictOptions:
    """Full state dicts; ``cpu``: gathered to rank 0's CPU alone (the others get nothing)."""
    return StateDictOptions(full_state_dict=True, cpu_offload=cpu)


def _save_full(path: Path, models: Sequence[nn.Module], optimizers: Sequence[Held]) -> None:
    """Every rank gathers (collective); rank 0 writes."""
    for i, model in enumerate(models):
        state = get_model_state_dict(model, options=_full())
        if dist.rank() == 0:
            save_file(state, path / full_name(FULL_MODEL, i))
    for held in optimizers:
        optim = get_optimizer_state_dict(_holder(models, held), held.optimizer, options=_full())
        if dist.rank() == 0:
            save_file(optim, path / full_name(FULL_OPTIMIZER, held.index))


def load_accelerate(
    path: Path,
    models: Sequence[nn.Module],
    optimizers: Sequence[Held],
    *,
    trusted: bool = False,
) -> None:
    """Either layout, known by its files; every rank ends with its shards."""
    if (path / full_name(FULL_MODEL, 0)).is_file():
        _load_full(path, models, optimizers, trusted=trusted)
        return
    allowed = safety.allow_list().__contains__  # FSDP2's checkpoints name no global of its own
    model_states = []
    for i, model in enumerate(models):
        state = _model_state(model)
        folder = path / f"pytorch_model_fsdp_{i}"
        _read(folder, state, "model", trusted=trusted, allowed=allowed)
        model_states.append(state)
    optim_states = []
    for held in optimizers:
        state = {"optimizer": _optim_state(models, held)["optim"]}
        folder = path / f"optimizer_{held.index}"
        _read(folder, state, "optimizer", trusted=trusted, allowed=allowed)
        optim_states.append(state["optimizer"])
    _set(models, optimizers, model_states, optim_states)


def _load_full(
    path: Path, models: Sequence[nn.Module], optimizers: Sequence[Held], *, trusted: bool
) -> None:
    """Every rank reads the full files (scanned by the caller unless ``trusted``; read as
    ``weights_only`` unless ``trusted``) and keeps its shards of them; every file is read
    before any state is set."""
    weights = [
        load_file(path / full_name(FULL_MODEL, i), trusted=trusted) for i in range(len(models))
    ]
    optims = [
        load_file(path / full_name(FULL_OPTIMIZER, held.index), trusted=trusted)
        for held in optimizers
    ]
    for i, (model, state) in enumerate(zip(models, weights)):
        _check_names(model, state, path / full_name(FULL_MODEL, i))
    for i, (model, state) in enumerate(zip(models, weights)):
        try:
            set_model_state_dict(model, state, options=_full(cpu=False))
        except Exception as err:
            raise _unfit(path / full_name(FULL_MODEL, i), "model", err) from None
    for held, optim in zip(optimizers, optims):
        holder = _holder(models, held)
        try:
            set_optimizer_state_dict(holder, held.optimizer, optim, options=_full(cpu=False))
        except Exception as err:
            raise _unfit(path / full_name(FULL_OPTIMIZER, held.index), "optimizer", err) from None


def _check_names(model: nn.Module, state: dict[str, Any], path: Path) -> None:
    """The full state dict has the model's names and shapes (before anything is set)."""
    own = get_model_state_dict(model)
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)} here"
        for k, v in own.items()
        if k in state and isinstance(v, torch.Tensor) and tuple(state[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or shapes:
        raise CheckpointError(
            f"checkpoint file {str(path)!r} does not fit the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, shapes {shapes[:5]}; prepare the same model "
            "before load_state()"
        )


def _unfit(path: Path, what: str, err: Exception) -> CheckpointError:
    return CheckpointError(
        f"checkpoint file {str(path)!r} does not fit the {what}: {one_line(err).rstrip('.')}; "
        "prepare the same model and optimizer before load_state()"
    )


def full_state_dict(model: nn.Module, device: torch.device) -> dict[str, Any]:
    """``model``'s full state dict on the CPU, on every rank (each tensor gathered in turn;
    FSDP1 through its full-state-dict mode)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    if isinstance(model, FSDP1):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType

        # offload_to_cpu frees the flat parameter when it already lives on the CPU
        cfg = FullStateDictConfig(offload_to_cpu=device.type != "cpu", rank0_only=False)
        with FSDP1.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    out: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        out[key] = full.detach().cpu()
    return out
