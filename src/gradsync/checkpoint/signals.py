"""A scheduler's notice that the job will be stopped (SIGTERM, SLURM's SIGUSR1): remember that
it arrived; the Accelerator saves a checkpoint when the next window starts and exits
(``save_on_signal``), and on SLURM may requeue the job (``requeue``)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gradsync.errors import ConfigError

log = logging.getLogger("gradsync")

#: The exit status of a process whose save on a stop signal failed (a full disk, ...): not
#: 0, so the scheduler never takes the job for saved; it is not requeued either.
SAVE_FAILED_STATUS = 1


class SignalWatch:
    """Remembers which of ``signals`` arrived first (with ``save_on_signal``); the Accelerator
    acts on it when the next window starts."""

    def __init__(self, root: str | None, signals: Sequence[str] = ("SIGTERM",)) -> None:
        self.enabled = root is not None
        self.received: str | None = None
        if not self.enabled:
            return
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                "save_on_signal needs the Accelerator to be built in the main thread (only it "
                "can receive signals); build it there, or leave save_on_signal unset"
            )
        for name in signals:
            signal.signal(getattr(signal, name), self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name


def requeue_command(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """``scontrol requeue <job id>`` inside a SLURM job, else None."""
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    return ["scontrol", "requeue", job] if job else None


def requeue(environ: Mapping[str, str] | None = None) -> bool:
    """Requeue this SLURM job (its tasks are stopped and it starts again, under the same job
    id). Returns whether the request went through; a failure is one warning line."""
    command = requeue_command(environ)
    if command is None:
        log.warning(
            "gradsync: requeue=True, but this is not a SLURM job (no SLURM_JOB_ID): not requeued"
        )
        return False
    if shutil.which(command[0]) is None:
        log.warning(
            "gradsync: requeue=True, but scontrol is not on the PATH: job %s not requeued",
            command[2],
        )
        return False
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        log.warning(
            "gradsync: %s failed: %s", " ".join(command), " ".join(done.stderr.split())[:300]
        )
        return False
    return True


def stop_if_told(parts: Any, end: Callable[[], None]) -> None:
    """When the next window starts under ``save_on_signal``: if any rank received one of
    ``save_signals`` (one small all-reduce), every rank saves ``step-N`` into the signal
    folder, rank 0 requeues the SLURM job when asked, and the process exits with status 0;
    a failed save exits with ``SAVE_FAILED_STATUS`` and no requeue. ``parts``: the
    Accelerator's ``assembly.Parts``; ``end``: its ``end()``."""
    from gradsync._support import dist
    from gradsync.errors import CheckpointError, naming_collective

    received = parts.signals.received
    number = int(getattr(signal, received)) if received is not None else 0
    timeout = parts.config.timeout
    with parts.runner.own_collective(), naming_collective("the stop-signal check", timeout):
        told = -dist.min_over_ranks(-number, parts.backend.device)  # the signal any rank got
    if not told:
        return
    root = parts.config.signal_folder()
    assert root is not None
    path = os.path.join(root, f"step-{parts.prepared.steps_applied()}")
    what = signal.Signals(told).name
    main = dist.rank() == 0
    try:
        with naming_collective(f"save_state({path!r})", timeout):
            parts.state.save(path, None, pending=1)  # the batch just yielded is not trained on yet
    except CheckpointError as err:
        # Not saved: exit non-zero so the scheduler never believes it was, and no requeue.
        if main:
            print(
                f"gradsync: {what} received; {err}; not requeued, exiting with status "
                f"{SAVE_FAILED_STATUS}",
                file=sys.stderr,
                flush=True,
            )
        end()
        raise SystemExit(SAVE_FAILED_STATUS) from None
    if main:
        requeued = parts.config.requeue and requeue()
        print(
            f"gradsync: {what} received; saved {path}"
            + (", job requeued" if requeued else "")
            + ", exiting",
            file=sys.stderr,
            flush=True,
        )
    end()
    raise SystemExit(0)
