"""Checkpoint folders: atomic writes, a manifest that marks them complete, verification,
and ``latest_checkpoint``.

A checkpoint is a folder. It is written under a temporary sibling name
(``.NAME.gradsync-tmp``); once every rank has written its files, rank 0 fsyncs them,
records each file's size and CRC-32 in ``gradsync_checkpoint.json`` (the completion
marker, written last) and renames the folder into place. A crash before that rename
leaves the previous checkpoint untouched, and the temporary folder has no marker, so
``latest_checkpoint`` never picks it. What goes inside comes from the Accelerator (the
window, the loaders, the RNG) and from the backend's ``save`` / ``load`` hooks.

Every rank must see the folder (one machine, or a shared filesystem); the decisions
(which checkpoint is the latest, whether one is intact) are rank 0's, sent to the others.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradsync.errors import ConfigError

MANIFEST = "gradsync_checkpoint.json"
FORMAT_VERSION = 1
_TMP_SUFFIX = ".gradsync-tmp"
_OLD_SUFFIX = ".gradsync-old"
_SUM_SUFFIX = ".gradsync-sum"  # size and CRC of a file save_file wrote (removed at the commit)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded: the message names the path and the problem."""


# -- the process group, when there is one ------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    if _distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (a picklable object)."""
    if not _distributed() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(value: Any) -> list[Any]:
    if not _distributed() or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _agree(error: BaseException | None) -> None:
    """Raise on every rank when any rank failed (so no rank waits for the others forever)."""
    failed = _all_gather(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    for rank, message in enumerate(failed):
        if message is not None:
            raise RuntimeError(f"rank {rank} failed while saving the checkpoint: {message}")


# -- files ---------------------------------------------------------------------
class _Summing:
    """A binary file that sums what is written through it (size and CRC-32)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.size = 0
        self.crc = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        return int(self._f.write(view))

    def flush(self) -> None:
        self._f.flush()


def save_file(obj: Any, path: Path) -> None:
    """``torch.save`` into a checkpoint folder being written, summed as it is written (so
    the commit need not read it back). Its flush to disk starts at once, in the background,
    while the next files are written; the commit fsyncs every file before the marker."""
    with open(path, "wb") as f:
        summing = _Summing(f)
        torch.save(obj, summing)  # type: ignore[arg-type]
    path.with_name(path.name + _SUM_SUFFIX).write_text(f"{summing.size} {summing.crc}")
    threading.Thread(target=_fsync_quietly, args=(path,), daemon=True).start()


def _fsync_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):  # the folder may be gone (a failed save): nothing to flush
        _fsync(path)


def load_file(path: Path) -> Any:
    """``torch.load`` of a file of a verified checkpoint, onto the CPU, tensors and plain data only."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"checkpoint file {str(path)!r} cannot be read: {_one_line(err)}") from None


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _crc(path: Path) -> tuple[int, int]:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return path.stat().st_size, crc


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and p.name != MANIFEST and not p.name.endswith(_SUM_SUFFIX))


