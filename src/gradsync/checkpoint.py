"""Checkpoint folders: atomic writes, a manifest that marks them complete, verification,
and ``latest_checkpoint``.

A checkpoint is a folder. It is written under a temporary sibling name
(``.NAME.gradsync-tmp``); once every rank has written its files, rank 0 fsyncs them,
records each file's size and CRC-32 in ``gradsync_checkpoint.json`` (the completion
marker, written last) and renames the folder into place; with ``background=True`` that
commit runs in a thread of rank 0 while training goes on. A crash before that rename
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
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradsync.errors import CheckpointError, ConfigError

MANIFEST = "gradsync_checkpoint.json"
FORMAT_VERSION = 1
_TMP_SUFFIX = ".gradsync-tmp"
_OLD_SUFFIX = ".gradsync-old"


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


def _agree(error: BaseException | None, device: torch.device | None = None) -> None:
    """Raise on every rank when any rank failed (so no rank waits for the others forever).
    With ``device`` (where the process group's tensors live), one all-reduce of a flag
    decides, and the messages are gathered only when a rank failed."""
    if device is not None and _distributed() and dist.get_world_size() > 1:
        flag = torch.tensor([int(error is not None)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag.item()):
            return
    failed = _all_gather(_describe(error))
    if error is not None:
        raise error
    for rank, message in enumerate(failed):
        if message is not None:
            raise RuntimeError(f"rank {rank} failed while saving the checkpoint: {message}")


# -- files ---------------------------------------------------------------------
def save_file(obj: Any, path: Path) -> None:
    """``torch.save`` into a checkpoint folder being written. The commit sums and fsyncs
    every file of the folder afterwards, however it was written (DCP and DeepSpeed write
    their own), off the writing ranks' way: summing or flushing while torch.save writes
    competed with it for the cores and made the save slower, not faster."""
    torch.save(obj, path)


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
    """(size, CRC-32) of a file, read back (from the page cache, just after it was written)."""
    crc, size = 0, 0
    chunk = bytearray(1 << 22)
    view = memoryview(chunk)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(chunk):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def _share(folder: Path, names: list[str], rank: int, world: int) -> list[str]:
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


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_all(folder: Path, names: list[str]) -> None:
    for name in names:
        _fsync(folder / name)


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


class Committer:
    """Writes checkpoint folders for one Accelerator and commits them (fsync, checksums,
    the marker, rename, ``keep_last``) on rank 0: before ``writing`` returns, or with
    ``background=True`` in a thread of rank 0 while training goes on. At most one
    background commit is outstanding; every rank knows whether there is one (they all
    started it together), so waiting for it is a collective only when there is."""

    def __init__(self) -> None:
        self._outstanding: str | None = None  # the folder a background save is committing
        self._pending: _Commit | None = None  # rank 0: the thread committing it

    def settle(self) -> tuple[str | None, CheckpointError | None]:
        """Wait until the outstanding background commit is done (collective when there is
        one): (its folder, None), (its folder, the error saying why it failed), or
        (None, None) when none was outstanding. Each outcome is returned once."""
        target, self._outstanding = self._outstanding, None
        if target is None:
            return None, None
        message: str | None = broadcast(_describe(self._wait()))
        return target, None if message is None else _failed(target, message)

    def finish(self) -> CheckpointError | None:
        """At the end of training (not collective: the other ranks may be gone): rank 0
        waits for the outstanding commit; its failure, as an error to raise once the
        process group is torn down."""
        target, self._outstanding = self._outstanding, None
        message = _describe(self._wait())
        return None if message is None else _failed(target, message)

    def _wait(self) -> BaseException | None:
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None else None

    @contextlib.contextmanager
    def writing(self, target: Path, manifest: dict[str, Any], *, keep_last: int | None = None,
                background: bool = False, device: torch.device | None = None) -> Iterator[Path]:
        """Yield the temporary folder every rank writes its files into; on leaving, commit
        it on rank 0. Collective: call on every rank, after ``settle``; ``device`` is where
        the process group's tensors live (the ranks agree with one all-reduce of a flag)."""
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
        _agree(error, device)
        try:
            yield tmp
        except BaseException as err:
            error = err
        if background:
            # Only whether every rank wrote its files; rank 0 sums and fsyncs them in its thread.
            try:
                _agree(error, device)
            except BaseException:
                if rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
            self._outstanding = str(target)
            if rank == 0:
                self._pending = _Commit(tmp, target, manifest, keep_last)
            return
        _barrier()  # every rank has written its files
        names: list[str] = []
        mine: dict[str, tuple[int, int]] | None = None
        try:
            if error is None:
                names = _files(tmp)
                # Each rank sums its share of the files while rank 0 fsyncs all of them.
                mine = _summed_while_syncing(tmp, _share(tmp, names, rank, world), names if rank == 0 else [])
        except Exception as err:
            error = error or err
        parts = _all_gather((_describe(error), mine))
        _raise_if_failed(tmp, error, parts)
        if rank == 0:
            try:
                sums: dict[str, tuple[int, int]] = {}
                for _, part in parts:
                    sums.update(part or {})
                # Rank 0's listing is the checkpoint; it sums what no rank did (a rank whose
                # view of a shared filesystem lagged).
                _install(tmp, target, manifest, {n: sums[n] if n in sums else _crc(tmp / n) for n in names},
                         keep_last)
            except Exception as err:
                error = err
                shutil.rmtree(tmp, ignore_errors=True)  # gone already where the rename was done
        _agree(error, device)


class _Background:
    """``fn(*args)`` in a plain thread, not a daemon (a ThreadPoolExecutor refuses work once
    the interpreter is shutting down, which is when an unfinished background commit runs)."""

    def __init__(self, name: str, fn: Any, *args: Any) -> None:
        self._error: BaseException | None = None

        def run() -> None:
            try:
                fn(*args)
            except BaseException as err:
                self._error = err

        self._thread = threading.Thread(target=run, name=name)
        self._thread.start()

    def error(self) -> BaseException | None:
        """Wait for it; what it raised, if anything."""
        self._thread.join()
        return self._error


def _summed_while_syncing(folder: Path, to_sum: list[str], to_sync: list[str]) -> dict[str, tuple[int, int]]:
    """(size, CRC-32) of each file of ``to_sum``, read back while a thread fsyncs the files
    of ``to_sync``; raises what either failed with."""
    syncing = _Background("gradsync-fsync", _fsync_all, folder, to_sync) if to_sync else None
    try:
        return {name: _crc(folder / name) for name in to_sum}
    finally:
        failed = syncing.error() if syncing is not None else None
        if failed is not None:
            raise failed


def _install(tmp: Path, target: Path, manifest: dict[str, Any], sums: dict[str, tuple[int, int]],
             keep_last: int | None) -> None:
    """The last steps of a commit, once every file is summed and on disk: the marker, the
    rename, then ``keep_last``."""
    _mark_and_rename(tmp, target, {**manifest, "files": {name: list(sums[name]) for name in sorted(sums)}})
    if keep_last is not None:
        prune(target, keep_last)


def _raise_if_failed(tmp: Path, error: BaseException | None, parts: list[Any]) -> None:
    """After every rank wrote (``parts``: each rank's (error message, sums)): on a failure
    anywhere, remove the folder (rank 0) and raise on every rank."""
    rank = _rank_world()[0]
    failed = next(((r, m) for r, (m, _) in enumerate(parts) if m is not None), None)
    if error is None and failed is None:
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if error is not None:
        raise error
    assert failed is not None
    raise RuntimeError(f"rank {failed[0]} failed while saving the checkpoint: {failed[1]}")


class _Commit:
    """Rank 0's commit of one written folder, in a thread. Not a daemon: an interpreter
    that exits without ``end()`` still finishes it (or the folder stays uncommitted)."""

    def __init__(self, tmp: Path, target: Path, manifest: dict[str, Any], keep_last: int | None) -> None:
        self.target = target
        self._job = _Background(f"gradsync-commit-{target.name}", self._run, tmp, manifest, keep_last)

    def _run(self, tmp: Path, manifest: dict[str, Any], keep_last: int | None) -> None:
        try:
            names = _files(tmp)
            _install(tmp, self.target, manifest, _summed_while_syncing(tmp, names, names), keep_last)
        except BaseException as err:  # reported by wait(); also said now, in case none comes
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"gradsync: {_failed(self.target, _describe(err) or '')}", file=sys.stderr, flush=True)
            raise

    def wait(self) -> BaseException | None:
        return self._job.error()


def _failed(target: object, message: str) -> CheckpointError:
    return CheckpointError(f"the background save of {str(target)!r} failed: {message}")


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {_one_line(error)}"


def _mark_and_rename(tmp: Path, target: Path, manifest: dict[str, Any]) -> None:
    """Once every file of ``tmp`` is on disk: the marker (fsynced), then the rename."""
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
            try:
                found.append((_order(manifest), child))
            except (AttributeError, TypeError, ValueError):
                continue  # a manifest edited by hand: not one of ours to rank
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
