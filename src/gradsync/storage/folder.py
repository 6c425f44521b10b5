"""Checkpoint folders: the layout, the manifest that marks one complete, verification,
``latest_checkpoint`` and ``keep_last`` pruning.

A checkpoint is a folder. It is written under a temporary sibling name
(``.NAME.gradsync-tmp``); once every rank has written its files, rank 0 records each
file's size and CRC-32 in ``gradsync_checkpoint.json`` (the completion marker, written
last) and renames the folder into place (see ``gradsync.storage.commit``). A crash
before that rename leaves the previous checkpoint untouched, and the temporary folder has
no marker, so ``latest_checkpoint`` never picks it.

Every rank must see the folder (one machine, or a shared filesystem); the decisions
(which checkpoint is the latest, whether one is intact) are rank 0's, sent to the others.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

import torch

from gradsync._support.dist import broadcast_object, rank
from gradsync._version import __version__
from gradsync.errors import CheckpointError, ConfigError
from gradsync.storage.failure import os_error, remove, with_file
from gradsync.storage.safety import check_name, scan_folder

MANIFEST = "gradsync_checkpoint.json"
#: 2: an optimizer is numbered by its own order and names the models it holds
#: (``optimizer_models``); 1 (gradsync 0.1): one optimizer per model, numbered by the model.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
TMP_SUFFIX = ".gradsync-tmp"
OLD_SUFFIX = ".gradsync-old"


class WindowState(TypedDict, total=False):
    """The accumulation window as saved (``Window.state_dict``)."""

    steps: int
    pending_steps: int | None
    index: int
    size: int
    boundary: bool
    completed: int
    items: int | None
    fixed: int | None  # k set during the run (on_oom="split", or the user's)


class _Position(TypedDict):
    epoch: int
    consumed: int
    read: int


class LoaderPosition(_Position, total=False):
    """Where a prepared loader's pass stood (the RNG is saved per rank beside it)."""

    #: Micro-batches per loader batch once ``on_oom="split"`` halved them (absent: 1); the
    #: counts above are in those micro-batches.
    split: int


class Manifest(TypedDict, total=False):
    """``gradsync_checkpoint.json``: what the folder holds and how it was saved."""

    gradsync_checkpoint: int  # FORMAT_VERSION (or an older readable one)
    gradsync_version: str  # the release that wrote it
    created: float  # seconds since the epoch
    backend: str
    format: str  # the backend's checkpoint format: backends of one format load each other's
    world_size: int
    optimizer_steps: int
    steps_applied: list[int]  # per prepared optimizer
    optimizer_models: list[
        list[int]
    ]  # per prepared optimizer: the models whose parameters it holds
    window: WindowState
    models: int
    schedulers: int
    objects: int
    scaler: bool
    loaders: list[LoaderPosition]
    files: dict[str, list[int]]  # file name -> [size, CRC-32], written by the commit


def save_file(obj: Any, path: Path | str, **kwargs: Any) -> None:
    """``torch.save`` into a checkpoint folder being written. The commit sums and fsyncs
    every file of the folder afterwards, however it was written (DCP and DeepSpeed write
    their own), off the writing ranks' way: summing or flushing while torch.save writes
    competed with it for the cores and made the save slower, not faster.

    It writes through a file object of its own, so that a failed write (a full disk, a
    file-size limit) raises the OSError naming ``path`` rather than torch's archive error."""
    try:
        with open(path, "wb") as f:
            torch.save(obj, f, **kwargs)
    except Exception as err:
        found = os_error(err)
        if found is None:
            raise
        raise with_file(found, path) from None


def load_file(path: Path, *, trusted: bool = False) -> Any:
    """``torch.load`` of a file of a verified checkpoint, onto the CPU: tensors and plain data
    only, or anything (which may run code from the file) when ``trusted``."""
    try:
        return torch.load(path, map_location="cpu", weights_only=not trusted)
    except Exception as err:
        raise CheckpointError(
            f"checkpoint file {str(path)!r} cannot be read: {one_line(err)}"
        ) from None


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."


