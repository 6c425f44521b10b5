"""`gradsync launch`'s defaults from where it runs: SLURM, Kubeflow's ``PET_*`` options, and
the CPUs this process may use.

Precedence, field by field: a flag given (a LaunchConfig field that is not None) > torchrun's
``PET_<FLAG>`` variable (what Kubeflow's PyTorchJob and TrainJob set, read as torchrun reads
it) > what SLURM says about a job step that runs one ``gradsync launch`` per node
(``srun --ntasks-per-node=1 gradsync launch train.py``) > torchrun's defaults. A flag that
contradicts the scheduler (``--nnodes 2`` in a one-node step) is a ConfigError naming both.

Imports no torch: `gradsync launch --dry-run` runs before anything is installed.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gradsync._support import environment
from gradsync._support.util import check_positive_int
from gradsync.errors import ConfigError


class Requested(Protocol):
    """The fields of a LaunchConfig this module reads (None: not given)."""

    nproc_per_node: int | str | None
    nnodes: int | str | None
    node_rank: int | None
    master_addr: str | None
    master_port: int | None
    rdzv_endpoint: str | None
    rdzv_id: str | None
    standalone: bool


#: The rendezvous fields: one given (or set by PET_*) means the others are not derived.
_RENDEZVOUS = ("rdzv_endpoint", "master_addr", "master_port")


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _nproc(text: str) -> int | str:
    return text if text in ("auto", "cpu", "gpu") else _count(text)


def _nnodes(text: str) -> int | str:
    parts = [_count(part) for part in text.split(":")]
    if len(parts) > 2 or parts[0] > parts[-1]:
        raise ValueError(text)
    return parts[0] if len(parts) == 1 else text


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise ValueError(text)
    return value


def _rank(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


#: LaunchConfig fields torchrun also reads from ``PET_<FIELD>`` when its flag is not given,
#: with how the text is read and what it must look like.
PET_FIELDS: dict[str, tuple[Callable[[str], Any], str]] = {
    "nproc_per_node": (_nproc, "a whole number >= 1, auto, cpu or gpu"),
    "nnodes": (_nnodes, "N or MIN:MAX, e.g. 2 or 1:4"),
    "node_rank": (_rank, "a whole number >= 0"),
    "master_addr": (str, "a host"),
    "master_port": (_port, "a TCP port (1-65535)"),
    "rdzv_backend": (str, "a rendezvous backend"),
    "rdzv_endpoint": (str, "HOST:PORT"),
    "rdzv_id": (str, "an id"),
    "rdzv_conf": (str, "K=V,..."),
    "max_restarts": (_rank, "a whole number >= 0"),
    "monitor_interval": (float, "seconds"),
    "log_dir": (str, "a folder"),
    "tee": (str, "0-3 or per local rank"),
    "redirects": (str, "0-3 or per local rank"),
    "local_ranks_filter": (str, "local ranks, e.g. 0,1"),
}

#: The ``PET_*`` switches of torchrun that gradsync decides itself (it passes its own worker
#: entry point, so torchrun must not read these from the environment either).
PET_SWITCHES = ("standalone", "module", "no_python", "run_path")


def pet_name(name: str) -> str:
    """torchrun's variable for the flag of LaunchConfig field ``name`` (``PET_NNODES``)."""
    return "PET_" + name.upper()


def flag(name: str) -> str:
    """The flag of LaunchConfig field ``name`` (``--nproc-per-node``)."""
    return "--" + name.replace("_", "-")


@dataclass
class Derived:
    """The values a launch takes from its environment.

    Attributes:
        values: LaunchConfig field -> value, for the fields not given (torchrun's defaults
            included: one process, one node, node rank 0, no restart).
        environment: what ``gradsync._support.environment.detect`` found.
        sources: field -> where its value came from (``"SLURM_STEP_NUM_NODES=2"``), for the
            fields taken from the environment.
    """

    values: dict[str, Any]
    environment: environment.Environment
    sources: dict[str, str] = field(default_factory=dict)


