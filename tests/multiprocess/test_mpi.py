"""MPI launchers start the training script itself, one process per rank: gradsync forms the
group from their variables. ``mpiexec -n 2`` for real (MPICH's Hydra, from the ``mpich``
wheel of the test extra), and two processes with the variables Open MPI's ``mpirun`` sets
(no Open MPI binaries here); each trains one 2-rank group equal to one process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cluster import TRAIN, assert_one_group_equal_to_one_process, clean_env, start_each


def mpiexec() -> str:
    found = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
        "mpiexec"
    )
    if found is None:
        pytest.skip(
            "mpiexec not found: install the test extra (`pip install -e .[test]` brings the mpich wheel)"
        )
    return found


def test_mpiexec_two_ranks_train_one_group_equal_to_one_process(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, str(TRAIN), str(out)],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=tmp_path,
        timeout=240,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    got = assert_one_group_equal_to_one_process(
        out, local_ranks=[0, 1], local_main=[True, False], output=output
    )
    seen = [r["environment"] for r in got]  # what each rank read before the Accelerator
    assert [
        (e["scheduler"], e["rank"], e["world_size"], e["local_rank"], e["local_world_size"])
        for e in seen
    ] == [("mpich", 0, 2, 0, 2), ("mpich", 1, 2, 1, 2)]
    assert (
        seen[0]["master_addr"] == seen[1]["master_addr"] == "127.0.0.1"
    )  # every rank on this node
    assert seen[0]["master_port"] == seen[1]["master_port"] is not None


def test_open_mpi_variables_train_one_group_equal_to_one_process(tmp_path):
    """What Open MPI 5's mpirun (PRRTE) sets in each of two ranks on one node."""
    out = tmp_path / "out"
    namespace = f"prterun-{os.uname().nodename}-{os.getpid()}@1"
    envs = [
        clean_env(
            OMPI_COMM_WORLD_RANK=str(rank),
            OMPI_COMM_WORLD_SIZE="2",
            OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
            OMPI_COMM_WORLD_LOCAL_SIZE="2",
            OMPI_COMM_WORLD_NODE_RANK="0",
            OMPI_UNIVERSE_SIZE="2",
            OMPI_MCA_num_procs="2",
            PMIX_NAMESPACE=namespace,
            PMIX_RANK=str(rank),
        )
        for rank in (0, 1)
    ]
    codes, output = start_each(envs, out, tmp_path)
    assert codes == [0, 0], output
    got = assert_one_group_equal_to_one_process(
        out, local_ranks=[0, 1], local_main=[True, False], output=output
    )
    seen = [r["environment"] for r in got]
    assert [(e["scheduler"], e["rank"], e["local_rank"], e["job_id"]) for e in seen] == [
        ("openmpi", 0, 0, namespace),
        ("openmpi", 1, 1, namespace),
    ]
    assert (
        seen[0]["master_addr"] == "127.0.0.1" and seen[0]["master_port"] == seen[1]["master_port"]
    )
