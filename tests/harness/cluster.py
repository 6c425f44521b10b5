"""Parent side of the cluster tests (real SLURM, real ``mpiexec``, Kubernetes pods reproduced):
the environment a job is started from, the reports ``tests/scripts/cluster_train.py`` writes,
and the checks on them (one group, the ranks' placement, equal to one process)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness.checks import assert_matches_one_process

#: The training job every cluster test starts: ``python cluster_train.py OUT``.
TRAIN = Path(__file__).resolve().parents[1] / "scripts" / "cluster_train.py"

#: Variables of a scheduler, an MPI launcher or torchrun that the test process may have
#: inherited (a suite run inside a SLURM job): none of them reaches a job the test starts.
_OUTSIDE = (
    "GRADSYNC_",
    "PET_",
    "SLURM_",
    "SRUN_",
    "SBATCH_",
    "PMI_",
    "PMIX_",
    "MPI_LOCAL",
    "HYDRA_",
    "OMPI_",
    "MV2_",
    "TORCHELASTIC_",
)
_TORCHRUN = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MPIRUN_ID",
    "JOB_NAME",
)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's variables without any scheduler's or launcher's, this interpreter's
    folder first on PATH (``gradsync``, ``mpiexec``), one thread per process, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_OUTSIDE) and k not in _TORCHRUN}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env["DS_ACCELERATOR"] = "cpu"
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_each(
    envs: list[dict[str, str]], out: Path, cwd: Path, timeout: float = 240
) -> tuple[list[int], str]:
    """``python cluster_train.py OUT`` once per environment, all at once (what a launcher or
    an operator does for its processes or pods); their exit codes and their output."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(TRAIN), str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=cwd,
        )
        for env in envs
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return [p.returncode for p in procs], "".join(outputs)


def reports(folder: Path) -> list[dict[str, Any]]:
    """What each rank wrote, in rank order."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]


def assert_one_group_equal_to_one_process(
    folder: Path, *, local_ranks: list[int], local_main: list[bool], output: str = ""
) -> list[dict[str, Any]]:
    """Two ranks wrote their report from one 2-rank group (backend "auto" chose DDP), with
    these local ranks and local-main flags, and trained exactly what one process trains on
    the same global windows (fp32, 1e-5; the two ranks bitwise equal). Returns the reports."""
    got = reports(folder)
    assert [r["rank"] for r in got] == [0, 1], output
    assert [r["group_rank"] for r in got] == [0, 1], output
    for r in got:
        assert r["world_size"] == r["group_size"] == 2, r
        assert r["backend"] == "ddp", r
    assert [r["local_rank"] for r in got] == local_ranks
    assert [r["local_main"] for r in got] == local_main
    assert [r["main"] for r in got] == [True, False]
    assert len(got[0]["windows"]) >= 2, "the job must take several optimizer steps"
    assert_matches_one_process(got, samples=got[0]["samples"])
    return got
