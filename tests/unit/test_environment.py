"""gradsync._support.environment.detect on each launcher's and scheduler's variables, set as they set
them: torchrun, a PyTorchJob pod, SLURM job steps (captured from a real ``srun``), MPICH's
Hydra (captured from a real ``mpiexec``), Open MPI's and MVAPICH's launchers (no binaries
here: their documented variables), Kubeflow Trainer; SLURM's host lists and task counts; the
one-line problems when a job has several processes and no group can be formed."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from gradsync._support.environment import (
    Environment,
    derived_port,
    detect,
    expand_hostlist,
    tasks_on_node,
)


def place(e: Environment) -> tuple[object, ...]:
    return (
        e.scheduler,
        e.rank,
        e.world_size,
        e.local_rank,
        e.local_world_size,
        e.node_rank,
        e.nnodes,
    )


# -- nothing, torchrun, PyTorchJob ----------------------------------------------------


def test_nothing_set_is_one_process():
    e = detect({})
    assert e == Environment()
    assert place(e) == ("single", 0, 1, 0, 1, 0, 1) and e.problem is None
    assert e.process_group_variables() == {}


def test_torchrun_worker():
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "node01",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "job-7",
        "ROLE_RANK": "5",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    e = detect(env)
    assert place(e) == ("torchrun", 5, 8, 1, 4, 1, 2)
    assert (e.master_addr, e.master_port, e.job_id, e.problem) == ("node01", 29500, "job-7", None)
    assert e.process_group_variables() == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "node01",
        "MASTER_PORT": "29500",
    }


def test_pytorchjob_pod_is_a_node_of_its_own():
    """What the Kubeflow training operator sets in the worker pod of a master + 2 workers
    PyTorchJob: no LOCAL_RANK (one process per pod)."""
    env = {
        "PYTHONUNBUFFERED": "0",
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
        "WORLD_SIZE": "3",
        "RANK": "2",
    }
    e = detect(env)
    assert place(e) == ("torchrun", 2, 3, 0, 1, 2, 3)
    assert (e.master_addr, e.master_port, e.problem) == ("job-master-0", 23456, None)
    assert e.process_group_variables()["LOCAL_RANK"] == "0"


def test_pytorchjob_pod_with_torchrun_options_is_still_one_process_per_pod():
    """Training operator v1.7 and later also set torchrun's PET_* options (nprocPerNode at its
    default, auto); RANK and WORLD_SIZE still name the process (``python train.py`` in the pod)."""
    env = {
        "PYTHONUNBUFFERED": "0",
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
        "WORLD_SIZE": "2",
        "RANK": "1",
        "PET_NPROC_PER_NODE": "auto",
        "PET_NODE_RANK": "1",
        "PET_NNODES": "2",
    }
    e = detect(env)
    assert place(e) == ("torchrun", 1, 2, 0, 1, 1, 2) and e.problem is None


@pytest.mark.parametrize(
    ("env", "missing"),
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "x"},
            "a numeric MASTER_PORT",
        ),
    ],
)
def test_torchrun_variables_without_a_master_are_one_line(env, missing):
    problem = detect(env).problem
    assert problem == (
        f"RANK and WORLD_SIZE=2 are set but {missing} not: set them, or start the job "
        "with `gradsync launch`"
    )


def test_one_process_needs_no_master():
    assert detect({"RANK": "0", "WORLD_SIZE": "1"}).problem is None


# -- SLURM ---------------------------------------------------------------------------------

#: Task 1 of `srun -n 2` on one node, as slurm-wlm 22.05 sets it (captured; a few omitted).
SRUN_TASK1 = {
    "SLURM_CPUS_ON_NODE": "2",
    "SLURM_JOBID": "4",
    "SLURM_JOB_CPUS_PER_NODE": "2",
    "SLURM_JOB_ID": "4",
    "SLURM_JOB_NAME": "python",
    "SLURM_JOB_NODELIST": "vm",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_JOB_PARTITION": "local",
    "SLURM_LOCALID": "1",
    "SLURM_NNODES": "1",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "vm",
    "SLURM_NPROCS": "2",
    "SLURM_NTASKS": "2",
    "SLURM_PRIO_PROCESS": "0",
    "SLURM_PROCID": "1",
    "SLURM_STEPID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "vm",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_SUBMIT_HOST": "vm",
    "SLURM_TASKS_PER_NODE": "2",
}


def test_srun_task_on_one_node():
    e = detect(SRUN_TASK1)
    assert place(e) == ("slurm", 1, 2, 1, 2, 0, 1)
    assert (e.master_addr, e.master_port, e.job_id, e.problem) == (
        "vm",
        derived_port("slurm-4-0"),
        "4",
        None,
    )
    assert e.process_group_variables() == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "vm",
        "MASTER_PORT": str(derived_port("slurm-4-0")),
    }


def test_srun_task_on_the_second_of_several_nodes():
    """Task 5 of `srun --nodes 3 --ntasks-per-node 2` (job 77, step 3) plus one more node in the
    job: the step's own node list and task counts count, not the job's."""
    env = {
        "SLURM_PROCID": "5",
        "SLURM_STEP_NUM_TASKS": "6",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_STEP_NUM_NODES": "3",
        "SLURM_NNODES": "4",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
        "SLURM_TASKS_PER_NODE": "2(x4)",
        "SLURM_STEP_NODELIST": "gpu[03-05]",
        "SLURM_JOB_NODELIST": "gpu[02-05]",
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "3",
    }
    e = detect(env)
    assert place(e) == ("slurm", 5, 6, 1, 2, 2, 3)
    assert (e.master_addr, e.master_port) == ("gpu03", derived_port("slurm-77-3"))


def test_srun_uneven_tasks_per_node():
    env = {
        **SRUN_TASK1,
        "SLURM_PROCID": "4",
        "SLURM_STEP_NUM_TASKS": "5",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "2",
        "SLURM_STEP_NUM_NODES": "3",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
        "SLURM_STEP_NODELIST": "n[1-3]",
    }
    e = detect(env)
    assert place(e) == ("slurm", 4, 5, 0, 1, 2, 3) and e.master_addr == "n1"


def test_slurm_master_from_the_environment_wins():
    e = detect({**SRUN_TASK1, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"})
    assert (e.scheduler, e.master_addr, e.master_port) == ("slurm", "10.0.0.1", 29400)


def test_slurm_tasks_of_one_step_share_the_port_and_steps_differ():
    ports = {
        detect({**SRUN_TASK1, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}).master_port
        for r in (0, 1)
    }
    assert len(ports) == 1
    next_step = detect({**SRUN_TASK1, "SLURM_STEP_ID": "1", "SLURM_STEPID": "1"}).master_port
    assert next_step not in ports


def test_slurm_batch_step_is_one_process():
    """The batch script itself (`python train.py` in an sbatch script without srun): one
    process, whatever --ntasks asked for."""
    env = {
        "SLURM_JOB_ID": "5",
        "SLURM_JOB_NODELIST": "vm",
        "SLURM_LOCALID": "0",
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "0",
        "SLURM_TASKS_PER_NODE": "2",
    }
    e = detect(env)
    assert place(e) == ("single", 0, 1, 0, 1, 0, 1) and e.problem is None


def test_slurm_without_node_list_or_job_id_is_one_line():
    e = detect({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"})
    assert e.problem == (
        "SLURM reports 2 tasks but no master address could be derived (no node list, "
        "no job id): set MASTER_ADDR and MASTER_PORT, or run under `gradsync launch`"
    )
    assert e.process_group_variables() == {}


def test_one_slurm_task_is_no_problem():
    e = detect({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"})
    assert (e.scheduler, e.world_size, e.problem) == ("slurm", 1, None)


def test_torchrun_inside_slurm_is_torchrun():
    """`srun --ntasks-per-node=1 gradsync launch`: the workers see both; torchrun's name them."""
    e = detect(
        {
            **SRUN_TASK1,
            "SLURM_PROCID": "0",
            "SLURM_STEP_NUM_TASKS": "1",
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "localhost",
            "MASTER_PORT": "29500",
        }
    )
    assert place(e) == ("torchrun", 1, 2, 1, 2, 0, 1)


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("vm", ["vm"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2],b", ["a1", "a2", "b"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("node[1,3-4]", ["node1", "node3", "node4"]),
        ("a[01-02],b[5]", ["a01", "a02", "b5"]),
        ("gpu-a[1-2]", ["gpu-a1", "gpu-a2"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ],
)
def test_expand_hostlist_as_scontrol_show_hostnames(text, hosts):
    assert expand_hostlist(text) == hosts


SCONTROL = shutil.which("scontrol")


@pytest.mark.skipif(
    SCONTROL is None, reason="scontrol not installed (slurm-wlm: scripts/slurm/install.sh)"
)
@pytest.mark.parametrize(
    "text",
    ["node[01-04,07]", "a[1-2],b", "n[9-11]", "n[08-10]", "a[01-02],b[5]", "rack[1-2]-node[01-02]"],
)
def test_expand_hostlist_equals_scontrol(text, tmp_path):
    conf = tmp_path / "slurm.conf"  # scontrol reads a configuration even to expand a list
    conf.write_text("ClusterName=hosts\nSlurmctldHost=localhost\n")
    shown = subprocess.run(
        [str(SCONTROL), "show", "hostnames", text],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "SLURM_CONF": str(conf)},
    )
    assert expand_hostlist(text) == shown.stdout.split()


