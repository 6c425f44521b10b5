"""What `gradsync launch` says when workers fail: the first failing rank's exception as
one block (its traceback, recorded by ``gradsync.launch.worker``), the ranks that only
stopped because of it in one line, and a line per restart, instead of torchrun's logs.

The first rank is chosen from what each worker recorded, not from the order torchrun's
agent saw the exits in: a rank that raised and was then stopped by the agent's SIGTERM
while it was exiting is named with its own exception and the exit status its worker
exits with."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

_ELASTIC = (
    "torch.distributed.elastic",
    "torch.distributed.run",
    "torch.distributed.launcher",
    "torch.multiprocessing",
)  # its "Terminating process ..." (--start-method fork)
#: Loggers whose per-process lines gradsync replaces with its own report.
_PER_PROCESS = ("torch.distributed.elastic.multiprocessing", "torch.multiprocessing")
_AGENT = "torch.distributed.elastic.agent.server.api"

#: Under ``--start-method fork``: the folder each worker also writes its record to
#: (``gradsync.launch.worker.ERRORS_ENV``, the same name: the wrapper imports nothing of
#: gradsync's).
ERRORS_ENV = "GRADSYNC_ERRORS"
#: A folder of the launch that outlives each attempt of its workers: what one attempt
#: leaves for the next (``on_oom="split"``'s split after an out-of-memory error that ended
#: an attempt, see ``gradsync._core.oom``).
RESTART_STATE_ENV = "GRADSYNC_RESTART_STATE"


class _Quiet(logging.Filter):
    """Drops torchrun's warnings and per-process failure lines; turns its restart notice
    into one gradsync line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "will restart worker group" in message:
            left = message.split("attempts left")[0].strip().rsplit(" ", 1)[-1]
            print(
                f"gradsync: a worker failed; restarting every worker (restarts left: {left})",
                file=sys.stderr,
                flush=True,
            )
            return False
        if record.levelno >= logging.CRITICAL:
            return True
        if record.name.startswith(_PER_PROCESS):
            return False  # "failed (exitcode: 1) local_rank: ...": gradsync reports it itself
        return record.levelno >= logging.ERROR


@contextlib.contextmanager
def quiet_torchrun() -> Iterator[None]:
    loggers = [
        logging.getLogger(name)
        for name in list(logging.Logger.manager.loggerDict)
        if name.startswith(_ELASTIC)
    ]
    quiet = _Quiet()
    agent = logging.getLogger(_AGENT)
    level = agent.level
    for logger in loggers:
        logger.addFilter(quiet)
    if agent.getEffectiveLevel() > logging.INFO:
        agent.setLevel(logging.INFO)  # its restart notice is an INFO record
    try:
        yield
    finally:
        agent.setLevel(level)
        for logger in loggers:
            logger.removeFilter(quiet)


def unquiet() -> None:
    """Take ``quiet_torchrun``'s filters off torch's loggers: what a worker started as a copy
    of the launcher does first (its own logs are its own)."""
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if isinstance(logger, logging.Logger):
            for found in [f for f in logger.filters if isinstance(f, _Quiet)]:
                logger.removeFilter(found)


def _info(failure: Any) -> dict[str, Any]:
    """What the worker recorded in its error file (``gradsync.launch.worker.record``):
    ``message`` and gradsync's fields; empty when it recorded nothing."""
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        return {"message": message.get("message", ""), **(extra if isinstance(extra, dict) else {})}
    return {}


def _exit_code(failure: Any, info: dict[str, Any]) -> int:
    """The exit status of a rank: the one its worker exits with when it recorded an
    exception (torchrun may have stopped it by SIGTERM while it was exiting), else what
    torchrun saw."""
    recorded = info.get("gradsync_exitcode")
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded > 0:
        return recorded
    return int(failure.exitcode)


def _how(failure: Any, info: dict[str, Any]) -> str:
    code = _exit_code(failure, info)
    return f"exit code {code}" if code >= 0 else f"killed by {failure.signal_name()}"


