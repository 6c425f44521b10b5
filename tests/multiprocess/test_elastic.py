"""An elastic job that loses a node keeps its global batch and its data order: two
``gradsync launch`` agents on this machine (``--nnodes 1:2``, a c10d rendezvous), the
second one killed with its worker after a checkpoint; the survivor restarts, resumes on one
process with k doubled (the launcher passes the global batch, not k), trains every sample
of every epoch exactly once, and ends where one process does on the same global windows."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from harness.cluster import free_port
from scenarios.common import reference_on

pytestmark = __import__("pytest").mark.multiprocess
SCRIPT = Path(__file__).parents[1] / "scripts" / "resume_train.py"


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_lost_node_keeps_the_global_batch_and_every_sample(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])})
    cmd = [sys.executable, "-m", "gradsync", "launch", "--nnodes", "1:2"]
    cmd += ["--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    cmd += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", "last_call_timeout=2"]
    cmd += ["--max-restarts", "2", "--global-batch-size", "16", "--micro-batch-size", "2"]
    cmd += [str(SCRIPT), str(tmp_path), "--backend", "ddp", "--dropout", "0"]
    cmd += ["--global-batch-size", "0", "--save-every", "4", "--boundary-only"]
    cmd += ["--log-windows", "--kill-node", "1:8"]
    logs = [open(tmp_path / f"agent{i}.log", "w") for i in range(2)]
    survivor = subprocess.Popen(cmd, stdout=logs[0], stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while not _listening(port):  # the survivor hosts the rendezvous store
        assert survivor.poll() is None and time.monotonic() < deadline, "no rendezvous store"
        time.sleep(0.1)
    lost = subprocess.Popen(cmd, stdout=logs[1], stderr=subprocess.STDOUT, env=env)
    try:
        assert survivor.wait(timeout=600) == 0, (tmp_path / "agent0.log").read_text()[-6000:]
    finally:
        for proc in (survivor, lost):
            if proc.poll() is None:
                proc.kill()
        for log in logs:
            log.close()
    assert lost.wait(timeout=60) != 0  # killed with its worker
    lines = {
        r: [json.loads(x) for x in (tmp_path / f"windows_rank{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    }
    after = [x for x in lines[0] if x["attempt"] > 0]
    assert after and all(x["world"] == 1 for x in after), lines[0]
    resumed_at = after[0]["step"] - 1  # the checkpoint the survivor resumed from
    assert resumed_at >= 2
    before = [
        lines[0][i]["window"] + lines[1][i]["window"]
        for i in range(resumed_at)
        if lines[0][i]["attempt"] == 0
    ]
    windows = before + [x["window"] for x in after]
    sizes = [sum(len(mb) for mb in w) for w in windows]
    assert max(sizes) == 16 and sizes.count(16) >= 4, sizes  # k = 4, then 8: 16 per update
    assert len(after[0]["window"]) in (8, 5, 6, 7, 4, 3, 2, 1)  # micro-batches on one process
    epochs, seen = [], []
    for window in windows:
        seen.extend(i for mb in window for i in mb)
        if len(seen) >= 44:
            epochs.append(sorted(seen))
            seen = []
    assert seen == [] and len(epochs) == 3
    assert all(epoch == list(range(44)) for epoch in epochs)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    ref = reference_on(windows)
    diff = max(float((ref[k] - final[k]).abs().max()) for k in ref)
    assert diff < 1e-5, diff
