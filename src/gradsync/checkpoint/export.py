"""Exporting a model's full weights in Transformers' layout (``accel.save_model``), saving
any object from the main process only (``accel.save``), and letting a sharded model's own
``save_pretrained`` write its full weights (:func:`gather_in_save_pretrained`).

``save_model`` writes what ``PreTrainedModel.from_pretrained`` reads: ``model.safetensors``
(or ``pytorch_model.bin``), or numbered shards plus an index when the weights exceed
``max_shard_size``, and ``config.json`` (with ``generation_config.json`` where the model
generates) for a Transformers model. Files are written under temporary names and renamed
into place in an order that never leaves an index pointing at missing or half-written shards.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from gradsync.errors import CheckpointError, ConfigError
from gradsync.storage.folder import fsync

if TYPE_CHECKING:
    from gradsync.backends.base import Backend

#: (single file, index) of each format, as Transformers names them.
SAFE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
#: Every file through which a loader finds a model's weights in a folder.
_ENTRY_POINTS = frozenset(SAFE_WEIGHTS + PICKLE_WEIGHTS)
#: A shard of either format: ``model-00001-of-00003.safetensors``.
_SHARD = re.compile(r"(?:model|pytorch_model)-\d{5}-of-\d{5}\.(?:safetensors|bin)")
_TMP = ".gradsync-tmp"

#: Units of a size written as text: decimal (``"5GB"``) and binary (``"5GiB"``).
_UNITS = {
    "TIB": 2**40,
    "GIB": 2**30,
    "MIB": 2**20,
    "KIB": 2**10,
    "TB": 10**12,
    "GB": 10**9,
    "MB": 10**6,
    "KB": 10**3,
}


def parse_size(value: int | str, name: str = "max_shard_size") -> int:
    """A size in bytes, read as Accelerate and Transformers read ``max_shard_size``.

    Args:
        value: bytes as an int, or a number and a unit: ``"5GB"`` (5 * 10**9), ``"5GiB"``
            (5 * 2**30), ``"500MB"``, ``"1.5GB"``, ``"64KiB"``; a lowercase ``b`` means bits
            (``"8Gb"`` = 10**9 bytes).
        name: the setting's name in the error message.

    Returns:
        The number of bytes (at least 1).

    Raises:
        ConfigError: ``value`` is not a positive int nor such a string.
    """
    fix = "give a number of bytes (an int) or a number and a unit, e.g. '5GB', '500MB' or '2GiB'"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{name}={value!r} is not a size; {fix}")
    if isinstance(value, int):
        size = value
    else:
        text = value.strip()
        unit = next((u for u in _UNITS if text.upper().endswith(u)), None)
        try:
            number = float(text[: -len(unit)].strip()) if unit else float("nan")
        except ValueError:
            number = float("nan")
        if unit is None or number != number or number in (float("inf"), float("-inf")):
            raise ConfigError(f"{name}={value!r} is not a size; {fix}")
        size = int(number * _UNITS[unit])
        if not unit.endswith("IB") and text.endswith("b"):  # "Gb": bits
            size //= 8
    if size < 1:
        raise ConfigError(f"{name}={value!r} is not a size of at least one byte; {fix}")
    return size


def save_model(
    backend: Backend,
    model: torch.nn.Module,
    directory: str | os.PathLike[str],
    rank: int,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> str:
    """Gather ``model``'s full weights (a collective on sharded backends) and write them on
    rank 0 in Transformers' layout into the folder ``directory``; every rank returns once
    rank 0 has finished (a barrier).

    Args:
        backend: the backend that prepared ``model``.
        model: the prepared model.
        directory: the folder (created when missing).
        rank: this process's rank.
        max_shard_size: the largest shard (see :func:`parse_size`); a tensor larger than it
            gets a shard of its own.
        safe_serialization: safetensors files; False writes ``torch.save`` (pickle) files.

    Returns:
        The folder's path.

    Raises:
        ConfigError: ``directory`` is an existing file, or ``max_shard_size`` is not a size.
        CheckpointError: an entry of the state dict is not a tensor.
    """
    folder = Path(directory)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(
            f"save_model(directory={str(folder)!r}): that path is an existing file; give a folder"
        )
    limit = parse_size(max_shard_size)
    if not isinstance(safe_serialization, bool):
        raise ConfigError(
            f"save_model(safe_serialization={safe_serialization!r}) must be True "
            "(safetensors) or False (torch.save)"
        )
    state = backend.state_dict(model)  # gathered (a collective on sharded backends)
    if rank == 0:
        _write(backend.unwrap(model), state, folder, limit, safe_serialization)
    backend.barrier()
    return str(folder)


def shard_plan(sizes: dict[str, int], limit: int, weights_name: str) -> dict[str, list[str]]:
    """Which file holds which tensor: tensors in order, a new shard when the next one would
    take the current past ``limit``, a tensor larger than ``limit`` in a shard of its own
    (Transformers' rule). One shard is the file ``weights_name`` itself.

    Args:
        sizes: each tensor's size in bytes, in state-dict order.
        limit: the largest shard in bytes.
        weights_name: ``model.safetensors`` or ``pytorch_model.bin``.

    Returns:
        File name -> the tensor names it holds, in order.
    """
    shards: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for key, size in sizes.items():
        if size > limit:
            shards.append([key])
            continue
        if current and filled + size > limit:
            shards.append(current)
            current, filled = [], 0
        current.append(key)
        filled += size
    if current or not shards:
        shards.append(current)
    if len(shards) == 1:
        return {weights_name: shards[0]}
    stem, dot, ext = weights_name.rpartition(".")
    return {
        f"{stem}-{i + 1:05d}-of-{len(shards):05d}{dot}{ext}": keys for i, keys in enumerate(shards)
    }


def _tied_names(module: torch.nn.Module) -> dict[str, str]:
    """Each parameter name that is another name's parameter -> the first name."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def _standalone(state: dict[str, Any], skip: dict[str, str]) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` (minus ``skip``) on CPU, contiguous, each in a storage of its
    own: safetensors refuses shared memory, and torch.save would write a view's whole storage."""
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for key, value in state.items():
        if key in skip:
            continue
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"the state dict's entry {key!r} is a {type(value).__name__}, not a tensor: the "
                "weights files hold tensors only; save that object with accel.save() instead"
            )
        t = value.detach().cpu().contiguous()
        storage = t.untyped_storage()
        if (
            storage.data_ptr() in storages
            or t.storage_offset() != 0
            or storage.nbytes() != t.numel() * t.element_size()
        ):
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


