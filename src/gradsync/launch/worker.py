"""What each process started by `gradsync launch` runs: the user's script, as ``python
script.py`` would (or ``python -m module``), recording an exception for the launcher.

    python -m gradsync.launch.worker SCRIPT [ARGS...]
    python -m gradsync.launch.worker -m MODULE [ARGS...]

An exception is written to torchrun's per-worker error file (``TORCHELASTIC_ERROR_FILE``)
as soon as it reaches this wrapper, before the process starts to exit: the rank, the
wall-clock time, the exit status the worker exits with, the traceback, and whether it is
the consequence of another rank's failure (a ``CollectiveError``, or a collective that lost
its peer; an exception of the rank's own earlier in its chain, e.g. one during whose cleanup
a collective timed out, is named instead). The file is written whole or not at all (a temporary file renamed over it), with
the launcher's stop signals held off while it is written, so that torchrun never reads half
of one. `gradsync launch` then names the rank whose own exception came first, even when
torchrun's agent saw another rank's exit first and stopped this one while it was exiting.

With ``gradsync launch --start-method fork`` torchrun's agent runs this module in each
worker, a copy of the launcher (``runpy``, its ``--run-path``); the copy first becomes what a
fresh interpreter would be where it matters: the launcher's signal handlers and signal mask
undone, torch's threads set from ``OMP_NUM_THREADS`` (read by torch when the launcher
imported it), and the exit handlers run when the script ends, as Python runs them.

``SystemExit`` passes through unchanged. ``KeyboardInterrupt`` (SIGINT, which `gradsync
launch` forwards when it is stopped) ends the worker as it ends ``python script.py``, killed
by SIGINT, without its traceback: the launcher prints one line for the whole job.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from types import TracebackType

#: Words of errors that follow another rank's failure (its connections closed, a timeout).
_CONSEQUENCE = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "timed out",
    "timeout",
    "connection refused",
    "peer closed",
    "stopped answering",
    "lost its connection",
)

#: The exit status of a worker whose script raised.
EXIT_CODE = 1

#: Under ``--start-method fork``: a folder where each worker also writes its record
#: (``attempt{N}.local{L}.json``), because torchrun's agent then reports only the first
#: worker it sees fail.
ERRORS_ENV = "GRADSYNC_ERRORS"

#: The signals torchrun's agent stops workers with; held off while the error file is written.
_STOP_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)


def _user_traceback(err: BaseException) -> str:
    """The traceback from the user's code on (without this wrapper's and runpy's frames)."""
    te = traceback.TracebackException.from_exception(err)
    frames = list(te.stack)
    while frames and (frames[0].filename == __file__ or "runpy" in frames[0].filename):
        frames.pop(0)
    te.stack = traceback.StackSummary.from_list(frames)
    return "".join(te.format())


def own_error(err: BaseException) -> BaseException | None:
    """The exception of this rank's own behind ``err``: ``err`` itself unless it is the
    consequence of another rank's failure, else the first exception in its chain (``raise
    ... from``, or raised while handling) that is not, e.g. the ValueError during whose
    cleanup a collective then timed out; None when every one is a consequence."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if not is_consequence(current):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def is_consequence(err: BaseException) -> bool:
    """Whether ``err`` looks like the consequence of another rank's failure: gradsync's
    ``CollectiveError`` (a collective that timed out or lost its peer), or an error whose
    words say a connection went away or timed out."""
    if any(kind.__name__ == "CollectiveError" for kind in type(err).__mro__):
        return True
    text = f"{type(err).__name__}: {err}".lower()
    return any(word in text for word in _CONSEQUENCE)


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """Hold off torchrun's stop signals inside (delivered on leaving); a no-op where the
    platform cannot."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def record(err: BaseException, path: str | None = None) -> None:
    """Write ``err`` to this worker's error file (``TORCHELASTIC_ERROR_FILE``), in torchrun's
    format with gradsync's fields; nothing where there is no such file.

    Args:
        err: the exception that ended the script.
        path: the file (default: ``TORCHELASTIC_ERROR_FILE``).
    """
    path = path or os.environ.get("TORCHELASTIC_ERROR_FILE")
    copies = os.environ.get(ERRORS_ENV)  # --start-method fork: where the launcher reads them all
    if copies:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        local = os.environ.get("LOCAL_RANK", "0")
        path_copy: str | None = os.path.join(copies, f"attempt{attempt}.local{local}.json")
    else:
        path_copy = None
    if not path and not path_copy:
        return
    now = time.time()
    own = own_error(err)
    text = f"{type(own or err).__name__}: {own or err}"
    data = {
        "message": {
            "message": text,
            "extraInfo": {
                "py_callstack": _user_traceback(err),
                "timestamp": str(int(now)),
                "gradsync_time": now,
                "gradsync_rank": os.environ.get("RANK", "?"),
                "gradsync_exitcode": EXIT_CODE,
                "gradsync_consequence": own is None,
            },
        }
    }
    with _stop_signals_held():
        for target in (path, path_copy):
            if target:
                _write_whole(target, data)


