"""Committing a checkpoint folder: every rank writes, rank 0 checksums, fsyncs, marks and
renames it into place (before ``save_state`` returns, or in a thread with ``background=True``).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gradsync import dist
from gradsync.checkpoint.folder import (
    TMP_SUFFIX,
    Manifest,
    checksum,
    fsync_all,
    listed_files,
    mark_and_rename,
    one_line,
    prune,
    share,
)
from gradsync.errors import CheckpointError


def _agree(error: BaseException | None, device: torch.device | None = None) -> None:
    """Raise on every rank when any rank failed (so no rank waits for the others forever).
    With ``device`` (where the process group's tensors live), one all-reduce of a flag
    decides, and the messages are gathered only when a rank failed."""
    if device is not None and dist.is_multiprocess() and not dist.any_rank(error is not None, device):
        return
    failed = dist.all_gather_object(_describe(error))
    if error is not None:
        raise error
    for rank, message in enumerate(failed):
        if message is not None:
            raise CheckpointError(f"rank {rank} failed while saving the checkpoint: {message}")



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
        message: str | None = dist.broadcast_object(_describe(self._wait()))
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
    def writing(self, target: Path, manifest: Manifest, *, keep_last: int | None = None,
                background: bool = False, device: torch.device | None = None) -> Iterator[Path]:
        """Yield the temporary folder every rank writes its files into; on leaving, commit
        it on rank 0. Collective: call on every rank, after ``settle``; ``device`` is where
        the process group's tensors live (the ranks agree with one all-reduce of a flag)."""
        rank, world = dist.rank_info()[:2]
        tmp = target.parent / f".{target.name}{TMP_SUFFIX}"
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
        dist.barrier()  # every rank has written its files
        names: list[str] = []
        mine: dict[str, tuple[int, int]] | None = None
        try:
            if error is None:
                names = listed_files(tmp)
                # Each rank sums its share of the files while rank 0 fsyncs all of them.
                mine = _summed_while_syncing(tmp, share(tmp, names, rank, world), names if rank == 0 else [])
        except Exception as err:
            error = error or err
        parts = dist.all_gather_object((_describe(error), mine))
        _raise_if_failed(tmp, error, parts)
        if rank == 0:
            try:
                sums: dict[str, tuple[int, int]] = {}
                for _, part in parts:
                    sums.update(part or {})
                # Rank 0's listing is the checkpoint; it sums what no rank did (a rank whose
                # view of a shared filesystem lagged).
                _install(tmp, target, manifest, {n: sums[n] if n in sums else checksum(tmp / n) for n in names},
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
    syncing = _Background("gradsync-fsync", fsync_all, folder, to_sync) if to_sync else None
    try:
        return {name: checksum(folder / name) for name in to_sum}
    finally:
        failed = syncing.error() if syncing is not None else None
        if failed is not None:
            raise failed


def _install(tmp: Path, target: Path, manifest: Manifest, sums: dict[str, tuple[int, int]],
             keep_last: int | None) -> None:
    """The last steps of a commit, once every file is summed and on disk: the marker, the
    rename, then ``keep_last``."""
    mark_and_rename(tmp, target, {**manifest, "files": {name: list(sums[name]) for name in sorted(sums)}})
    if keep_last is not None:
        prune(target, keep_last)


def _raise_if_failed(tmp: Path, error: BaseException | None, parts: list[Any]) -> None:
    """After every rank wrote (``parts``: each rank's (error message, sums)): on a failure
    anywhere, remove the folder (rank 0) and raise on every rank."""
    rank = dist.rank()
    failed = next(((r, m) for r, (m, _) in enumerate(parts) if m is not None), None)
    if error is None and failed is None:
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if error is not None:
        raise error
    assert failed is not None
    raise CheckpointError(f"rank {failed[0]} failed while saving the checkpoint: {failed[1]}")


class _Commit:
    """Rank 0's commit of one written folder, in a thread. Not a daemon: an interpreter
    that exits without ``end()`` still finishes it (or the folder stays uncommitted)."""

    def __init__(self, tmp: Path, target: Path, manifest: Manifest, keep_last: int | None) -> None:
        self.target = target
        self._job = _Background(f"gradsync-commit-{target.name}", self._run, tmp, manifest, keep_last)

    def _run(self, tmp: Path, manifest: Manifest, keep_last: int | None) -> None:
        try:
            names = listed_files(tmp)
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
    return None if error is None else f"{type(error).__name__}: {one_line(error)}"