def first_cause(failures: dict[int, Any]) -> tuple[int, Any]:
    """The rank whose failure came first and was not the consequence of another's, whatever
    order torchrun's agent saw the exits in: the earliest exception of a rank's own, else a
    rank killed by a signal other than the launcher's SIGTERM, else the earliest exception
    that lost a peer (or timed out waiting for one), else an exit code without a word, else
    a rank the launcher stopped."""

    def key(item: tuple[int, Any]) -> tuple[int, float, int]:
        rank, failure = item
        info = _info(failure)
        consequence = bool(info.get("gradsync_consequence"))
        if info and not consequence:
            order = 0  # an exception of its own (even if torchrun then stopped it by SIGTERM)
        elif failure.exitcode < 0 and failure.signal_name() != "SIGTERM":
            order = 1  # killed (SIGKILL, SIGSEGV...): the others lost it
        elif info:
            order = 2  # lost another rank, or timed out waiting for it
        elif failure.exitcode > 0:
            order = 3  # exited with a code of its own (sys.exit(3)), without a word
        else:
            order = 4  # stopped by the launcher (SIGTERM) once another rank failed
        return order, float(info.get("gradsync_time", failure.timestamp)), rank

    return min(failures.items(), key=key)


def with_recorded(failures: dict[int, Any], folder: str | None) -> dict[int, Any]:
    """``failures`` and the workers of the same attempt that recorded an exception in
    ``folder`` (``gradsync.launch.worker.ERRORS_ENV``) but are not among them: under
    ``--start-method fork`` torchrun's agent reports only the first worker it sees fail, and
    the one whose own exception came first may be another."""
    if not folder:
        return failures
    try:
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    except ImportError:
        return failures
    recorded: dict[tuple[int, int], Path] = {}
    for path in Path(folder).glob("attempt*.local*.json"):
        attempt_word, _, local_word = path.stem.removeprefix("attempt").partition(".local")
        if attempt_word.isdigit() and local_word.isdigit():
            recorded[int(attempt_word), int(local_word)] = path
    if not recorded:
        return failures
    last = max(attempt for attempt, _ in recorded)  # the attempt that failed for good
    known = {int(f.local_rank) for f in failures.values()}
    found = dict(failures)
    for (attempt, local), path in sorted(recorded.items()):
        if attempt != last or local in known:
            continue
        try:
            other = ProcessFailure(local_rank=local, pid=-1, exitcode=1, error_file=str(path))
        except (OSError, ValueError, TypeError, KeyError):
            continue
        rank = str(_info(other).get("gradsync_rank", ""))
        if rank.isdigit() and int(rank) not in found:
            found[int(rank)] = other
    return found


def report(err: Any, stream: TextIO, recorded: str | None = None) -> int:
    """Print the first failing rank's error as one block; return the exit status to use.
    ``recorded``: the folder the workers also wrote their records to (``with_recorded``)."""
    failures: dict[int, Any] = with_recorded(dict(err.failures), recorded)
    rank, failure = first_cause(failures)
    info = _info(failure)
    lines = [
        f"gradsync: rank {rank} (local rank {failure.local_rank}) failed ({_how(failure, info)})"
    ]
    if info.get("py_callstack"):
        lines.append(str(info["py_callstack"]).rstrip())
    elif info.get("message"):
        lines.append(str(info["message"]))
    others = []
    for other, f in sorted(failures.items()):
        if other == rank:
            continue
        said = _info(f)
        how = _how(f, said)
        how = how.removeprefix("killed by ")
        if said.get("message"):
            how += f": {str(said['message']).split(':', 1)[0]}"
        others.append(f"rank {other} ({how})")
    if others:
        lines.append(f"gradsync: also stopped: {', '.join(others)}")
    print("\n".join(lines), file=stream, flush=True)
    code = _exit_code(failure, info)
    return code if code > 0 else 1
