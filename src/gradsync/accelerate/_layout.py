"""Accelerate's checkpoint layout, written and read by ``gradsync.accelerate``.

A folder written by Accelerate's ``save_state`` on one process or on DDP holds, by file:
the models' weights (``model.safetensors``, ``model_1.safetensors``, ..., or
``pytorch_model.bin``, ...; the unwrapped model's keys),
each optimizer's ``state_dict`` (``optimizer.bin``, ``optimizer_1.bin``, ...), each
scheduler's (``scheduler.bin``, ...), each registered object's (``custom_checkpoint_0.pkl``,
...), the loss scaler's (``scaler.pt``) and, per process, the RNG and the accumulation
counter (``random_states_{rank}.pkl``). It records no loader position (the script skips
the batches it consumed itself, with ``skip_first_batches``), no world size and no
version. On FSDP2 the weights and optimizer states are in one of Accelerate's two
state-dict types: ``SHARDED_STATE_DICT`` (``pytorch_model_fsdp_0/``, ``optimizer_0/``,
``torch.distributed.checkpoint`` folders) or ``FULL_STATE_DICT`` (rank 0's
``pytorch_model_fsdp.bin`` and ``optimizer.bin``, the optimizer keyed by parameter names);
the backend reads both (``accelerate_reads``) and writes the one its settings choose.

``gradsync.accelerate``'s ``save_state`` writes these files beside gradsync's own, so that
Accelerate resumes the folder and gradsync resumes it exactly (window, loader positions).
Its ``load_state`` reads a folder that has only Accelerate's files through ``load``: the
pickles are scanned first against the globals such a folder holds (torch's
``weights_only`` set and the numpy pieces of an RNG state), nothing else is ever unpickled.
"""

from __future__ import annotations

import logging
import random
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gradsync._core.microstep import drop_window
from gradsync._support import dist
from gradsync.errors import CheckpointError
from gradsync.storage.folder import MANIFEST, save_file
from gradsync.storage.safety import allow_list, scan_folder

if TYPE_CHECKING:
    from gradsync._assembly import Parts
    from gradsync._plan.window import Window

log = logging.getLogger("gradsync")

#: Accelerate's layouts, each known by a file or folder only it writes (else: "plain").
LAYOUTS = (
    (re.compile(r"^pytorch_model_fsdp_\d+$"), "sharded_dcp"),
    (re.compile(r"^optimizer_\d+$"), "sharded_dcp"),
    (re.compile(r"^pytorch_model_fsdp(_\d+)?\.bin$"), "full_state"),
    (re.compile(r"^pytorch_model(_\d+)?$"), "engine_tag"),
    (re.compile(r"^latest$"), "engine_tag"),
)
KINDS = {
    "plain": "one-process/DDP layout",
    "sharded_dcp": "sharded FSDP layout",
    "full_state": "full-state FSDP layout",
    "engine_tag": "DeepSpeed layout",
}
#: Files of newer or other Accelerate loaders' state that gradsync does not read.
UNREAD = re.compile(r"^(sampler|dl_state_dict)(_\d+)?\.bin$")
#: Names of Accelerate's layout: a file so named that gradsync does not know is refused.
FAMILY = re.compile(
    r"^(model|pytorch_model|optimizer|scheduler|random_states|custom_checkpoint|scaler)([._].*)?$"
)
READS = (
    "gradsync.accelerate reads Accelerate's one-process and DDP layout (model.safetensors or "
    "pytorch_model.bin, optimizer.bin, scheduler.bin, custom_checkpoint_N.pkl, "
    "random_states_N.pkl) on backend single or ddp, its FSDP2 SHARDED_STATE_DICT layout "
    "(pytorch_model_fsdp_N/, optimizer_N/) and FULL_STATE_DICT layout (pytorch_model_fsdp.bin, "
    "optimizer.bin) on backend fsdp, and its DeepSpeed layout (pytorch_model/) on backend "
    "deepspeed"
)


def numbered(stem: str, i: int, suffix: str) -> str:
    """Accelerate's name of the ``i``-th file of a kind: ``stem.suffix``, then ``stem_i.suffix``."""
    return f"{stem}{suffix}" if i == 0 else f"{stem}_{i}{suffix}"


def is_accelerate_folder(folder: Path) -> bool:
    """A folder without gradsync's manifest that holds a file only Accelerate's layout has."""
    if (folder / MANIFEST).exists() or not folder.is_dir():
        return False
    return any(
        (folder / name).exists()
        for name in (
            "random_states_0.pkl",
            "model.safetensors",
            "pytorch_model.bin",
            "optimizer.bin",
            "pytorch_model_fsdp.bin",
            "pytorch_model_fsdp_0",
            "pytorch_model",
        )
    )


