"""Signals `gradsync launch` passes on to its workers itself.

torchrun's agent handles SIGTERM, SIGINT, SIGHUP and SIGQUIT (it stops the workers). SLURM
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
from collections.abc import Iterator
from pathlib import Path

#: The signals forwarded to the workers (POSIX only).
FORWARDED: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGUSR1",) if hasattr(signal, name))


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
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
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
        _say(f"{name} received; sent it to the {len(reached)} worker process(es) of this node "
             f"(pids {', '.join(map(str, reached))}) and waiting for them to exit")
    else:
        _say(f"{name} received before any worker process started here; nothing to send it to")


@contextlib.contextmanager
def forwarding() -> Iterator[None]:
    """While inside, the signals of FORWARDED that reach this process go to its workers.

    Only in the main thread (where Python runs signal handlers); the previous handlers are
    put back on leaving.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in FORWARDED}
    for sig in FORWARDED:
        signal.signal(sig, _handler)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