def _write(
    module: torch.nn.Module, state: dict[str, Any], folder: Path, limit: int, safe: bool
) -> None:
    """Rank 0's part of :func:`save_model`. The order keeps every moment loadable or plainly
    empty: shards under temporary names, then the earlier save's entry points (index, single
    file) removed, then the shards renamed, then the index; stale shards last."""
    from safetensors.torch import save_file as save_safetensors

    tied = _tied_names(module)
    tensors = _standalone(state, tied)
    weights_name, index_name = SAFE_WEIGHTS if safe else PICKLE_WEIGHTS
    plan = shard_plan(
        {k: t.numel() * t.element_size() for k, t in tensors.items()}, limit, weights_name
    )
    folder.mkdir(parents=True, exist_ok=True)
    for leftover in folder.glob(f".*{_TMP}"):  # an earlier save that crashed
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    metadata = {"format": "pt", "tied": json.dumps(tied)}
    for filename, keys in plan.items():
        tmp = folder / f".{filename}{_TMP}"
        part = {k: tensors[k] for k in keys}
        if safe:
            save_safetensors(part, str(tmp), metadata=metadata)
        else:
            torch.save(part, tmp)
        fsync(tmp)
    _write_config(module, tensors, folder)
    sharded = len(plan) > 1
    for name in _ENTRY_POINTS - ({weights_name} if not sharded else set()):
        (folder / name).unlink(missing_ok=True)  # replaced below; none may point at old shards
    for filename in plan:
        os.replace(folder / f".{filename}{_TMP}", folder / filename)
    if sharded:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {k: filename for filename, keys in plan.items() for k in keys},
        }
        tmp = folder / f".{index_name}{_TMP}"
        tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        fsync(tmp)
        os.replace(tmp, folder / index_name)
    for path in folder.iterdir():
        if _SHARD.fullmatch(path.name) and path.name not in plan and path.is_file():
            path.unlink()
    fsync(folder)


def _is_pretrained_model(module: torch.nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    return isinstance(base, type) and isinstance(module, base)


def _write_config(module: torch.nn.Module, tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """``config.json`` (and ``generation_config.json`` for a model that generates) as
    ``save_pretrained`` writes them, when ``module`` carries a Transformers config."""
    config: Any = getattr(module, "config", None)
    if not callable(getattr(config, "save_pretrained", None)):
        return
    config = copy.deepcopy(config)  # the fields save_pretrained sets, without changing the model's
    if _is_pretrained_model(module):
        config.architectures = [type(module).__name__]
        dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), None)
        if dtype is not None:
            config.dtype = str(dtype).split(".")[1]
    staging = folder / f".config{_TMP}"
    config.save_pretrained(str(staging))
    can_generate = getattr(module, "can_generate", None)
    generation: Any = getattr(module, "generation_config", None)
    if (
        callable(can_generate)
        and can_generate()
        and callable(getattr(generation, "save_pretrained", None))
    ):
        generation.save_pretrained(str(staging))
    for path in sorted(staging.iterdir()):
        fsync(path)
        os.replace(path, folder / path.name)
    staging.rmdir()


def save(
    obj: Any, f: str | os.PathLike[str] | IO[bytes], *, main: bool, safe_serialization: bool = False
) -> None:
    """Save ``obj`` on the main process only, in place of ``torch.save``.

    Args:
        obj: what to save: anything ``torch.save`` takes, or with ``safe_serialization`` a
            dict of tensors (tensors sharing memory are written as copies, every key kept).
        f: a path (written under a temporary name, then renamed) or a writable binary file.
        main: whether this process is the main one; elsewhere nothing is written.
        safe_serialization: write safetensors (metadata ``{"format": "pt"}``) instead of
            ``torch.save``'s pickle.

    Raises:
        ConfigError: ``safe_serialization`` with something other than a dict of tensors.
    """
    if not main:
        return
    if safe_serialization:
        if not isinstance(obj, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
        ):
            raise ConfigError(
                f"save(safe_serialization=True) takes a dict of str -> tensor, not a "
                f"{type(obj).__name__}; pass safe_serialization=False to write it with torch.save"
            )
        from safetensors.torch import save as safetensors_bytes

        data = safetensors_bytes(_standalone(obj, {}), metadata={"format": "pt"})
        if isinstance(f, (str, os.PathLike)):
            _replace_with(Path(f), lambda path: path.write_bytes(data))
        else:
            f.write(data)
        return
    if isinstance(f, (str, os.PathLike)):
        _replace_with(Path(f), lambda path: torch.save(obj, path))
    else:
        torch.save(obj, f)


def _replace_with(target: Path, write: Any) -> None:
    """``write(tmp)`` next to ``target``, then the rename: a crash leaves the old file or the new."""
    tmp = target.with_name(f".{target.name}{_TMP}")
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
