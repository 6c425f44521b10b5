"""Where this process runs: which launcher or scheduler started it, and what it says about
the process group (rank, world, local rank and size, node, master address and port).

Read from the environment alone (no torch), by the Accelerator (to form the group) and by
``gradsync launch`` (for its defaults). Recognised, in this order:

* ``torchrun``: torchrun / torchelastic (``gradsync launch`` included) and anything that sets
  torch's own ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (a Kubeflow
  PyTorchJob pod running ``python train.py``: one process per pod, local rank 0);
* ``slurm``: a task of an ``srun`` job step (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``);
* ``mpich`` / ``openmpi`` / ``mvapich``: a rank started by ``mpiexec`` / ``mpirun``;
* ``kubeflow``: a Kubeflow Trainer (TrainJob) or elastic PyTorchJob pod, which sets torchrun's
  ``PET_*`` options: ``gradsync launch`` reads them; a bare ``python train.py`` cannot form
  the group from them alone;
* ``single``: none of these: one process.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

#: The range ports derived from a job's identity fall in (above most services, below the
#: ephemeral range Linux hands out).
PORT_BASE, PORT_SPAN = 20000, 12000


@dataclass(frozen=True)
class Environment:
    """What the launcher or scheduler says about this process.

    Attributes:
        scheduler: "torchrun", "slurm", "mpich", "openmpi", "mvapich", "kubeflow" or "single".
        rank: this process's rank in the job.
        world_size: processes in the job.
        local_rank: this process's rank on its node.
        local_world_size: processes on this node.
        node_rank: this node's index.
        nnodes: nodes in the job (None when unknown).
        master_addr: where rank 0 listens (None when unknown).
        master_port: the port it listens on (None when unknown).
        job_id: the scheduler's job identity (None when there is none).
        problem: why a process group cannot be formed here although the job has several
            processes, with the fix; None when it can (or when there is one process).
    """

    scheduler: str = "single"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    nnodes: int | None = 1
    master_addr: str | None = None
    master_port: int | None = None
    job_id: str | None = None
    problem: str | None = None

    def process_group_variables(self) -> dict[str, str]:
        """torch's ``env://`` variables for this process (empty with one process)."""
        if self.world_size == 1 or self.master_addr is None or self.master_port is None:
            return {}
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }

    def describe(self) -> str:
        """One line per field, for ``gradsync env``.

        Returns:
            The text.
        """
        lines = [
            f"scheduler: {self.scheduler}" + (f" (job {self.job_id})" if self.job_id else ""),
            f"rank {self.rank} of {self.world_size}; local rank {self.local_rank} of "
            f"{self.local_world_size}; node {self.node_rank} of {self.nnodes or '?'}",
            f"master: {self.master_addr or '?'}:{self.master_port or '?'}",
        ]
        if self.problem:
            lines.append(f"problem: {self.problem}")
        return "\n".join(lines)


def detect(environ: Mapping[str, str] | None = None, *, parent: int | None = None) -> Environment:
    """The environment this process was started in (``environ``: ``os.environ``).

    Args:
        environ: the variables to read (the process's own by default).
        parent: the parent process id, part of an MPICH job's identity (``os.getppid()``).

    Returns:
        What was found; ``problem`` says why a group of several processes cannot be formed.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return _torchrun(env)
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        return _slurm(env)
    for name, prefix in (("openmpi", "OMPI_COMM_WORLD_"), ("mvapich", "MV2_COMM_WORLD_")):
        if prefix + "RANK" in env and prefix + "SIZE" in env:
            return _mpi(
                env,
                name,
                int(env[prefix + "RANK"]),
                int(env[prefix + "SIZE"]),
                env.get(prefix + "LOCAL_RANK"),
                env.get(prefix + "LOCAL_SIZE"),
                env.get("PMIX_NAMESPACE")
                or env.get("OMPI_MCA_ess_base_jobid")
                or env.get("MPIRUN_ID"),
                parent,
            )
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        return _mpi(
            env,
            "mpich",
            int(env["PMI_RANK"]),
            int(env["PMI_SIZE"]),
            env.get("MPI_LOCALRANKID"),
            env.get("MPI_LOCALNRANKS"),
            env.get("PMI_KVSNAME"),
            parent,
        )
    if any(key.startswith("PET_") for key in env):
        return _kubeflow(env)
    return Environment()


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    value = env.get(key, "")
    return int(value) if value.strip().isdigit() else default


def _port(env: Mapping[str, str]) -> int | None:
    value = env.get("MASTER_PORT", "")
    return int(value) if value.isdigit() else None


def derived_port(identity: str) -> int:
    """A port every process of one job derives alike from the job's identity."""
    return PORT_BASE + zlib.crc32(identity.encode()) % PORT_SPAN


