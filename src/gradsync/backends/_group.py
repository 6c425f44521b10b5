"""Creating and releasing the process group for the distributed adapters (no backend logic here)."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from gradsync import audit
from gradsync._support import environment
from gradsync._support.dist import is_distributed, rank_info
from gradsync.errors import UsageError

__all__ = [
    "broadcast_from_rank0",
    "ensure_process_group",
    "local_device",
    "rank_info",
    "release_process_group",
    "use_cuda",
]

log = logging.getLogger("gradsync")

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def use_cuda() -> bool:
    return torch.cuda.is_available() and os.environ.get("GRADSYNC_DEVICE", "") != "cpu"


def local_device() -> torch.device:
    """cuda:LOCAL_RANK where CUDA is present, else the CPU."""
    if use_cuda():
        index = environment.detect().local_rank
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def ensure_process_group(
    backend_name: str, *, want_audit: bool, self_check: bool = False, timeout: float | None = None
) -> bool:
    """Join the running process group, or create one from the launcher's environment.

    A group gradsync creates goes through the audit's counting wrapper when ``want_audit``
    (recording) or, on gloo, ``self_check`` (the deferral self-check: recording off until it
    checks).
    Returns True when gradsync created the group (and so should destroy it).
    """
    if is_distributed():
        if want_audit and audit.recorder_of() is None:
            log.warning(
                "gradsync: audit=True, but the process group was created outside gradsync and "
                "cannot be counted; let gradsync create it (do not call init_process_group)"
            )
        return False
    where = environment.detect()
    if where.problem is not None:
        raise UsageError(where.problem)
    for key, value in where.process_group_variables().items():
        os.environ.setdefault(key, value)  # what init_process_group (env://) reads
    missing = [v for v in _LAUNCH_VARS if v not in os.environ]
    if missing:
        raise UsageError(
            f"backend={backend_name!r} needs a process group, but there is none and "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set; launch with "
            "`gradsync launch --nproc-per-node N script.py` (or torchrun, srun, mpiexec), call "
            "torch.distributed.init_process_group() first, or use backend='single' for one process"
        )
    device = "cuda" if use_cuda() else "cpu"
    # The self-check's counting wrapper is the default on gloo only: over NCCL it runs when
    # audit=True asks for the wrapper anyway (tests/multiprocess/test_gpu.py exercises that path).
    if want_audit or (self_check and device == "cpu"):
        audit.register()
        pg_backend = audit.AUDIT_BACKEND[device]
    else:
        pg_backend = "nccl" if device == "cuda" else "gloo"
    if timeout is not None:
        dist.init_process_group(backend=pg_backend, timeout=timedelta(seconds=timeout))
    else:
        dist.init_process_group(backend=pg_backend)
    recorder = audit.recorder_of()
    if recorder is not None and not want_audit:
        recorder.enabled = False  # the self-check turns it on for the micro-steps it checks
    atexit.register(release_process_group)
    return True


def broadcast_from_rank0(model: torch.nn.Module) -> None:
    """Start every rank from rank 0's parameters and buffers (what DDP does when it wraps)."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)


#: How long ``release_process_group`` lets the backend's worker threads take the GIL.
_THREADS_FINISH_S = 0.05


def release_process_group() -> None:
    """Destroy the group and free what still holds it, while the interpreter is alive.

    Wrapped models (DDP's reducer, FSDP states) keep the backend alive through reference
    cycles; left to interpreter shutdown, its worker threads can outlive the runtime and
    abort the process ("terminate called without an active exception") after all work is
    done. Collecting the cycles here joins those threads cleanly.

    First the GIL is let go for a moment: a collective a communication hook issued from a
    worker thread (torch's PowerSGD hook chains its all-reduces in futures) may leave that
    thread waiting for the GIL to free the tensors it held; one still waiting when the
    interpreter finalizes aborts the process (5 exits in 6 after a PowerSGD run here, none
    in 6 with the pause).
    """
    time.sleep(_THREADS_FINISH_S)
    if is_distributed():
        dist.destroy_process_group()
    gc.collect()