# -- writing ------------------------------------------------------------------------------
def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict as safetensors takes it: one name per shared storage (tied weights:
    the first name; ``load_model`` fills in the others), contiguous."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = {}
    for name, tensor in state.items():
        key = (
            tensor.untyped_storage().data_ptr(),
            int(tensor.storage_offset()),
            tuple(tensor.shape),
        )
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().cpu().contiguous()
    return out


def rng_file_state(step: int) -> dict[str, Any]:
    """What Accelerate keeps of one process's RNG, under its keys."""
    import numpy as np

    state: dict[str, Any] = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return state


def write(parts: Parts, folder: Path, safe_serialization: bool = True) -> None:
    """Accelerate's files of this backend's layout into ``folder`` (every rank: each writes
    its RNG file, rank 0 the plain files; a sharded layout is written by every rank).
    Nothing for a backend without one (``accelerate_layout``)."""
    backend, p = parts.backend, parts.prepared
    layout = backend.accelerate_layout
    rank = dist.rank()
    if not layout:
        if rank == 0:  # once per run (the warnings filter keeps one per message)
            warnings.warn(
                f"gradsync.accelerate: backend={backend.name!r} writes gradsync's checkpoint "
                "format only, which Accelerate cannot resume; Accelerate's layout is written "
                "on backend single, ddp, fsdp and deepspeed, without a pipeline (pp), which "
                "Accelerate has not",
                RuntimeWarning,
                stacklevel=2,
            )
        return
    if layout == "plain":
        weights = [backend.state_dict(m) for m in p.models]  # may gather: every rank
        if rank == 0:
            _write_plain(
                folder, weights, [o.state_dict() for o in p.optimizers], safe_serialization
            )
    else:
        backend.save_accelerate(folder, p.models, p.held())
    if rank == 0:
        for i, sched in enumerate(p.schedulers):
            save_file(sched.state_dict(), folder / numbered("scheduler", i, ".bin"))
        for i, obj in enumerate(p.objects):
            save_file(obj.state_dict(), folder / f"custom_checkpoint_{i}.pkl")
        if backend.scaler is not None:
            save_file(backend.scaler.state_dict(), folder / "scaler.pt")
    save_file(rng_file_state(parts.window.index), folder / f"random_states_{rank}.pkl")


def _write_plain(
    folder: Path, weights: list[dict[str, Any]], optimizers: list[Any], safe: bool
) -> None:
    for i, state in enumerate(weights):  # the unwrapped model's keys, as Accelerate's
        if safe:
            from safetensors.torch import save_file as save_safetensors

            save_safetensors(
                _unshared(state),
                str(folder / numbered("model", i, ".safetensors")),
                metadata={"format": "pt"},
            )
        else:
            save_file(dict(state), folder / numbered("pytorch_model", i, ".bin"))
    for i, state in enumerate(optimizers):
        save_file(state, folder / numbered("optimizer", i, ".bin"))


# -- reading ------------------------------------------------------------------------------
def _files(folder: Path, stem: str, suffix: str) -> list[str]:
    found, i = [], 0
    while (folder / numbered(stem, i, suffix)).exists():
        found.append(numbered(stem, i, suffix))
        i += 1
    return found


def _model_files(folder: Path) -> list[str]:
    found, i = [], 0
    while True:
        for stem, suffix in (("model", ".safetensors"), ("pytorch_model", ".bin")):
            if (folder / numbered(stem, i, suffix)).is_file():
                found.append(numbered(stem, i, suffix))
                break
        else:
            return found
        i += 1


def _dirs(folder: Path, stem: str) -> list[str]:
    found, i = [], 0
    while (folder / f"{stem}_{i}").is_dir():
        found.append(f"{stem}_{i}")
        i += 1
    return found


def kind_of(folder: Path) -> tuple[str, str | None]:
    """The layout of an Accelerate folder, and the name that shows it (None: plain)."""
    names = sorted(p.name for p in folder.iterdir())
    for pattern, kind in LAYOUTS:
        hit = next((n for n in names if pattern.match(n)), None)
        if hit is not None:
            return kind, hit
    return "plain", None


def _engines(folder: Path) -> list[str]:
    """DeepSpeed's tag folders: ``pytorch_model``, ``pytorch_model_1``, ..."""
    return [n for n in _files(folder, "pytorch_model", "") if (folder / n).is_dir()]