def test_tasks_on_node():
    assert [tasks_on_node("2(x3),1", n) for n in range(5)] == [2, 2, 2, 1, None]
    assert tasks_on_node("4", 0) == 4
    assert tasks_on_node("2,x", 0) is None  # not SLURM's form: unknown


def test_derived_port_is_stable_and_in_range():
    assert derived_port("slurm-4-0") == derived_port("slurm-4-0") != derived_port("slurm-5-0")
    assert all(20000 <= derived_port(f"slurm-{j}-0") < 32000 for j in range(200))


# -- MPI -----------------------------------------------------------------------------------

#: Rank 1 of `mpiexec -n 2` (MPICH 5's Hydra, captured).
HYDRA_RANK1 = {
    "MPI_LOCALNRANKS": "2",
    "MPI_LOCALRANKID": "1",
    "PMI_FD": "11",
    "PMI_HOSTNAME": "vm",
    "PMI_RANK": "1",
    "PMI_SIZE": "2",
}


def test_mpich_ranks_on_one_node():
    e = detect(HYDRA_RANK1, parent=4242)
    assert place(e) == ("mpich", 1, 2, 1, 2, 0, 1)
    assert (e.master_addr, e.master_port, e.problem) == (
        "127.0.0.1",
        derived_port("mpich-4242"),
        None,
    )
    # Both ranks are children of the same Hydra proxy: the same port.
    assert (
        detect({**HYDRA_RANK1, "PMI_RANK": "0", "MPI_LOCALRANKID": "0"}, parent=4242).master_port
        == e.master_port
    )