def _summed(path: Path) -> tuple[int, int]:
    """(size, CRC): from save_file's note, else read back."""
    note = path.with_name(path.name + _SUM_SUFFIX)
    if note.is_file():
        size, crc = (int(v) for v in note.read_text().split())
        note.unlink()
        return size, crc
    return _crc(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- saving ----------------------------------------------------------------------
def check_target(path: str | os.PathLike[str], keep_last: int | None) -> Path:
    """The folder to write, or a ConfigError for a bad ``path`` / ``keep_last``."""
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
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


@contextlib.contextmanager
def writing(target: Path, manifest: dict[str, Any]) -> Iterator[Path]:
    """Yield the temporary folder every rank writes its files into; on leaving, commit it
    (fsync, checksums, the marker, rename) on rank 0. Collective: call on every rank."""
    rank, world = _rank_world()
    tmp = target.parent / f".{target.name}{_TMP_SUFFIX}"
    error: BaseException | None = None
    if rank == 0:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # left by a save that was killed
            tmp.mkdir()
        except OSError as err:
            error = err
    _agree(error)
    try:
        yield tmp
    except BaseException as err:
        error = err
    _barrier()  # every rank has written its files
    names = _files(tmp) if error is None else []
    mine: dict[str, tuple[int, int]] | None = None
    try:
        # Each rank sums its share of the files that save_file did not sum as it wrote.
        mine = {name: _summed(tmp / name) for i, name in enumerate(names) if i % world == rank}
    except OSError as err:
        error = error or err
    # One exchange: whether every rank succeeded, and the sums.
    parts = _all_gather((None if error is None else f"{type(error).__name__}: {error}", mine))
    failed = next(((r, m) for r, (m, _) in enumerate(parts) if m is not None), None)
    if error is not None or failed is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        assert failed is not None
        raise RuntimeError(f"rank {failed[0]} failed while saving the checkpoint: {failed[1]}")
    sums: dict[str, tuple[int, int]] = {}
    for _, part in parts:
        sums.update(part or {})
    if rank == 0:
        try:
            _commit(tmp, target, {**manifest, "files": {n: list(sums[n]) for n in names}})
        except OSError as err:
            error = err
    _agree(error)


def _commit(tmp: Path, target: Path, manifest: dict[str, Any]) -> None:
    for name in manifest["files"]:
        _fsync(tmp / name)  # quick where save_file's background flush got there first
    marker = tmp / (MANIFEST + ".part")
    with open(marker, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    marker.rename(tmp / MANIFEST)
    _fsync(tmp)
    old = target.parent / f".{target.name}{_OLD_SUFFIX}"
    if target.exists():  # replacing an earlier checkpoint of the same name
        if old.exists():
            shutil.rmtree(old)
        target.rename(old)
    tmp.rename(target)
    _fsync(target.parent)
    if old.exists():
        shutil.rmtree(old)


def _order(manifest: dict[str, Any]) -> tuple[int, int, int, float]:
    """Newest = most optimizer steps, then the position in the window, then the save time."""
    window = manifest.get("window", {})
    return (int(manifest.get("optimizer_steps", 0)), int(window.get("completed", 0)),
            int(window.get("index", 0)), float(manifest.get("created", 0.0)))


def _complete(root: Path) -> list[tuple[tuple[int, int, int, float], Path]]:
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
        if isinstance(manifest, dict) and manifest.get("gradsync_checkpoint") == FORMAT_VERSION:
            found.append((_order(manifest), child))
    return sorted(found)


def prune(target: Path, keep_last: int) -> list[Path]:
    """Keep ``target`` and the newest ``keep_last - 1`` other complete gradsync checkpoints
    in its parent folder; delete the rest (rank 0 only). Returns the deleted folders."""
    if _rank_world()[0] != 0:
        return []
    others = [p for _, p in _complete(target.parent) if p.resolve() != target.resolve()]
    doomed = others[: max(0, len(others) - (keep_last - 1))]
    for folder in doomed:
        shutil.rmtree(folder, ignore_errors=True)
    return doomed


def latest_checkpoint(root: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint folder under ``root`` (the most optimizer steps
    recorded inside), or None; folders of interrupted saves are skipped. With a process
    group, rank 0 decides and every rank gets its answer."""
    found: str | None = None
    if _rank_world()[0] == 0:
        complete = _complete(Path(root))
        found = str(complete[-1][1]) if complete else None
    result: str | None = broadcast(found)
    return result


# -- loading ---------------------------------------------------------------------
def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Rank 0 checks that ``path`` is a complete, intact checkpoint (every file there with
    its recorded size and checksum) and sends its manifest to every rank; otherwise every
    rank raises the same one-line CheckpointError. Nothing is loaded before this passes."""
    folder = Path(path)
    answer: dict[str, Any] | str = "unchecked"
    if _rank_world()[0] == 0:
        try:
            answer = _verify(folder)
        except CheckpointError as err:
            answer = str(err)
    answer = broadcast(answer)
    if isinstance(answer, str):
        raise CheckpointError(answer)
    return answer


def _verify(folder: Path) -> dict[str, Any]:
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
        raise CheckpointError(f"checkpoint {where!r}: {MANIFEST} is unreadable ({_one_line(err)})") from None
    if not isinstance(manifest, dict) or manifest.get("gradsync_checkpoint") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {where!r}: {MANIFEST} is not a gradsync checkpoint manifest")
    for name, (size, crc) in manifest["files"].items():
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {where!r} is incomplete: {name} is missing")
        got_size, got_crc = _crc(file)
        if got_size != size:
            raise CheckpointError(
                f"checkpoint {where!r} is corrupted: {name} has {got_size} bytes, {size} were written (truncated?)"
            )
        if got_crc != crc:
            raise CheckpointError(f"checkpoint {where!r} is corrupted: {name} fails its checksum")
    return manifest


def new_manifest(**fields: Any) -> dict[str, Any]:
    return {"gradsync_checkpoint": FORMAT_VERSION, "created": time.time(), **fields}
