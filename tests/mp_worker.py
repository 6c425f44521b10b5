"""One rank of a scenario run: join the run's process group, run each scenario, write results.

    python -m torch.distributed.run --standalone --nproc-per-node 2 mp_worker.py SPEC OUT

SPEC is what ``harness.run_scenarios`` pickled: the group's setup function and, per scenario
name, the function's module, its qualified name and its parameters.
"""

from __future__ import annotations

import importlib
import json
import pickle
import sys
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gradsync import audit


def find(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


def main() -> None:
    spec_path, out_dir = sys.argv[1:3]
    spec = pickle.loads(Path(spec_path).read_bytes())
    find(*spec["setup"])()
    rank = dist.get_rank()
    results: dict[str, dict[str, object]] = {}
    for name, (module, qualname, params) in spec["scenarios"].items():
        try:
            results[name] = {"ok": True, "result": find(module, qualname)(**params), "error": None}
        except Exception:
            results[name] = {"ok": False, "result": None, "error": traceback.format_exc()}
        recorder = audit.recorder_of()
        if recorder is not None:
            recorder.clear()
        dist.barrier()
        # Written after every scenario, so a crash later keeps what was done.
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
