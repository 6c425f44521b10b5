"""What the small one-question benchmarks share (token_weighting.py, selfcheck_overhead.py):
the model sizes, starting a worker group (2 ranks unless asked) on the script itself, and writing the result
as JSON and a Markdown table."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The sync-overhead benchmark's MLP (4.2 M parameters), and a tiny one for smoke runs.
SIZES = {"width": 1024, "depth": 3, "features": 1024, "outputs": 16, "micro_batch": 8}
QUICK_SIZES = {"width": 64, "depth": 2, "features": 64, "outputs": 4, "micro_batch": 8}


def run_workers(script: str, spec: dict[str, Any], title: str, nproc: int = 2) -> dict[str, Any] | None:
    """Run ``script --worker SPEC DIR`` on ``nproc`` ranks; the ``result.json`` rank 0 wrote,
    or None (with the workers' output on stderr) when there is none."""
    work = Path(tempfile.mkdtemp(prefix="gradsync-bench-"))
    (work / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"{title} ...", flush=True)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", str(Path(script).resolve()), "--worker",
                           str(work / "spec.json"), str(work)], env=env, capture_output=True, text=True)
    if not (work / "result.json").exists():
        print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads((work / "result.json").read_text())
    return result


def write(out_dir: str, name: str, result: dict[str, Any], table: str) -> None:
    """``name``.json and ``name``.md in ``out_dir``; the table is printed too."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(table)
    print(table)


def parser(description: str, quick: str) -> argparse.ArgumentParser:
    """The options every small benchmark takes: ``--out``, ``--k``, ``--quick`` (``quick``:
    its help) and the hidden ``--worker SPEC DIR`` its ranks are started with."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default="benchmark-results")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "DIR"), help=argparse.SUPPRESS)
    return p


def ran_as_worker(args: argparse.Namespace, worker: Callable[[dict[str, Any], Path], None]) -> bool:
    """Run ``worker(spec, folder)`` when this process is one of the ranks ``run_workers``
    started (``--worker``); whether it was."""
    if not args.worker:
        return False
    worker(json.loads(Path(args.worker[0]).read_text()), Path(args.worker[1]))
    return True