def _layout(folder: Path, kind: str) -> dict[str, list[str]]:
    if kind == "sharded_dcp":
        models, optimizers = _dirs(folder, "pytorch_model_fsdp"), _dirs(folder, "optimizer")
    elif kind == "full_state":
        models = _files(folder, "pytorch_model_fsdp", ".bin")
        optimizers = _files(folder, "optimizer", ".bin")
    elif kind == "engine_tag":  # an engine holds its optimizer
        models = optimizers = _engines(folder)
    else:
        models, optimizers = _model_files(folder), _files(folder, "optimizer", ".bin")
    return {
        "models": models,
        "optimizers": optimizers,
        "schedulers": _files(folder, "scheduler", ".bin"),
        "objects": sorted(
            (p.name for p in folder.glob("custom_checkpoint_*.pkl")),
            key=lambda n: int(re.sub(r"\D", "", n) or 0),
        ),
    }


def _rng_files(folder: Path) -> list[str]:
    found, i = [], 0
    while (folder / f"random_states_{i}.pkl").is_file():
        found.append(f"random_states_{i}.pkl")
        i += 1
    return found


def problem(parts: Parts, folder: Path) -> str | None:
    """Why this training cannot resume ``folder`` (one line), or None."""
    where = repr(str(folder))
    backend = parts.backend
    kind, hit = kind_of(folder)
    layout = _layout(folder, kind)
    if kind != backend.accelerate_layout and kind not in backend.accelerate_reads:
        shown = hit or next(iter(layout["models"]), "model.safetensors")
        return (
            f"{where} holds Accelerate's {KINDS[kind]} ({shown}) and this run uses "
            f"backend={backend.name!r}; {READS}"
        )
    names = sorted(p.name for p in folder.iterdir())
    unread = [n for n in names if UNREAD.match(n)]
    if unread:
        return (
            f"{where} holds {', '.join(unread)} (a seedable sampler's or a stateful "
            f"loader's state, written by another or a newer Accelerate); {READS}"
        )
    rng = _rng_files(folder)
    known = {*rng, *(n for files in layout.values() for n in files), "scaler.pt"}
    strange = [n for n in names if FAMILY.match(n) and n not in known]
    if strange:
        return (
            f"{where} holds {', '.join(strange)}, which is not in the Accelerate 1.x layout "
            f"gradsync knows (a newer Accelerate?); {READS}"
        )
    world = dist.world_size()
    if len(rng) != world:
        return (
            f"{where} was saved by {len(rng)} process(es) (random_states_0..{len(rng) - 1}.pkl) "
            f"and this run has {world}: resume it on {len(rng)} process(es), where the RNG of "
            "every process is in the folder"
        )
    have = parts.prepared.counts()
    diff = [
        f"{kind} {len(layout[kind])} saved vs {have[kind]} here"
        for kind in ("models", "optimizers", "schedulers", "objects")
        if len(layout[kind]) != have[kind]
    ]
    if diff:
        return (
            f"{where} does not fit this training: {', '.join(diff)}; prepare (and register) the "
            "same objects before load_state()"
        )
    return None


