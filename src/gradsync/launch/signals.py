"""Signals `gradsync launch` passes on to its workers itself, and how it ends when it is stopped.

torchrun's agent handles SIGTERM, SIGINT, SIGHUP and SIGQUIT once the workers run: it sends
the same signal to each worker, waits for them (its grace period: ``--shutdown-timeout``,
else ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30 s), kills those still running, and raises.
`gradsync launch` then prints one line (``gradsync launch: stopped by SIGTERM: workers
stopped``) and exits with 128 + the signal's number (143 for SIGTERM, 130 for SIGINT), as a
shell reports a process a signal ended; before the workers start (``stopping``), such a
signal ends the launch the same way, with nothing to stop. SLURM
announces the end of a job's time or a preemption with SIGUSR1 (``--signal=USR1@90``), which
would kill the launcher and leave its workers to be killed mid-save; `gradsync launch` catches
it and sends it to each worker process of this node (the processes it started), then keeps
waiting for them: a worker that handles it (``Accelerator(save_on_signal=...)``) saves at its
next boundary and exits; one that does not is ended by it, as ``srun python train.py`` would be.

The workers are the launcher's child processes (torchrun starts each with ``Popen`` in this
process). The signal goes to each worker's process only, not to its process group: a
DataLoader's worker processes would die of a signal they do not handle.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

#: The signals that stop `gradsync launch` (torchrun's agent forwards them to the workers).
STOPPING: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)

#: The signals forwarded to the workers (POSIX only).
FORWARDED: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGUSR1",) if hasattr(signal, name)
)


def children(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """The live child processes of ``pid`` (Linux's /proc; empty where there is none).

    Args:
        pid: the parent.
        proc: where procfs is mounted.

    Returns:
        Their process ids, sorted.
    """
    found: set[int] = set()
    try:
        for task in (proc / str(pid) / "task").iterdir():
            found.update(int(word) for word in (task / "children").read_text().split())
        return sorted(found)
    except (OSError, ValueError):
        pass  # no /proc/PID/task/TID/children (a kernel without CONFIG_PROC_CHILDREN)
    try:
        entries = [p for p in proc.iterdir() if p.name.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "
        if len(fields) > 1 and fields[1] == str(pid):
            found.add(int(entry.name))
    return sorted(found)


def forward(signum: int, pids: list[int]) -> list[int]:
    """Send ``signum`` to each of ``pids``; the ones it reached.

    Args:
        signum: the signal.
        pids: the processes.

    Returns:
        The process ids that still existed.
    """
    reached = []
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            continue
        reached.append(pid)
    return reached


def _say(text: str) -> None:
    # os.write: safe inside a signal handler, unlike print to a buffered stream.
    with contextlib.suppress(OSError):
        os.write(2, f"gradsync: {text}\n".encode())


def _handler(signum: int, frame: object) -> None:
    name = signal.Signals(signum).name
    reached = forward(signum, children(os.getpid()))
    if reached:
        _say(
            f"{name} received; sent it to the {len(reached)} worker process(es) of this node "
            f"(pids {', '.join(map(str, reached))}) and waiting for them to exit"
        )
    else:
        _say(f"{name} received before any worker process started here; nothing to send it to")


@contextlib.contextmanager
def forwarding() -> Iterator[None]:
    """While inside, the signals of FORWARDED that reach this process go to its workers.

    Only in the main thread (where Python runs signal handlers); the previous handlers are
    put back on leaving.
    """
    with _handling(FORWARDED, _handler):
        yield


class Stopped(Exception):
    """A stop signal reached `gradsync launch` before torchrun's agent handled it (before the
    workers started)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _stop(signum: int, frame: object) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def stopping() -> Iterator[None]:
    """While inside, a signal of STOPPING raises ``Stopped`` until torchrun's agent puts its
    own handler in place (when it starts the workers; it raises its ``SignalException``).

    Only in the main thread; the handlers from before are put back on leaving, so that a
    second signal while the launcher prints its last line ends it as usual.
    """
    with _handling(STOPPING, _stop):
        yield


@contextlib.contextmanager
def _handling(signals: Iterable[int], handler: Callable[[int, Any], None]) -> Iterator[None]:
    """``handler`` for ``signals`` while inside, the previous handlers put back on leaving;
    nothing outside the main thread (the only one Python runs signal handlers in)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in signals}
    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def stopped(signum: int, stream: TextIO, *, workers: bool) -> int:
    """Say in one line that the launch was stopped by ``signum``; the exit status to use.

    Worker processes of this node still alive (a second signal cut torchrun's grace period
    short) are killed first, so that none outlives the launcher.

    Args:
        signum: the signal that stopped the launch.
        stream: where the line goes.
        workers: whether the workers had started (torchrun's agent stopped them).

    Returns:
        128 + ``signum`` (143 for SIGTERM, 130 for SIGINT).
    """
    name = signal.Signals(signum).name
    left = forward(signal.SIGKILL, children(os.getpid())) if hasattr(signal, "SIGKILL") else []
    for pid in left:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)
    if left:
        what = f"{len(left)} worker process(es) still running were killed"
    elif workers:
        what = "workers stopped"
    else:
        what = "before any worker started"
    print(f"gradsync launch: stopped by {name}: {what}", file=stream, flush=True)
    return 128 + signum
