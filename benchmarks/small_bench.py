"""What the small one-question benchmarks share (token_weighting.py, selfcheck_overhead.py):
the model sizes, starting a worker group (2 ranks unless asked) on the script itself, and writing the result
as JSON and a Markdown table."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The sync-overhead benchmark's MLP (4.2 M parameters), and a tiny one for smoke runs.
SIZES = {"width": 1024, "depth": 3, "features": 1024, "outputs": 16, "micro_batch": 8}
QUICK_SIZES = {"width": 64, "depth": 2, "features": 64, "outputs": 4, "micro_batch": 8}


def run_workers(
    script: str, spec: dict[str, Any], title: str, nproc: int = 2
) -> dict[str, Any] | None:
    """Run ``worker(spec, DIR)`` of ``script`` on ``nproc`` ranks; the ``result.json`` rank 0
    wrote, or None (with the workers' output on stderr) when there is none."""
    work = Path(tempfile.mkdtemp(prefix="gradsync-bench-"))
    (work / "spec.json").write_text(json.dumps(spec))
    print(f"{title} ...", flush=True)
    failed = launch_ranks(script, "worker_in", [str(work)], nproc, work / "logs")
    if not (work / "result.json").exists():
        print(failed or "no result.json", file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads((work / "result.json").read_text())
    return result


def worker_in(work: str, worker: Callable[[dict[str, Any], Path], None]) -> None:
    """``worker(spec, work)`` with the spec ``run_workers`` wrote into ``work``."""
    worker(json.loads(Path(work, "spec.json").read_text()), Path(work))


def launch_ranks(
    script: str | Path,
    entry: str,
    args: list[str],
    nproc: int,
    log_dir: Path,
    timeout: float | None = None,
    quiet: bool = True,
    before: Callable[[], None] | None = None,
) -> str:
    """Run ``entry(*args)`` of the module at ``script`` on ``nproc`` ranks of one group; ""
    when every rank ended well, else what failed with the tail of the ranks' output (kept in
    ``log_dir``). ``entry`` may instead name a function of this module, which is then given
    the script module's ``worker``.

    This process is the ranks' torchrun agent (``elastic_launch``, the API behind ``torchrun
    --standalone``). Without a GPU the ranks are forks of it, started once torch and gradsync
    are imported here (seconds of CPU a fresh interpreter per rank would spend again; nothing
    of that is timed); with one, fresh interpreters (a process that asked for devices cannot
    fork ranks that use them). Past ``timeout`` seconds the ranks are stopped. ``quiet``: the
    ranks' standard output goes to ``log_dir`` too (else to this one's); ``before``: what
    each rank would do first and the forks may inherit (imports)."""
    import torch
    import torch._dynamo  # what the ranks' optimizers import on first use
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    import gradsync.accelerator  # noqa: F401

    for key in [k for k in os.environ if k.startswith("GRADSYNC_")]:
        del os.environ[key]  # the benchmark's own settings, not the environment's
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    fork = not torch.cuda.is_available()
    if fork and before is not None:
        before()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        start_method="fork" if fork else "spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL if quiet else Std.ERR),
    )
    timer = threading.Timer(timeout, os.kill, (os.getpid(), signal.SIGTERM)) if timeout else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        elastic_launch(config, _rank)(str(Path(script).resolve()), entry, *args)
        return ""
    except Exception as err:  # a rank failed, or the time ran out: the ranks' output says why
        logs = "".join(
            p.read_text(errors="replace")[-3000:] for p in sorted(log_dir.rglob("*.log"))
        )
        return f"{logs}{type(err).__name__}: {err}"
    finally:
        if timer is not None:
            timer.cancel()


def _rank(script: str, entry: str, *args: str) -> None:
    """One rank: ``entry(*args)`` of the module at ``script`` (or of this one, given the
    script's ``worker``)."""
    loaded = importlib.util.spec_from_file_location("gradsync_bench_script", script)
    assert loaded is not None and loaded.loader is not None, script
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    if hasattr(module, entry):
        getattr(module, entry)(*args)
    else:
        globals()[entry](*args, module.worker)


def write(out_dir: str, name: str, result: dict[str, Any], table: str) -> None:
    """``name``.json and ``name``.md in ``out_dir``; the table is printed too."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(table)
    print(table)


def parser(description: str, quick: str) -> argparse.ArgumentParser:
    """The options every small benchmark takes: ``--out``, ``--k``, ``--quick`` (``quick``:
    its help)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default="benchmark-results")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--quick", action="store_true", help=quick)
    return p
