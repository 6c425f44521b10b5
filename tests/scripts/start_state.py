"""What a worker of `gradsync launch` starts with, for the start-method tests: writes
``OUT/rank{R}.json`` (its arguments, ``__name__``, ``sys.path[0]``, the handlers of the stop
signals, its signal mask, torch's thread count, whether it leads its own session, whether
its output is written through, a draw of NumPy's global generator), registers an exit
handler that writes ``OUT/exit{R}`` once a thread it started has finished, trains one step
on a 2-rank gloo group, then ends by MODE: ``raise`` (rank 1 raises once rank 0 has ended) or
``exit`` (every rank calls ``sys.exit()``).

    gradsync launch --nproc-per-node 2 [--start-method fork] start_state.py OUT MODE
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

out, mode = Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])


def handler(signum: int) -> str:
    found = signal.getsignal(signum)
    return getattr(found, "__name__", str(found))


state = {
    "argv": sys.argv[1:],
    "name": __name__,
    "path0": sys.path[0],
    "handlers": {
        s.name: handler(s)
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
    },
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "threads": torch.get_num_threads(),
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "own_session": os.getsid(0) == os.getpid(),
    "written_through": sys.stdout.write_through,
    "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
}
draw = int(np.random.randint(2**31))
finished = []
# Python waits for the threads before it runs the exit handlers.
worker = threading.Thread(target=lambda: (time.sleep(1), finished.append(True)))
worker.start()
atexit.register(
    lambda: (out / f"exit{rank}").write_text("after the thread" if finished else "before")
)
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
(out / f"draw{rank}").write_text(str(draw))
if mode == "exit":
    sys.exit()
if rank == 1:
    # Once rank 0 has ended by itself (its exit handler ran): the launcher then stops no one.
    waited = time.monotonic()
    while not (out / "exit0").exists() and time.monotonic() - waited < 120:
        time.sleep(0.05)
    raise ValueError("rank 1 raises after its step, on purpose")
