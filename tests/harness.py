"""Run many scenarios in ONE real gloo process group and hand back what each rank wrote.

Starting a group costs seconds, so a test module launches its scenarios once
(module-scoped fixture) and its tests assert on the results in the parent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "mp_worker.py"


class ScenarioError(AssertionError):
    pass


class Results:
    """results[name] -> list of per-rank dicts; raises with the worker's traceback on failure."""

    def __init__(self, by_rank: list[dict[str, Any]], log: str) -> None:
        self.by_rank = by_rank
        self.log = log

    def __getitem__(self, name: str) -> list[dict[str, Any]]:
        out = []
        for rank, results in enumerate(self.by_rank):
            if name not in results:
                raise ScenarioError(f"rank {rank} wrote no result for {name!r}; log:\n{self.log[-4000:]}")
            entry = results[name]
            if not entry["ok"]:
                raise ScenarioError(f"scenario {name!r} failed on rank {rank}:\n{entry['error']}")
            out.append(entry["result"])
        return out

    def error(self, name: str) -> list[str]:
        """The error text each rank recorded for a scenario expected to fail."""
        return [results[name]["error"] or "" for results in self.by_rank]


def run_scenarios(
    module: str,
    scenarios: dict[str, dict[str, Any]],
    *,
    nproc: int = 2,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> Results:
    """Launch ``nproc`` ranks that run ``scenarios`` (name -> {"fn": ..., params}) from ``module``."""
    out = Path(tempfile.mkdtemp(prefix="gradsync-mp-"))
    spec = out / "scenarios.json"
    spec.write_text(json.dumps(scenarios))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", "--max-restarts=0",
        str(WORKER), module, str(spec), str(out),
    ]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE) + os.pathsep + full_env.get("PYTHONPATH", "")})
    full_env.update(env or {})
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=HERE)
    log = proc.stdout + proc.stderr
    by_rank = []
    for rank in range(nproc):
        path = out / f"rank{rank}.json"
        if not path.exists():
            raise ScenarioError(f"rank {rank} wrote no results (exit {proc.returncode}); log:\n{log[-6000:]}")
        by_rank.append(json.loads(path.read_text()))
    # A worker may abort at exit after writing everything (seen with DeepSpeed): the files decide.
    return Results(by_rank, log)