def test_mpich_job_name_is_the_identity():
    e = detect({**HYDRA_RANK1, "PMI_KVSNAME": "kvs_812_0"}, parent=1)
    assert (e.job_id, e.master_port) == ("kvs_812_0", derived_port("kvs_812_0"))


def test_mpich_on_several_nodes_needs_master_addr():
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    e = detect(env, parent=1)
    assert e.problem == (
        "mpich reports 4 ranks on several nodes and MASTER_ADDR and MASTER_PORT are "
        "not set: export MASTER_ADDR (rank 0's host) and MASTER_PORT to every rank, e.g. "
        "mpiexec -genv MASTER_ADDR host0 -genv MASTER_PORT 29500 ..."
    )
    # An address alone is not enough across nodes: each node's launcher has its own identity.
    half = detect({**env, "MASTER_ADDR": "host0"}, parent=1)
    assert half.problem is not None and "MASTER_PORT is not set" in half.problem
    openmpi = detect(
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        },
        parent=1,
    )
    assert (
        openmpi.problem is not None
        and "mpiexec -x MASTER_ADDR=host0 -x MASTER_PORT=29500" in openmpi.problem
    )

    ok = detect({**env, "MASTER_ADDR": "host0", "MASTER_PORT": "29500"}, parent=1)
    assert place(ok) == ("mpich", 3, 4, 1, 2, 1, 2)
    assert (ok.master_addr, ok.master_port, ok.problem) == ("host0", 29500, None)


def test_a_pytorchjob_pod_set_for_several_processes_started_alone_is_one_line():
    e = detect(
        {
            "RANK": "1",
            "WORLD_SIZE": "16",
            "MASTER_ADDR": "job-master-0",
            "MASTER_PORT": "23456",
            "PET_NPROC_PER_NODE": "8",
            "PET_NNODES": "2",
        }
    )
    assert (
        e.problem is not None
        and "PET_NPROC_PER_NODE=8" in e.problem
        and "gradsync launch" in e.problem
    )


def test_mpi_without_a_local_size_needs_master_addr():
    e = detect({"PMI_RANK": "0", "PMI_SIZE": "2"}, parent=1)
    assert (
        e.problem is not None and "mpich reports 2 ranks (its local size is unknown)" in e.problem
    )


#: Rank 1 of `mpirun -n 2` on one node, as Open MPI 5 (PRRTE) sets it.
OPEN_MPI_RANK1 = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "0",
    "OMPI_UNIVERSE_SIZE": "2",
    "PMIX_NAMESPACE": "prterun-vm-3117@1",
    "PMIX_RANK": "1",
    "OMPI_MCA_num_procs": "2",
}