def _read(path: Path, trusted: bool) -> Any:
    """One pickle of the folder (already scanned unless ``trusted``), onto the CPU."""
    import numpy as np

    try:
        if trusted:
            return torch.load(path, map_location="cpu", weights_only=False)
        found = [np.ndarray, np.dtype, np.dtypes.UInt32DType]
        core = getattr(np, "_core", None) or np.core
        found.append(core.multiarray._reconstruct)
        import codecs

        with torch.serialization.safe_globals([*found, codecs.encode]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(
            f"checkpoint file {str(path)!r} cannot be read: {' '.join(str(err).split())[:300]}"
        ) from None


def _weights(path: Path, trusted: bool) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file as load_safetensors

        state: dict[str, torch.Tensor] = load_safetensors(str(path), device="cpu")
    else:
        state = _read(path, trusted)
    return state


def _load_weights(module: torch.nn.Module, state: dict[str, torch.Tensor], name: str) -> None:
    """Load, allowing only the names a tied weight leaves out (they share a loaded storage);
    keys saved through a DDP wrapper (``module.``) are taken as the module's own."""
    own = module.state_dict(keep_vars=True)
    wrapped = [k for k in state if k.startswith("module.")]
    if wrapped and len(wrapped) == len(state) and not any(k in own for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}
    missing, unexpected = module.load_state_dict(state, strict=False)
    loaded = {own[k].data_ptr() for k in state if k in own}
    untied = [k for k in missing if own[k].data_ptr() not in loaded]
    if untied or unexpected:
        raise CheckpointError(
            f"checkpoint file {name} does not fit the model: missing {untied[:5]}, unexpected "
            f"{list(unexpected)[:5]}; prepare the same model before load_state()"
        )


def _scanned(folder: Path) -> list[str]:
    """Every file the load reads (those inside a sharded layout's DCP folders too)."""
    kind, _ = kind_of(folder)
    names = []
    for name in (n for files in _layout(folder, kind).values() for n in files):
        path = folder / name
        if path.is_dir():
            names += [str(f.relative_to(folder)) for f in sorted(path.rglob("*")) if f.is_file()]
        else:
            names.append(name)
    names += _rng_files(folder)
    if (folder / "scaler.pt").is_file():
        names.append("scaler.pt")
    return names


def check(parts: Parts, folder: Path, trusted: bool) -> None:
    """Rank 0 checks the folder (its layout, then every pickle against the allow-list unless
    ``trusted``); every rank raises the same one-line CheckpointError, before anything loads."""
    answer: str | None = None
    if dist.rank() == 0:
        try:
            answer = problem(parts, folder)
            if answer is None and not trusted:
                allowed = allow_list(parts.backend.checkpoint_globals)
                scan_folder(folder, _scanned(folder), allowed.__contains__)
        except CheckpointError as err:
            answer = str(err)
    answer = dist.broadcast_object(answer)
    if answer is not None:
        raise CheckpointError(f"checkpoint {answer}" if answer.startswith("'") else answer)


def load(
    parts: Parts,
    folder: Path,
    trusted: bool,
    before: Callable[[], None],
    then: Callable[[], None],
) -> None:
    """Resume ``folder`` (Accelerate's layout) into what was prepared: read everything,
    then load. Loaders are left at the start of their epoch: the script skips the batches
    consumed (``skip_first_batches``) as under Accelerate. ``before``: the user's load
    hooks; ``then``: gradsync's own after-load steps."""
    check(parts, folder, trusted)
    before()
    p, backend, window = parts.prepared, parts.backend, parts.window
    plain = backend.accelerate_layout == "plain"
    layout = _layout(folder, kind_of(folder)[0])
    weights = [_weights(folder / n, trusted) for n in layout["models"]] if plain else []
    optimizers = [_read(folder / n, trusted) for n in layout["optimizers"]] if plain else []
    schedulers = [_read(folder / n, trusted) for n in layout["schedulers"]]
    objects = [_read(folder / n, trusted) for n in layout["objects"]]
    rng = _read(folder / f"random_states_{dist.rank()}.pkl", trusted)
    scaler = backend.scaler
    scaler_file = folder / "scaler.pt"
    scaler_state = (
        _read(scaler_file, trusted) if scaler is not None and scaler_file.is_file() else None
    )
    if window.is_open:
        drop_window(window, backend, p)
    if not plain:  # the backend reads its own files, then sets (collective)
        backend.load_accelerate(folder, p.models, p.held(), trusted=trusted)
    for model, state, name in zip(p.models, weights, layout["models"]):
        _load_weights(backend.unwrap(model), state, name)
    for opt, state in zip(p.optimizers, optimizers):
        opt.load_state_dict(state)
    for sched, state in zip(p.schedulers, schedulers):
        sched.load_state_dict(state)
    for obj, state in zip(p.objects, objects):
        obj.load_state_dict(state)
    if scaler is not None and scaler_state is not None:
        scaler.load_state_dict(scaler_state)
    _restore_rng(rng)
    _resume_window(window, int(rng.get("step", 0)))
    then()


def _resume_window(window: Window, step: int) -> None:
    """Accelerate's micro-step count: saved inside a window, the window goes on from that
    micro-step, without the gradients of its first ones (Accelerate's layout holds none),
    as Accelerate's own resume does."""
    index = step % window.steps
    if index:
        state = window.state_dict()
        state.update(index=index, size=window.steps, boundary=False)
        window.load_state_dict(state)
        if dist.rank() == 0:
            log.warning(
                "gradsync: the checkpoint was saved at micro-step %d of a window of %d; "
                "Accelerate's layout holds no gradients of it: the window goes on without "
                "them, as under Accelerate",
                index,
                window.steps,
            )


def _restore_rng(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(state["random_state"])
    np.random.set_state(state["numpy_random_seed"])
    torch.set_rng_state(state["torch_manual_seed"])
    if "torch_cuda_manual_seed" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda_manual_seed"])
