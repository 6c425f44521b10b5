"""Committing a checkpoint folder: every rank writes, rank 0 checksums, fsyncs, marks and
renames it into place (before ``save_state`` returns, or in a thread with ``background=True``).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from gradsync._support import dist
from gradsync.errors import CheckpointError, ConfigError, UsageError
from gradsync.storage import failure
from gradsync.storage.folder import (
    TMP_SUFFIX,
    Manifest,
    checksum,
    complete_checkpoints,
    fsync_all,
    listed_files,
    mark_and_rename,
    prune,
    share,
)


class _Save:
    """One save of ``target`` through ``tmp``, and how its ranks agree on a failure: one
    all-reduce of a flag (with ``device``, where the process group's tensors live; a gather
    without it), then, only when a rank failed, one gather of the ranks' reasons and every
    rank raises the same one-line CheckpointError. Rank 0 removes ``tmp`` then."""

    def __init__(
        self, target: Path, tmp: Path, device: torch.device | None, background: bool
    ) -> None:
        self.target, self.tmp, self.device, self.background = target, tmp, device, background

    def agree(
        self,
        error: BaseException | None,
        sums: dict[str, tuple[int, int]] | None = None,
    ) -> list[dict[str, tuple[int, int]] | None]:
        """Raise the same CheckpointError on every rank when any rank's ``error`` is set
        (collective). ``sums`` (this rank's file checksums, at the commit) are gathered in
        the same collective, and every rank's are returned when no rank failed."""
        if self.device is not None and dist.is_multiprocess() and sums is None:
            if not dist.any_rank(error is not None, self.device):
                return []
        parts = dist.all_gather_object((error is not None, self._reason(error), sums))
        failed = [(rank, reason) for rank, (bad, reason, _) in enumerate(parts) if bad]
        if not failed:
            return [part for _, _, part in parts]
        if dist.rank() == 0:
            failure.remove(self.tmp)
        if error is not None and _is_own(error):
            raise error  # a usage error of this rank, or an interrupt: as it was raised
        # The first rank that says why (a rank that stopped because another failed does not).
        rank, reason = next(
            ((r, why) for r, why in failed if why is not None), (failed[0][0], None)
        )
        raise CheckpointError(
            failure.line(
                self.target,
                rank,
                len(parts),
                reason,
                _kept(self.target),
                background=self.background,
            )
        ) from None

    def _reason(self, error: BaseException | None) -> tuple[str, str] | None:
        return None if error is None else failure.describe(error, self.tmp)


def _kept(target: Path) -> str:
    """The checkpoint a failed save of ``target`` leaves as the latest (every rank sees the
    same folder, and nothing changes it while the ranks raise)."""
    return failure.kept(target, [p for _, p in complete_checkpoints(target.parent)])


def _is_own(error: BaseException) -> bool:
    """A gradsync error raised on purpose (a call in the wrong place, a setting), which names
    its fix already, or an interrupt (KeyboardInterrupt): raised as it is on its rank."""
    return isinstance(error, (ConfigError, UsageError, CheckpointError)) or not isinstance(
        error, Exception
    )


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
        failed = self._wait()
        message: str | None = dist.broadcast_object(None if failed is None else str(failed))
        return target, None if message is None else CheckpointError(message)

    def finish(self) -> CheckpointError | None:
        """At the end of training (not collective: the other ranks may be gone): rank 0
        waits for the outstanding commit; its failure, as an error to raise once the
        process group is torn down."""
        self._outstanding = None
        return self._wait()

    def _wait(self) -> CheckpointError | None:
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None else None

    @contextlib.contextmanager
    def writing(
        self,
        target: Path,
        manifest: Manifest,
        *,
        keep_last: int | None = None,
        background: bool = False,
        device: torch.device | None = None,
        then: Sequence[Callable[[Path], None]] = (),
    ) -> Iterator[Path]:
        """Yield the temporary folder every rank writes its files into; on leaving, call
        each of ``then`` with it once every rank has written (they may be collectives), and
        commit it on rank 0. Collective: call on every rank, after ``settle``; ``device`` is
        where the process group's tensors live (the ranks agree with one all-reduce of a
        flag). A failure on any rank raises the same one-line CheckpointError on every rank."""
        rank, world = dist.rank_info()[:2]
        tmp = target.parent / f".{target.name}{TMP_SUFFIX}"
        save = _Save(target, tmp, device, background)
        error: BaseException | None = None
        if rank == 0:
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)  # left by a save that was killed
                tmp.mkdir()
            except OSError as err:
                error = err
        save.agree(error)
        try:
            yield tmp
        except BaseException as err:
            error = err
        # Every rank has written its files (or failed) once this agreement is reached.
        save.agree(error)
        if then:
            try:
                for fn in then:
                    fn(tmp)
            except BaseException as err:
                error = err
            save.agree(error)
        if background:
            # rank 0 sums and fsyncs them in its thread.
            self._outstanding = str(target)
            if rank == 0:
                self._pending = _Commit(tmp, target, manifest, keep_last)
            return
        names: list[str] = []
        mine: dict[str, tuple[int, int]] | None = None
        try:
            names = listed_files(tmp)
            # Each rank sums its share of the files while rank 0 fsyncs all of them.
            mine = _summed_while_syncing(
                tmp, share(tmp, names, rank, world), names if rank == 0 else []
            )
        except Exception as err:
            error = err
        parts = save.agree(error, mine or {})
        if rank == 0:
            try:
                sums: dict[str, tuple[int, int]] = {}
                for part in parts:
                    sums.update(part or {})
                # Rank 0's listing is the checkpoint; it sums what no rank did (a rank whose
                # view of a shared filesystem lagged).
                _install(
                    tmp,
                    target,
                    manifest,
                    {n: sums[n] if n in sums else checksum(tmp / n) for n in names},
                    keep_last,
                )
            except Exception as err:
                error = err
        save.agree(error)


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