def _torchrun(env: Mapping[str, str]) -> Environment:
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if "LOCAL_RANK" in env:
        local_rank = int(env["LOCAL_RANK"])
        local_world = _int(env, "LOCAL_WORLD_SIZE", world)
        node = _int(env, "GROUP_RANK", 0)
        nnodes = world // local_world if local_world and world % local_world == 0 else None
    else:  # one process per pod or host (a PyTorchJob running `python train.py`)
        local_rank, local_world, node, nnodes = 0, 1, rank, world
    problem = None
    per_node = env.get("PET_NPROC_PER_NODE", "")
    if "LOCAL_RANK" not in env and per_node.isdigit() and int(per_node) > 1:
        problem = (
            f"the pod is set for {per_node} processes (PET_NPROC_PER_NODE={per_node}, "
            f"WORLD_SIZE={world}) but this one was started alone: run `gradsync launch "
            "train.py` as the container's command (it starts them)"
        )
    if world > 1 and ("MASTER_ADDR" not in env or _port(env) is None):
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        problem = (
            f"RANK and WORLD_SIZE={world} are set but {' and '.join(missing) or 'a numeric MASTER_PORT'} "
            "not: set them, or start the job with `gradsync launch`"
        )
    return Environment(
        "torchrun",
        rank,
        world,
        local_rank,
        local_world,
        node,
        nnodes,
        env.get("MASTER_ADDR"),
        _port(env),
        env.get("TORCHELASTIC_RUN_ID"),
        problem,
    )


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list, as ``scontrol show hostnames`` expands it:
    ``node[01-03,07],gpu-a[1-2]`` -> ``node01 node02 node03 node07 gpu-a1 gpu-a2``.

    Args:
        text: the list (``SLURM_STEP_NODELIST``, ``SLURM_JOB_NODELIST``).

    Returns:
        The host names, in order.
    """
    hosts: list[str] = []
    for part in _split_top(text):
        hosts.extend(_expand_one(part))
    return hosts


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_one(name: str) -> list[str]:
    """One host name with any number of bracketed ranges: every combination, in order."""
    match = re.match(r"([^\[]*)\[([^\]]*)\](.*)", name)
    if match is None:
        return [name]
    head, ranges, tail = match.groups()
    out: list[str] = []
    for item in ranges.split(","):
        low, _, high = item.partition("-")
        width = len(low) if low.startswith("0") else 0
        numbers = [low] if not high else [f"{n:0{width}d}" for n in range(int(low), int(high) + 1)]
        for number in numbers:
            out.extend(f"{head}{number}{rest}" for rest in _expand_one(tail))
    return out


def tasks_on_node(text: str, node: int) -> int | None:
    """Tasks on node ``node`` from SLURM's ``2(x3),1`` form (three nodes with 2, one with 1)."""
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else None