def _write_whole(path: str, data: object) -> None:
    """``data`` as JSON at ``path``, whole or not at all (a temporary file renamed over it)."""
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w") as f:
            json.dump(data, f)
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(temporary)


def _silent_interrupt(
    kind: type[BaseException], value: BaseException, tb: TracebackType | None
) -> None:
    """``sys.excepthook`` for a KeyboardInterrupt: no traceback (Python then ends the process
    by SIGINT, after its exit handlers, as it does for any uncaught KeyboardInterrupt)."""
    if not issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)


#: The signals whose handlers a copy of the launcher inherits (its own and torchrun's agent's).
_INHERITED = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)


def _as_fresh_process() -> None:
    """In a copy of the launcher: what a fresh interpreter that torchrun starts with
    ``python -u`` in a session of its own would have: its own session (a Ctrl-C at the
    terminal reaches the launcher only, which passes it on), the default signal handlers
    and an empty signal mask, torch's thread count from ``OMP_NUM_THREADS``, line-buffered
    output, NumPy's global generator seeded afresh (Python's ``random`` reseeds itself
    after a fork), and no filters the launcher put on torch's loggers."""
    with contextlib.suppress(OSError):
        os.setsid()
    for signum in _INHERITED:
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    launcher = sys.modules.get("gradsync.launch.failures")
    if launcher is not None:
        launcher.unquiet()


def _end_as_python_would(interrupted: bool) -> None:
    """In a copy of the launcher, which multiprocessing ends with ``os._exit``: wait for the
    threads, then run the exit handlers, as Python does at exit; after a KeyboardInterrupt,
    end by SIGINT as Python does (multiprocessing would call it success). The handlers the
    launcher's imports registered run too, as the same imports register them in a fresh
    interpreter; the launcher registers none of its own (no ``TemporaryDirectory``: its
    finalizer would run here)."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    if interrupted:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


def main(argv: list[str] | None = None) -> None:
    forked = multiprocessing.parent_process() is not None  # --start-method fork
    if forked:
        _as_fresh_process()
    interrupted = False
    try:
        _run(argv)
    except KeyboardInterrupt:
        interrupted = True
        raise
    except SystemExit as end:
        # sys.exit() or sys.exit(None): success, as Python says; torchrun's agent would wait
        # forever for a copy that ends so (it takes only status 0 for a return).
        if not forked or end.code is not None:
            raise
    finally:
        if forked:
            _end_as_python_would(interrupted)


def _run(argv: list[str] | None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        sys.exit("usage: python -m gradsync.launch.worker SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    module = args[0] == "-m"
    if module:
        target, rest = args[1], args[2:]
        sys.argv = [target, *rest]
        sys.path[0] = os.getcwd()  # as `python -m module` does
    else:
        target, rest = args[0], args[1:]
        sys.argv = [target, *rest]
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` does
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.excepthook = _silent_interrupt
        raise
    except BaseException as err:
        record(err)
        line = " ".join(str(err).split())[:200]
        print(
            f"gradsync: rank {os.environ.get('RANK', '?')} failed: {type(err).__name__}: {line}",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(EXIT_CODE)


if __name__ == "__main__":
    main()