def test_open_mpi_rank():
    e = detect(OPEN_MPI_RANK1)
    assert place(e) == ("openmpi", 1, 2, 1, 2, 0, 1)
    assert (e.master_addr, e.master_port, e.job_id) == (
        "127.0.0.1",
        derived_port("prterun-vm-3117@1"),
        "prterun-vm-3117@1",
    )


def test_open_mpi_4_job_id():
    env = {k: v for k, v in OPEN_MPI_RANK1.items() if not k.startswith("PMIX_")}
    e = detect({**env, "OMPI_MCA_ess_base_jobid": "2338390017"})
    assert e.job_id == "2338390017" and e.master_port == derived_port("2338390017")


def test_open_mpi_on_several_nodes_needs_master_addr():
    env = {**OPEN_MPI_RANK1, "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3"}
    e = detect(env)
    assert e.problem is not None and e.problem.startswith(
        "openmpi reports 4 ranks on several nodes"
    )
    assert "\n" not in e.problem


def test_mvapich_rank():
    """mpirun_rsh: MV2_COMM_WORLD_* and MPIRUN_ID; MVAPICH's Hydra mpiexec also sets PMI_*."""
    env = {
        "MV2_COMM_WORLD_RANK": "3",
        "MV2_COMM_WORLD_SIZE": "4",
        "MV2_COMM_WORLD_LOCAL_RANK": "1",
        "MV2_COMM_WORLD_LOCAL_SIZE": "2",
        "MPIRUN_ID": "9001",
        "PMI_RANK": "3",
        "PMI_SIZE": "4",
        "MASTER_ADDR": "host0",
    }
    e = detect(env)
    assert place(e) == ("mvapich", 3, 4, 1, 2, 1, 2)
    assert (e.master_addr, e.master_port, e.job_id) == ("host0", derived_port("9001"), "9001")
    one_node = detect({**env, "MV2_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": ""})
    assert one_node.master_addr == "127.0.0.1" and one_node.problem is None


# -- Kubeflow Trainer ------------------------------------------------------------------------

#: Node 1 of a TrainJob of 2 nodes x 1 process (torch runtime): torchrun's options.
TRAINJOB_NODE1 = {
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "1",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "job-node-0-0.job",
    "PET_MASTER_PORT": "29400",
    "JOB_NAME": "job",
}


def test_trainjob_pod_without_a_launcher_is_one_line():
    e = detect(TRAINJOB_NODE1)
    assert (e.scheduler, e.world_size, e.node_rank, e.nnodes) == ("kubeflow", 1, 1, 2)
    assert (e.master_addr, e.master_port) == ("job-node-0-0.job", 29400)
    assert e.problem == (
        "Kubeflow set torchrun's PET_* options (PET_NNODES=2, PET_NPROC_PER_NODE=1) for a "
        "launcher, and this process was started without one: run `gradsync launch "
        "train.py` (it reads them) as the container's command"
    )


def test_trainjob_of_one_node_and_several_processes_is_one_line():
    e = detect({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "4"})
    assert e.problem is not None and "PET_NPROC_PER_NODE=4" in e.problem


def test_trainjob_of_one_process_is_no_problem():
    e = detect({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "0"})
    assert (e.scheduler, e.world_size, e.problem) == ("kubeflow", 1, None)


def test_elastic_node_range():
    e = detect({"PET_NNODES": "1:4", "PET_NPROC_PER_NODE": "2", "PET_RDZV_ID": "elastic-7"})
    assert (e.nnodes, e.job_id) == (4, "elastic-7") and e.problem is not None


def test_gradsync_launch_workers_in_a_trainjob_are_torchrun():
    e = detect(
        {
            **TRAINJOB_NODE1,
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "job-node-0-0.job",
            "MASTER_PORT": "29400",
        }
    )
    assert place(e) == ("torchrun", 1, 2, 0, 1, 1, 2) and e.problem is None


# -- describe --------------------------------------------------------------------------------


def test_describe():
    text = detect(SRUN_TASK1).describe()
    assert text.splitlines() == [
        "scheduler: slurm (job 4)",
        "rank 1 of 2; local rank 1 of 2; node 0 of 1",
        f"master: vm:{derived_port('slurm-4-0')}",
    ]
    problem = detect(TRAINJOB_NODE1).describe().splitlines()
    assert problem[0] == "scheduler: kubeflow (job job)" and problem[-1].startswith(
        "problem: Kubeflow set"
    )


def test_all_problems_are_one_line():
    for env in (
        {"RANK": "0", "WORLD_SIZE": "2"},
        {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"},
        {"PMI_RANK": "0", "PMI_SIZE": "2"},
        TRAINJOB_NODE1,
    ):
        problem = detect(env, parent=1).problem
        assert problem is not None and "\n" not in problem