def resolve(
    config: Requested,
    environ: Mapping[str, str] | None = None,
    *,
    unique: Callable[[], str] | None = None,
) -> Derived:
    """The values of the fields of ``config`` that were not given, from the scheduler's
    environment, else torchrun's defaults.

    Args:
        config: the launch as given (None: not given).
        environ: the variables to read (``os.environ`` by default).
        unique: makes a rendezvous id unique to this launch (the default: host, pid, time).

    Returns:
        The values and where each came from.

    Raises:
        ConfigError: several launches per SLURM node, a malformed ``PET_*`` value, or a flag
            that contradicts the scheduler.
    """
    env = os.environ if environ is None else environ
    where = environment.detect(env)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def take(name: str, value: Any, source: str) -> None:
        if getattr(config, name) is None and name not in values and value is not None:
            values[name] = value
            sources[name] = source

    # torchrun's own options given through the environment (Kubeflow sets them).
    pet = _pet_values(env)
    rendezvous_given = any(getattr(config, n) is not None for n in _RENDEZVOUS) or config.standalone
    for name, value in pet.items():
        if (
            name in _RENDEZVOUS
            and rendezvous_given
            and not (name == "master_port" and config.master_addr is not None)
        ):
            continue  # a rendezvous given by flags is taken whole (a missing port apart)
        take(name, value, f"{pet_name(name)}={env[pet_name(name)]}")
    standalone = config.standalone
    if not config.standalone and not rendezvous_given and _switch(env, "PET_STANDALONE"):
        standalone = True
        values["standalone"] = True
        sources["standalone"] = "PET_STANDALONE=" + env["PET_STANDALONE"]
    rendezvous_given = rendezvous_given or any(n in values for n in _RENDEZVOUS) or standalone
    pet_nodes = pet.get("nnodes")
    if (
        pet_nodes is not None
        and node_range(pet_nodes)[1] > 1
        and not rendezvous_given
        and where.scheduler == "torchrun"
        and where.master_addr is not None
    ):
        # A PyTorchJob pod: torch's own MASTER_ADDR / MASTER_PORT name the job's first pod.
        take("master_addr", where.master_addr, f"MASTER_ADDR={where.master_addr}")
        take("master_port", where.master_port, f"MASTER_PORT={where.master_port}")
        rendezvous_given = True

    facts: dict[str, tuple[Any, str]] = {}  # what the scheduler states, against the flags
    if isinstance(pet.get("nnodes"), int):
        facts["nnodes"] = (pet["nnodes"], f"PET_NNODES={env['PET_NNODES']} (the job's nodes)")
    if "node_rank" in pet:
        facts["node_rank"] = (pet["node_rank"], f"PET_NODE_RANK={env['PET_NODE_RANK']}")

    if where.scheduler == "slurm":
        _slurm(config, env, where, take, facts, rendezvous_given)
        if where.job_id:
            take("rdzv_id", where.job_id, f"SLURM_JOB_ID={where.job_id}")
    elif where.scheduler == "kubeflow" and where.job_id:
        take("rdzv_id", where.job_id, "the job's id")

    _check_facts(config, facts)

    for name, default in (
        ("nproc_per_node", 1),
        ("nnodes", 1),
        ("node_rank", 0),
        ("max_restarts", 0),
    ):
        if getattr(config, name) is None:
            values.setdefault(name, default)
    rdzv_id = config.rdzv_id if config.rdzv_id is not None else values.get("rdzv_id")
    endpoint = (
        config.rdzv_endpoint if config.rdzv_endpoint is not None else values.get("rdzv_endpoint")
    )
    if rdzv_id is None and endpoint is not None:
        # Outside a scheduler, one node: an id of its own (two jobs on one endpoint stay
        # apart). Several nodes must agree on it, and nothing here names the job: a constant.
        nnodes = config.nnodes if config.nnodes is not None else values["nnodes"]
        one_node = node_range(nnodes)[1] == 1
        values["rdzv_id"] = (unique or _unique_id)() if one_node else "gradsync"
        sources["rdzv_id"] = "this launch" if one_node else "gradsync's default"
    return Derived(values, where, sources)


