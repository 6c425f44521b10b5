"""Kubernetes pods, reproduced (no cluster here): two processes, each with exactly the
variables the Kubeflow operator sets in its pod, running the container's command.

* A PyTorchJob (one master and one worker replica, ``python train.py``): the training
  operator sets ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK`` and
  ``PYTHONUNBUFFERED``, no ``LOCAL_RANK`` (and since v1.7 also ``PET_NPROC_PER_NODE``,
  ``PET_NODE_RANK``, ``PET_NNODES``). One 2-rank group; each pod is a node of its own, so
  local rank 0 and ``is_local_main_process`` on both; equal to one process.
* A Kubeflow Trainer TrainJob of two nodes sets torchrun's ``PET_*`` options for a launcher;
  started with a bare ``python train.py``, each pod fails in one line and nothing trains.
"""

from __future__ import annotations

import pytest

from harness.cluster import (
    assert_one_group_equal_to_one_process,
    clean_env,
    free_port,
    reports,
    start_each,
)


def torchrun_options(rank: int) -> dict[str, str]:
    """What training operator v1.7 and later add (nprocPerNode left at its default)."""
    return {"PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": str(rank), "PET_NNODES": "2"}


@pytest.mark.parametrize("operator", ["v1.6", "v1.7+"])
def test_pytorchjob_pods_form_one_group_each_its_own_node(tmp_path, operator):
    out = tmp_path / "out"
    port = str(free_port())
    envs = [
        clean_env(
            PYTHONUNBUFFERED="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            WORLD_SIZE="2",
            RANK=str(rank),
            **(torchrun_options(rank) if operator == "v1.7+" else {}),
        )
        for rank in (0, 1)
    ]  # the master pod, then worker 0
    codes, output = start_each(envs, out, tmp_path)
    assert codes == [0, 0], output
    got = assert_one_group_equal_to_one_process(
        out, local_ranks=[0, 0], local_main=[True, True], output=output
    )
    seen = [r["environment"] for r in got]
    assert [(e["scheduler"], e["node_rank"], e["nnodes"], e["local_world_size"]) for e in seen] == [
        ("torchrun", 0, 2, 1),
        ("torchrun", 1, 2, 1),
    ]


def test_trainjob_pods_started_without_a_launcher_fail_in_one_line(tmp_path):
    out = tmp_path / "out"
    port = str(free_port())
    envs = [
        clean_env(
            PYTHONUNBUFFERED="1",
            PET_NNODES="2",
            PET_NPROC_PER_NODE="1",
            PET_NODE_RANK=str(node),
            PET_MASTER_ADDR="127.0.0.1",
            PET_MASTER_PORT=port,
        )
        for node in (0, 1)
    ]
    codes, output = start_each(envs, out, tmp_path, timeout=120)
    assert all(code != 0 for code in codes), output
    errors = [line for line in output.splitlines() if line.startswith("gradsync.errors.UsageError")]
    assert len(errors) == 2, output  # one line from each pod
    for line in errors:
        assert line.startswith(
            "gradsync.errors.UsageError: Kubeflow set torchrun's PET_* options "
            "(PET_NNODES=2, PET_NPROC_PER_NODE=1)"
        ), line
        assert "run `gradsync launch train.py`" in line, line
    assert reports(out) == [] and not out.exists()  # nothing trained
