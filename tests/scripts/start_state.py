"""What a worker of `gradsync launch` starts with, for the start-method tests: writes
``OUT/rank{R}.json`` (its arguments, ``__name__``, ``sys.path[0]``, the handlers of the stop
signals, its signal mask, torch's thread count), registers an exit handler that writes
``OUT/exit{R}``, trains one step on a 2-rank gloo group, then rank 1 raises.

    gradsync launch --nproc-per-node 2 [--start-method fork] start_state.py OUT
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])


def handler(signum: int) -> str:
    found = signal.getsignal(signum)
    return getattr(found, "__name__", str(found))


state = {
    "argv": sys.argv[1:],
    "name": __name__,
    "path0": sys.path[0],
    "handlers": {s.name: handler(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                              signal.SIGQUIT, signal.SIGUSR1)},
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "threads": torch.get_num_threads(),
    "omp": os.environ.get("OMP_NUM_THREADS"),
}
atexit.register(lambda: (out / f"exit{rank}").write_text("ran"))
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.ones(2, 4)).sum().backward()
for p in model.parameters():
    dist.all_reduce(p.grad)
optimizer.step()
state["weight_sum"] = float(model.weight.sum())
dist.destroy_process_group()
(out / f"rank{rank}.json").write_text(json.dumps(state))
if rank == 1:
    raise ValueError("rank 1 raises after its step, on purpose")