def _summed_while_syncing(
    folder: Path, to_sum: list[str], to_sync: list[str]
) -> dict[str, tuple[int, int]]:
    """(size, CRC-32) of each file of ``to_sum``, read back while a thread fsyncs the files
    of ``to_sync``; raises what either failed with."""
    syncing = _Background("gradsync-fsync", fsync_all, folder, to_sync) if to_sync else None
    try:
        return {name: checksum(folder / name) for name in to_sum}
    finally:
        failed = syncing.error() if syncing is not None else None
        if failed is not None:
            raise failed


def _install(
    tmp: Path,
    target: Path,
    manifest: Manifest,
    sums: dict[str, tuple[int, int]],
    keep_last: int | None,
) -> None:
    """The last steps of a commit, once every file is summed and on disk: the marker, the
    rename, then ``keep_last``."""
    mark_and_rename(
        tmp, target, {**manifest, "files": {name: list(sums[name]) for name in sorted(sums)}}
    )
    if keep_last is not None:
        prune(target, keep_last)


class _Commit:
    """Rank 0's commit of one written folder, in a thread. Not a daemon: an interpreter
    that exits without ``end()`` still finishes it (or the folder stays uncommitted)."""

    def __init__(self, tmp: Path, target: Path, manifest: Manifest, keep_last: int | None) -> None:
        self.target = target
        self._job = _Background(
            f"gradsync-commit-{target.name}", self._run, tmp, manifest, keep_last
        )

    def _run(self, tmp: Path, manifest: Manifest, keep_last: int | None) -> None:
        try:
            names = listed_files(tmp)
            _install(
                tmp, self.target, manifest, _summed_while_syncing(tmp, names, names), keep_last
            )
        except BaseException as err:  # reported by wait(); also said now, in case none comes
            failure.remove(tmp)
            message = failure.line(
                self.target, 0, 1, failure.describe(err, tmp), _kept(self.target), background=True
            )
            print(f"gradsync: {message}", file=sys.stderr, flush=True)
            raise CheckpointError(message) from None

    def wait(self) -> CheckpointError | None:
        error = self._job.error()
        return (
            None
            if error is None
            else error
            if isinstance(error, CheckpointError)
            else CheckpointError(
                failure.line(
                    self.target,
                    0,
                    1,
                    failure.describe(error, self.target),
                    "unknown",
                    background=True,
                )
            )
        )
