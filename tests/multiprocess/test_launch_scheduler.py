"""`gradsync launch` for real, as a scheduler starts it: the script's own flags reach every rank
untouched (``--micro 3 --max 5`` would abbreviate gradsync's and torchrun's flags), SIGUSR1
sent to the launcher reaches every worker while the launcher waits for them, and Kubeflow's
``PET_*`` variables alone form the 2-rank group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradsync.launch.cluster import usable_cpus

RECORD = """
import json, os, signal, sys, time
from pathlib import Path

import torch
import torch.distributed as dist

from gradsync import Accelerator

got = []
signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signal.Signals(signum).name))
out = Path(os.environ["RECORD_DIR"])
accel = Accelerator()
total = torch.tensor([float(accel.rank)])
dist.all_reduce(total)
report = {"rank": accel.rank, "world_size": accel.world_size, "local_rank": accel.local_rank,
          "local_main": accel.is_local_main_process, "rank_sum": float(total),
          "args": sys.argv[1:], "omp": os.environ.get("OMP_NUM_THREADS")}
if os.environ.get("WAIT_FOR_SIGNAL"):
    (out / f"ready{accel.rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    report["signals"] = got
(out / f"rank{accel.rank}.json").write_text(json.dumps(report))
accel.end()
"""

_OUTSIDE = ("GRADSYNC_", "PET_", "SLURM_", "PMI_", "OMPI_", "MV2_")
_TORCHRUN = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's variables without any scheduler's or launcher's, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_OUTSIDE) and k not in _TORCHRUN}
    env.update(extra)
    return env


def reports(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "record.py"
    path.write_text(RECORD)
    (tmp_path / "out").mkdir()
    return path


def test_script_flags_reach_every_rank_and_sigusr1_reaches_every_worker(script, tmp_path):
    out = tmp_path / "out"
    env = clean_env(RECORD_DIR=str(out), WAIT_FOR_SIGNAL="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gradsync",
            "launch",
            "--nproc-per-node",
            "2",
            str(script),
            "--micro",
            "3",
            "--max",
            "5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 150
        while not all((out / f"ready{r}").exists() for r in (0, 1)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGUSR1)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stdout + stderr  # the launcher waited for its workers
    got = reports(out)
    assert [r["rank"] for r in got] == [0, 1], stdout + stderr
    for r in got:
        assert r["args"] == ["--micro", "3", "--max", "5"]
        assert r["world_size"] == 2 and r["rank_sum"] == 1.0
        assert r["signals"] == ["SIGUSR1"]
    pids = sorted(int((out / f"ready{r}").read_text()) for r in (0, 1))
    line = next(x for x in stderr.splitlines() if "SIGUSR1 received" in x)
    assert (
        f"sent it to the 2 worker process(es) of this node (pids {pids[0]}, {pids[1]})" in line
    ), stderr


def test_kubeflow_pet_variables_alone_form_the_group(script, tmp_path):
    out = tmp_path / "out"
    env = clean_env(RECORD_DIR=str(out), PET_NPROC_PER_NODE="2", PET_NNODES="1")
    proc = subprocess.run(
        [sys.executable, "-m", "gradsync", "launch", str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = reports(out)
    assert [(r["rank"], r["local_rank"], r["local_main"]) for r in got] == [
        (0, 0, True),
        (1, 1, False),
    ]
    cpus = usable_cpus(env)  # affinity, cgroup quota
    for r in got:
        assert r["world_size"] == 2 and r["rank_sum"] == 1.0 and r["args"] == []
        assert r["omp"] == str(max(1, cpus // 2))  # split over the node's 2 processes
    assert "warning" not in (proc.stdout + proc.stderr).lower(), proc.stdout + proc.stderr
