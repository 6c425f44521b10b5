"""What a failed checkpoint write tells the user: the operating system's error behind it
(found inside torch's and DCP's wrappers), and the one line every rank raises, which names
the checkpoint folder, the file, the error in words, the checkpoint that is kept and the fix.
"""

from __future__ import annotations

import errno
import os
import shutil
import warnings
from pathlib import Path

#: The errors a full, limited, read-only, forbidden or broken disk gives, and the fix each needs.
_FIXES = {
    errno.ENOSPC: "free space there (or save elsewhere), then save again",
    errno.EDQUOT: "free space within the disk quota (or save elsewhere), then save again",
    errno.EFBIG: "raise this process's file-size limit (ulimit -f), then save again",
    errno.EROFS: "the filesystem is read-only: save into a writable folder",
    errno.EACCES: "this process may not write there: fix the folder's permissions or save elsewhere",
    errno.EPERM: "this process may not write there: fix the folder's permissions or save elsewhere",
    errno.EIO: "the storage reported an I/O error: check it (or save elsewhere), then save again",
}


class PeerFailed(Exception):
    """This rank stopped saving because another rank failed (a library that agrees on
    failures itself, as DCP does, told it): the line names the rank that failed."""


def os_error(err: BaseException) -> OSError | None:
    """The OSError behind ``err``: ``err`` itself, one it was raised from or while handling
    (torch.save raises its own RuntimeError over the failed write), or one whose words it
    quotes (torch's legacy writer says "write(): fd 3 failed with No space left on device")."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        todo += [e.__cause__, e.__context__]
    text = str(err)
    for code in _FIXES:
        if os.strerror(code) in text:
            return OSError(code, os.strerror(code))
    return None


def with_file(err: OSError, path: Path | str) -> OSError:
    """``err`` naming ``path`` when it names no file itself."""
    if err.filename is not None:
        return err
    return OSError(err.errno, err.strerror or os.strerror(err.errno or 0), str(path))


def describe(err: BaseException, tmp: Path) -> tuple[str, str] | None:
    """What could not be written (relative to the folder being written) and why, and the
    fix; None for ``PeerFailed`` (the failing rank says why)."""
    found = os_error(err)
    if found is None and isinstance(err, PeerFailed):
        return None
    if found is None:
        text = " ".join(str(err).split())
        return (
            f"raised {type(err).__name__}: {text if len(text) <= 300 else text[:297] + '...'}",
            "",
        )
    name = found.filename
    where = ""
    if name is not None:
        path = Path(os.fsdecode(name))
        if path == tmp:
            where = f"could not create {str(path)!r}: "
        elif path.is_relative_to(tmp):
            where = f"could not write {path.relative_to(tmp)}: "
        else:
            where = f"could not write {str(path)!r}: "
    code = found.errno or 0
    words = found.strerror or os.strerror(code)
    return f"{where}{words} ({errno.errorcode.get(code, code)})", _FIXES.get(code, "")


def kept(target: Path, complete: list[Path]) -> str:
    """The checkpoint a failed save of ``target`` leaves as the latest: ``target`` itself
    when it replaces one of that name, else the newest of ``complete`` (its parent's)."""
    if target.resolve() in {p.resolve() for p in complete}:
        return repr(str(target))
    return repr(str(complete[-1])) if complete else "none"


def line(
    target: Path,
    rank: int,
    world: int,
    reason: tuple[str, str] | None,
    kept: str,
    *,
    background: bool = False,
) -> str:
    """The message every rank raises (a CheckpointError) when saving ``target`` failed:
    ``reason`` is ``describe``'s (cause, fix) for ``rank``."""
    cause, fix = reason or ("failed", "")
    what = (
        f"the background save of {str(target)!r}" if background else f"save_state({str(target)!r})"
    )
    who = f"rank {rank} " if world > 1 else ""
    return (
        f"{what} failed: {who}{cause}; nothing was saved there, the checkpoint kept is {kept}"
        + (f"; {fix}" if fix else "")
    )


def remove(tmp: Path, what: str = "the unfinished checkpoint folder") -> None:
    """Remove a folder (one being written, or an old checkpoint); where that fails, one
    warning names it and training goes on."""
    problems: list[str] = []

    def note(_fn: object, path: str, info: object) -> None:
        if not problems:
            problems.append(f"{path}: {info[1] if isinstance(info, tuple) else info}")

    if tmp.exists():
        shutil.rmtree(tmp, onerror=note)
    if problems and tmp.exists():
        warnings.warn(
            f"gradsync: could not remove {what} {str(tmp)!r} ({problems[0]}); delete it by hand",
            RuntimeWarning,
            stacklevel=3,
        )
