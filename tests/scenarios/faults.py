"""A checkpoint write that fails for real, on every backend (run inside the workers): the
folder is on a small tmpfs that rank 0 fills until ENOSPC, or one rank's file-size limit
(RLIMIT_FSIZE) makes its writes fail with EFBIG. Each scenario saves a good checkpoint,
trains on, fails to save, then loads the good one and saves again once the fault is gone."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from gradsync import Accelerator, audit, latest_checkpoint

from scenarios.common import DEEPSPEED_PRELOAD as PRELOAD  # noqa: F401  (mp_worker.py)
from scenarios.common import Indexed, make_model


def setup_process_group() -> None:
    """The audited gloo group, which DeepSpeed adopts too (no C++ op builds on the CPU); its
    timeout is long, so a rank left waiting for a failed one would show as a CollectiveError
    only after minutes, never within the seconds a failure takes to agree on."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    audit.register()
    dist.init_process_group(audit.AUDIT_BACKEND["cpu"], timeout=timedelta(seconds=300))
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def _prepared(
    backend: str, stage: int | None, mesh: list[int] | None, seed: int
) -> tuple[Accelerator, Any, Any, Any]:
    options: dict[str, Any] = {"timeout": 300}
    if backend == "deepspeed":
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        options["deepspeed_config"] = {
            "zero_optimization": {"stage": stage},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
            "gradient_clipping": 0.0,
        }
    if mesh is not None:
        options["fsdp_mesh"] = tuple(mesh)
    accel = Accelerator(backend=backend, gradient_accumulation_steps=2, seed=0, **options)
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, opt, loader = accel.prepare(model, opt, DataLoader(Indexed(64), batch_size=2))
    # A hook that gathers the full weights (a collective on sharded backends) and adds a file.
    accel.register_save_state_pre_hook(
        lambda models, weights, folder: torch.save(
            len(weights), Path(folder) / f"hook_rank{dist.get_rank()}.pt"
        )
    )
    return accel, model, opt, loader


def _train(accel: Accelerator, model: Any, opt: Any, batches: Iterator[Any], micro: int) -> None:
    for _ in range(micro):
        x, y, _ = next(batches)
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()


def _weights(accel: Accelerator, model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in accel.get_state_dict(model).items()}


def fill(folder: Path) -> Path:
    """A file that takes every free byte of ``folder``'s filesystem (its writes end in ENOSPC)."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * chunk)
    return filler


@contextlib.contextmanager
def _fault(kind: str, folder: Path) -> Iterator[None]:
    """``enospc``: rank 0 fills the disk; ``efbig:<rank>``: that rank may write no file
    larger than 64 bytes. Undone (the disk emptied, the limit raised) on leaving."""
    filler: Path | None = None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    victim = int(kind.partition(":")[2] or -1)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG
    try:
        if kind == "enospc" and dist.get_rank() == 0:
            filler = fill(folder)
        if kind.startswith("efbig") and dist.get_rank() == victim:
            resource.setrlimit(resource.RLIMIT_FSIZE, (64, limit[1]))
        dist.barrier()
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, old_handler)
        if filler is not None:
            filler.unlink()
        dist.barrier()


def _listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != "filler")


def failed_save(
    *,
    backend: str,
    folder: str,
    read_only: str,
    fault: str,
    background: bool = False,
    stage: int | None = None,
    mesh: list[int] | None = None,
) -> dict[str, Any]:
    """Save ``good`` (with a save-state hook that gathers the weights); train a window; the
    save of ``bad`` (keep_last=1) fails under ``fault``; then ``good`` loads into a fresh
    Accelerator from ``read_only`` (the same folder seen through a read-only mount), where a
    save fails (EROFS), and ``after`` (keep_last=1) is saved."""
    root = Path(folder)
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    accel, model, opt, loader = _prepared(backend, stage, mesh, seed=0)
    batches = iter(loader)
    _train(accel, model, opt, batches, 4)
    good = accel.save_state(root / "good")
    saved = _weights(accel, model)
    _train(accel, model, opt, batches, 2)
    error, kind = "", ""
    with _fault(fault, root):
        started = time.time()
        try:
            accel.save_state(root / "bad", keep_last=1, background=background)
            accel.wait_for_checkpoint()
        except Exception as err:
            error, kind = str(err), type(err).__name__
        failed_at = time.time()
    listing = _listing(root)  # after the fault's barrier: rank 0 has removed what it removes
    latest = latest_checkpoint(root)
    fresh, fresh_model, _opt, _loader = _prepared(backend, stage, mesh, seed=1)
    fresh.load_state(Path(read_only) / "good")
    loaded = _weights(fresh, fresh_model)
    try:
        fresh.save_state(Path(read_only) / "bad")
        read_only_error = ""
    except Exception as err:
        read_only_error = f"{type(err).__name__}: {err}"
    _train(accel, model, opt, batches, 2)  # training goes on
    after = accel.save_state(root / "after", keep_last=1, background=background)
    accel.wait_for_checkpoint()
    dist.barrier()
    return {
        "error": error,
        "kind": kind,
        "started": started,
        "failed_at": failed_at,
        "listing_after_failure": listing,
        "latest": latest,
        "good": good,
        "bitwise": sorted(saved) == sorted(loaded)
        and all(torch.equal(saved[k], loaded[k]) for k in saved),
        "after": after,
        "listing_after_save": _listing(root),
        "read_only_error": read_only_error,
    }
