"""One rank of a scenario run: join an audited gloo group, run each scenario, write results.

    python -m torch.distributed.run --standalone --nproc-per-node 2 mp_worker.py MODULE SPEC OUT
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from gradsync import audit


def main() -> None:
    module_name, spec_path, out_dir = sys.argv[1:4]
    scenarios = json.loads(Path(spec_path).read_text())
    module = importlib.import_module(module_name)
    setup = getattr(module, "setup_process_group", None)
    if setup is not None:
        setup()
    else:
        audit.register()
        dist.init_process_group(audit.AUDIT_BACKEND["cpu"], timeout=timedelta(seconds=180))
    rank = dist.get_rank()
    results: dict[str, dict[str, object]] = {}
    for name, params in scenarios.items():
        params = dict(params)
        fn = getattr(module, params.pop("fn"))
        try:
            results[name] = {"ok": True, "result": fn(**params), "error": None}
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
