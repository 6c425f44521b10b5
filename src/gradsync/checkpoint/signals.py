"""A scheduler's notice that the job will be stopped (SIGTERM, SLURM's SIGUSR1): remember that
it arrived; the Accelerator saves a checkpoint when the next window starts and exits
(``save_on_signal``), and on SLURM may requeue the job (``requeue``)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
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
        log.warning("gradsync: requeue=True, but this is not a SLURM job (no SLURM_JOB_ID): not requeued")
        return False
    if shutil.which(command[0]) is None:
        log.warning("gradsync: requeue=True, but scontrol is not on the PATH: job %s not requeued", command[2])
        return False
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        log.warning("gradsync: %s failed: %s", " ".join(command), " ".join(done.stderr.split())[:300])
        return False
    return True