def checksum(path: Path) -> tuple[int, int]:
    """(size, CRC-32) of a file, read back (from the page cache, just after it was written)."""
    crc, size = 0, 0
    chunk = bytearray(1 << 22)
    view = memoryview(chunk)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(chunk):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


def listed_files(folder: Path) -> list[str]:
    return sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def share(folder: Path, names: list[str], rank: int, world: int) -> list[str]:
    """The files ``rank`` sums: the largest first, each to the rank with the fewest bytes so
    far (every rank computes the same split from the same sizes)."""
    load = [0] * world
    mine = []
    for size, name in sorted((-(folder / n).stat().st_size, n) for n in names):
        least = load.index(min(load))
        load[least] -= size
        if least == rank:
            mine.append(name)
    return mine


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_all(folder: Path, names: list[str]) -> None:
    for name in names:
        fsync(folder / name)


def check_target(path: str | os.PathLike[str], keep_last: int | None) -> Path:
    """The folder to write, or a ConfigError for a bad ``path`` / ``keep_last``."""
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ConfigError(
            f"save_state(keep_last={keep_last!r}) must be a whole number >= 1 (how many of the "
            "newest checkpoints to keep), or None to keep them all"
        )
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ConfigError(
            f"save_state(path={str(target)!r}): that path is an existing file; a checkpoint is a "
            "folder: give a new folder path (e.g. checkpoints/step-100)"
        )
    if target.is_dir() and any(target.iterdir()) and not (target / MANIFEST).is_file():
        raise ConfigError(
            f"save_state(path={str(target)!r}): that folder holds files that are not a gradsync "
            "checkpoint; give a new or empty folder, or an earlier checkpoint's folder to replace it"
        )
    return target


