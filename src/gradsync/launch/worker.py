"""What each process started by `gradsync launch` runs: the user's script, as ``python
script.py`` would (or ``python -m module``), recording an exception for the launcher.

    python -m gradsync.launch.worker SCRIPT [ARGS...]
    python -m gradsync.launch.worker -m MODULE [ARGS...]

An exception is written to torchrun's per-worker error file (``TORCHELASTIC_ERROR_FILE``)
with the rank, the time, the traceback and whether it looks like the consequence of
another rank's failure (a collective that lost its peer); `gradsync launch` then prints
the first cause as one block instead of every rank's traceback. ``SystemExit`` passes
through unchanged.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback

#: Words of errors that follow another rank's failure (its connections closed, a timeout).
_CONSEQUENCE = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout",
                "connection refused", "peer closed", "stopped answering")


def _user_traceback(err: BaseException) -> str:
    """The traceback from the user's code on (without this wrapper's and runpy's frames)."""
    te = traceback.TracebackException.from_exception(err)
    frames = list(te.stack)
    while frames and (frames[0].filename == __file__ or "runpy" in frames[0].filename):
        frames.pop(0)
    te.stack = traceback.StackSummary.from_list(frames)
    return "".join(te.format())


def _record(err: BaseException) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    text = f"{type(err).__name__}: {err}"
    if not path:
        return
    data = {
        "message": {
            "message": text,
            "extraInfo": {
                "py_callstack": _user_traceback(err),
                "timestamp": str(int(time.time())),
                "gradsync_time": time.time(),
                "gradsync_rank": os.environ.get("RANK", "?"),
                "gradsync_consequence": any(w in text.lower() for w in _CONSEQUENCE),
            },
        }
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        sys.exit("usage: python -m gradsync.launch.worker SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    module = args[0] == "-m"
    if module:
        target, rest = args[1], args[2:]
        sys.argv = [target, *rest]
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
    except BaseException as err:
        _record(err)
        line = " ".join(str(err).split())[:200]
        print(f"gradsync: rank {os.environ.get('RANK', '?')} failed: {type(err).__name__}: {line}",
              file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