def _slurm(env: Mapping[str, str]) -> Environment:
    rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"])
    node = _int(env, "SLURM_NODEID", 0)
    nnodes = _int(env, "SLURM_STEP_NUM_NODES", _int(env, "SLURM_NNODES", 1))
    local_world = tasks_on_node(
        env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "")), node
    )
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "0"
    hosts = expand_hostlist(
        env.get("SLURM_STEP_NODELIST")
        or env.get("SLURM_JOB_NODELIST")
        or env.get("SLURM_NODELIST")
        or ""
    )
    addr = env.get("MASTER_ADDR") or (hosts[0] if hosts else None)
    port = _port(env) or (derived_port(f"slurm-{job}-{step}") if job else None)
    problem = None
    if world > 1 and (addr is None or port is None):
        problem = (
            f"SLURM reports {world} tasks but no master address could be derived (no node "
            "list, no job id): set MASTER_ADDR and MASTER_PORT, or run under `gradsync launch`"
        )
    return Environment(
        "slurm",
        rank,
        world,
        _int(env, "SLURM_LOCALID", 0),
        local_world or 1,
        node,
        nnodes,
        addr,
        port,
        job,
        problem,
    )


def _mpi(
    env: Mapping[str, str],
    name: str,
    rank: int,
    world: int,
    local_rank: str | None,
    local_size: str | None,
    identity: str | None,
    parent: int | None,
) -> Environment:
    local = int(local_rank) if local_rank and local_rank.isdigit() else 0
    local_world = int(local_size) if local_size and local_size.isdigit() else None
    one_node = local_world == world
    addr = env.get("MASTER_ADDR") or ("127.0.0.1" if one_node else None)
    # On one node the launcher's process id is an identity every rank shares; across nodes it
    # is not (one launcher process per node), so only the job's own identity serves there.
    job = identity or (
        f"{name}-{parent if parent is not None else os.getppid()}" if one_node else None
    )
    port = _port(env) or (derived_port(job) if job else None)
    problem = None
    if world > 1 and (addr is None or port is None):
        where = "on several nodes" if local_world is not None else "(its local size is unknown)"
        missing = " and ".join(
            k for k, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if v is None
        )
        export = (
            "-x MASTER_ADDR=host0 -x MASTER_PORT=29500"
            if name == "openmpi"
            else "-genv MASTER_ADDR host0 -genv MASTER_PORT 29500"
        )
        verb = "are" if " and " in missing else "is"
        problem = (
            f"{name} reports {world} ranks {where} and {missing} {verb} not set: export "
            f"MASTER_ADDR (rank 0's host) and MASTER_PORT to every rank, e.g. mpiexec {export} ..."
        )
    nnodes = world // local_world if local_world and world % local_world == 0 else None
    return Environment(
        name,
        rank,
        world,
        local,
        local_world or 1,
        rank // local_world if local_world else 0,
        nnodes,
        addr,
        port,
        identity,
        problem,
    )


def _kubeflow(env: Mapping[str, str]) -> Environment:
    nnodes = env.get("PET_NNODES", "1")
    per_node = env.get("PET_NPROC_PER_NODE", "1")
    node = _int(env, "PET_NODE_RANK", 0)
    many = not (nnodes.split(":")[-1] == "1" and per_node in ("1", "auto", "cpu", "gpu"))
    problem = None
    if many:
        problem = (
            f"Kubeflow set torchrun's PET_* options (PET_NNODES={nnodes}, "
            f"PET_NPROC_PER_NODE={per_node}) for a launcher, and this process was started "
            "without one: run `gradsync launch train.py` (it reads them) as the container's command"
        )
    master = env.get("PET_MASTER_ADDR")
    port = env.get("PET_MASTER_PORT", "")
    return Environment(
        "kubeflow",
        0,
        1,
        0,
        1,
        node,
        int(nnodes.split(":")[-1]) if nnodes.split(":")[-1].isdigit() else None,
        master,
        int(port) if port.isdigit() else None,
        env.get("PET_RDZV_ID") or env.get("JOB_NAME"),
        problem,
    )