def mark_and_rename(tmp: Path, target: Path, manifest: dict[str, Any]) -> None:
    """Once every file of ``tmp`` is on disk: the marker (fsynced), then the rename."""
    marker = tmp / (MANIFEST + ".part")
    try:
        with open(marker, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise with_file(err, marker) from None
    marker.rename(tmp / MANIFEST)
    fsync(tmp)
    old = target.parent / f".{target.name}{OLD_SUFFIX}"
    if target.exists():  # replacing an earlier checkpoint of the same name
        if old.exists():
            shutil.rmtree(old)
        target.rename(old)
    tmp.rename(target)
    fsync(target.parent)
    if old.exists():
        shutil.rmtree(old)


def _order(manifest: dict[str, Any]) -> tuple[int, int, int, float]:
    """Newest = most optimizer steps, then the position in the window, then the save time."""
    window = manifest.get("window", {})
    return (
        int(manifest.get("optimizer_steps", 0)),
        int(window.get("completed", 0)),
        int(window.get("index", 0)),
        float(manifest.get("created", 0.0)),
    )


def complete_checkpoints(root: Path) -> list[tuple[tuple[int, int, int, float], Path]]:
    found: list[tuple[tuple[int, int, int, float], Path]] = []
    if not root.is_dir():
        return found
    for child in root.iterdir():
        marker = child / MANIFEST
        if child.name.startswith(".") or not marker.is_file():
            continue
        try:
            manifest = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(manifest, dict) and manifest.get("gradsync_checkpoint") in READABLE_VERSIONS:
            try:
                found.append((_order(manifest), child))
            except (AttributeError, TypeError, ValueError):
                continue  # a manifest edited by hand: not one of ours to rank
    return sorted(found)


def prune(target: Path, keep_last: int) -> list[Path]:
    """Keep ``target`` and the newest ``keep_last - 1`` other complete gradsync checkpoints
    in its parent folder; delete the rest (rank 0 only). Returns the deleted folders."""
    if rank() != 0:
        return []
    others = [p for _, p in complete_checkpoints(target.parent) if p.resolve() != target.resolve()]
    doomed = others[: max(0, len(others) - (keep_last - 1))]
    for folder in doomed:
        remove(folder, "an old checkpoint (keep_last)")
    return doomed


def latest_checkpoint(root: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint folder under ``root`` (the most optimizer steps
    recorded inside); folders of interrupted saves are skipped. With a process group, rank 0
    decides and every rank gets its answer (call it on every rank). Needs no Accelerator.

    Args:
        root: the folder that holds the checkpoint folders (e.g. ``save_state``'s parent).

    Returns:
        The checkpoint folder's path, or None when ``root`` holds none (or does not exist).
    """
    found: str | None = None
    if rank() == 0:
        complete = complete_checkpoints(Path(root))
        found = str(complete[-1][1]) if complete else None
    result: str | None = broadcast_object(found)
    return result


def read_manifest(
    path: str | os.PathLike[str], allowed: Callable[[str], bool] | None = None
) -> Manifest:
    """Rank 0 checks that ``path`` is a complete, intact checkpoint (every file there with
    its recorded size and checksum, no file name leading out of the folder) and, with
    ``allowed``, that no pickle in it names a global ``allowed`` refuses; it sends the
    manifest to every rank, or every rank raises the same one-line CheckpointError.
    Nothing is loaded before this passes."""
    folder = Path(path)
    answer: Manifest | str = "unchecked"
    if rank() == 0:
        try:
            answer = _verify(folder, allowed)
        except CheckpointError as err:
            answer = str(err)
    answer = broadcast_object(answer)
    if isinstance(answer, str):
        raise CheckpointError(answer)
    return answer


def _verify(folder: Path, allowed: Callable[[str], bool] | None) -> Manifest:
    where = str(folder)
    if not folder.exists():
        raise CheckpointError(f"checkpoint {where!r} does not exist")
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {where!r} is a file, not a checkpoint folder")
    marker = folder / MANIFEST
    if not marker.is_file():
        raise CheckpointError(
            f"{where!r} is not a gradsync checkpoint (no {MANIFEST}: not written by "
            "save_state, or its save was interrupted)"
        )
    try:
        manifest = json.loads(marker.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint {where!r}: {MANIFEST} is unreadable ({one_line(err)})"
        ) from None
    if not isinstance(manifest, dict) or "gradsync_checkpoint" not in manifest:
        raise CheckpointError(
            f"checkpoint {where!r}: {MANIFEST} is not a gradsync checkpoint manifest"
        )
    version = manifest["gradsync_checkpoint"]
    if version not in READABLE_VERSIONS:
        writer = manifest.get("gradsync_version", "a gradsync release newer than this one")
        raise CheckpointError(
            f"checkpoint {where!r} has layout {version!r}, written by {writer}; this gradsync "
            f"reads layouts {', '.join(map(str, READABLE_VERSIONS))}: load it with the release "
            "that wrote it (or a newer one)"
        )
    names = list(manifest["files"])
    for name in names:
        check_name(folder, name)  # before anything is read
    for name, (size, crc) in manifest["files"].items():
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {where!r} is incomplete: {name} is missing")
        got_size, got_crc = checksum(file)
        if got_size != size:
            raise CheckpointError(
                f"checkpoint {where!r} is corrupted: {name} has {got_size} bytes, {size} were written (truncated?)"
            )
        if got_crc != crc:
            raise CheckpointError(f"checkpoint {where!r} is corrupted: {name} fails its checksum")
    if allowed is not None:
        extra = [n for n in listed_files(folder) if n not in manifest["files"]]
        for name in extra:
            check_name(folder, name)
        scan_folder(folder, [*names, *extra], allowed)
    return manifest  # type: ignore[return-value]  # checked above: a gradsync manifest


def _release() -> str:
    return f"gradsync {__version__}"


def new_manifest(**fields: Any) -> Manifest:
    """A manifest for a checkpoint being written (its ``files`` are added at the commit)."""
    manifest: Manifest = {
        "gradsync_checkpoint": FORMAT_VERSION,
        "created": time.time(),
        "gradsync_version": _release(),
    }
    manifest.update(fields)  # type: ignore[typeddict-item]
    return manifest