def node_range(nnodes: int | str) -> tuple[int, int]:
    """(min, max) of ``--nnodes`` N or MIN:MAX, or ConfigError.

    Args:
        nnodes: the value.

    Returns:
        The two counts (equal unless an elastic range).
    """
    text = str(nnodes)
    low, _, high = text.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise ConfigError(f"--nnodes={text!r} must be N or MIN:MAX, e.g. 1:4") from None
    check_positive_int("--nnodes", lo)
    check_positive_int("--nnodes", hi)
    if lo > hi:
        raise ConfigError(f"--nnodes={text!r}: MIN must not exceed MAX, e.g. 1:4")
    return lo, hi


def _pet_values(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (read, shape) in PET_FIELDS.items():
        text = env.get(pet_name(name), "").strip()
        if not text:
            continue
        try:
            out[name] = read(text)
        except ValueError:
            raise ConfigError(
                f"{pet_name(name)}={text!r} must be {shape} (torchrun reads it as {flag(name)}); "
                f"fix the variable or give {flag(name)}"
            ) from None
    return out


def _switch(env: Mapping[str, str], key: str) -> bool:
    text = env.get(key, "").strip()
    return text.isdigit() and int(text) != 0


def _slurm(
    config: Requested,
    env: Mapping[str, str],
    where: environment.Environment,
    take: Callable[[str, Any, str], None],
    facts: dict[str, tuple[Any, str]],
    rendezvous_given: bool,
) -> None:
    tasks, nodes = where.world_size, where.nnodes or 1
    if tasks > nodes:
        raise ConfigError(
            f"SLURM started {tasks} tasks on {nodes} node(s) in this step (SLURM_STEP_NUM_TASKS="
            f"{tasks}), each running `gradsync launch`, which starts its own workers: run one "
            "launch per node, `srun --ntasks-per-node=1 gradsync launch ...` (or `srun -n N "
            "python train.py` without gradsync launch)"
        )
    step_nodes = f"SLURM_STEP_NUM_NODES={nodes}"
    facts.setdefault("nnodes", (nodes, f"{step_nodes} (this step's nodes)"))
    facts.setdefault("node_rank", (where.node_rank, f"SLURM_NODEID={where.node_rank}"))
    take("nnodes", nodes, step_nodes)
    take("node_rank", where.node_rank, f"SLURM_NODEID={where.node_rank}")
    gpus = env.get("SLURM_GPUS_ON_NODE", "").strip()
    if gpus.isdigit() and int(gpus) > 0:
        take("nproc_per_node", int(gpus), f"SLURM_GPUS_ON_NODE={gpus}")
    if config.standalone and nodes > 1:
        return  # _check_facts names the contradiction
    addr, port = where.master_addr, where.master_port
    port_from = f"MASTER_PORT={port}" if env.get("MASTER_PORT") else "a port derived from the job"
    if config.master_addr is not None and config.master_port is None and port is not None:
        take("master_port", port, port_from)
    elif not rendezvous_given and nodes > 1 and addr is not None and port is not None:
        host_from = f"MASTER_ADDR={addr}" if env.get("MASTER_ADDR") else "the step's first node"
        take("rdzv_endpoint", f"{addr}:{port}", f"{host_from} and {port_from}")


def _check_facts(config: Requested, facts: Mapping[str, tuple[Any, str]]) -> None:
    if "nnodes" in facts:
        nodes, source = facts["nnodes"]
        if config.nnodes is not None:
            low, high = node_range(config.nnodes)
            if not low <= nodes <= high:
                raise ConfigError(
                    f"--nnodes={config.nnodes} contradicts {source}: drop --nnodes (gradsync "
                    "launch reads the scheduler's) or run the job on that many nodes"
                )
        if config.standalone and nodes > 1:
            raise ConfigError(
                f"--standalone (one node) contradicts {source}: drop --standalone (gradsync "
                "launch derives the rendezvous from the scheduler)"
            )
    if "node_rank" in facts and config.node_rank is not None:
        rank, source = facts["node_rank"]
        if config.node_rank != rank:
            raise ConfigError(
                f"--node-rank={config.node_rank} contradicts {source}: drop --node-rank "
                "(gradsync launch reads the scheduler's)"
            )


def _unique_id() -> str:
    return f"gradsync-{socket.gethostname()}-{os.getpid()}-{int(time.time())}"


# -- CPUs -------------------------------------------------------------------------------


def usable_cpus(
    environ: Mapping[str, str] | None = None, cgroup_root: Path = Path("/sys/fs/cgroup")
) -> int:
    """The CPUs this process may use: its CPU affinity, SLURM's ``SLURM_CPUS_PER_TASK`` when
    set, and its cgroup's CPU quota, whichever is smallest.

    Args:
        environ: the variables to read (``os.environ`` by default).
        cgroup_root: where the cgroup file system is mounted.

    Returns:
        A whole number >= 1.
    """
    env = os.environ if environ is None else environ
    sched_getaffinity = getattr(os, "sched_getaffinity", None)
    counts = [len(sched_getaffinity(0)) if sched_getaffinity else (os.cpu_count() or 1)]
    per_task = env.get("SLURM_CPUS_PER_TASK", "").strip()
    if per_task.isdigit() and int(per_task) > 0:
        counts.append(int(per_task))
    quota = cgroup_cpus(cgroup_root)
    if quota is not None:
        counts.append(quota)
    return max(1, min(counts))


def cgroup_cpus(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> int | None:
    """The CPU quota of this process's cgroup and its parents (v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), rounded up; None when there is none.

    Args:
        root: where the cgroup file system is mounted.
        proc_cgroup: the file naming this process's cgroups.

    Returns:
        The CPUs the quota allows, or None.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:  # v2
            folders = [root]
            files: Callable[[Path], int | None] = _v2_quota
        elif "cpu" in controllers.split(","):
            folders = [root / controllers, root / "cpu", root / "cpu,cpuacct"]
            files = _v1_quota
        else:
            continue
        for base in folders:
            here = base / path.lstrip("/")
            while True:
                value = files(here)
                if value is not None:
                    limits.append(value)
                if here == base or base not in here.parents:
                    break
                here = here.parent
    return min(limits) if limits else None


def _v2_quota(folder: Path) -> int | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max" or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def _v1_quota(folder: Path) -> int | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def threads_per_process(local_world: int, environ: Mapping[str, str] | None = None) -> int:
    """OMP_NUM_THREADS for each of ``local_world`` workers: the usable CPUs split among them.

    Args:
        local_world: the processes this launch starts on this node.
        environ: the variables to read (``os.environ`` by default).

    Returns:
        A whole number >= 1.
    """
    return max(1, usable_cpus(environ) // max(1, local_world))


def cpu_warnings(ranks: int, environ: Mapping[str, str]) -> list[str]:
    """A line when this launch starts more CPU ranks on its node than the CPUs SLURM gave it.

    Args:
        ranks: the processes on this node.
        environ: the variables to read.

    Returns:
        The warning (without a "warning:" prefix), or none.
    """
    env = environ
    if "SLURM_JOB_ID" not in env and "SLURM_JOBID" not in env:
        return []
    gpus = env.get("SLURM_GPUS_ON_NODE", "").strip()
    if gpus.isdigit() and int(gpus) > 0:
        return []  # GPU ranks
    for key in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
        text = env.get(key, "").strip()
        if text.isdigit() and int(text) > 0:
            cpus = int(text)
            break
    else:
        return []
    if ranks <= cpus:
        return []
    return [
        f"{ranks} CPU processes on this node but SLURM gave this launch {cpus} CPU(s) "
        f"({key}={cpus}): they will share them; ask SLURM for --cpus-per-task={ranks} or "
        f"give --nproc-per-node {cpus}"
    ]
