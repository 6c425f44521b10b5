"""``LaunchConfig``: everything `gradsync launch` needs, apart from the CLI that fills it
in and the ``Launcher`` that runs it (gradsync.launch.torchrun); and the checks of its
torchrun fields. Imports no torch."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradsync import _torch_range, backends
from gradsync._util import check_positive_int
from gradsync.config import ENV_PREFIX, Config
from gradsync.errors import ConfigError
from gradsync.launch import cluster as scheduler
from gradsync.options.fsdp import MeshSpec, ParallelismSpec
from gradsync.settings import (
    AccumulationSteps,
    CommHook,
    CommWrapper,
    MixedPrecision,
    OnOom,
    RequestedPolicy,
)

#: How the workers start: a fresh interpreter each (torchrun's way), or copies of the launcher.
START_METHODS = ("exec", "fork")


@dataclass
class LaunchConfig:
    """Everything `gradsync launch` needs; the CLI only fills it in.

    A torchrun field left None is not given: ``Launcher`` takes it from the scheduler's
    environment (``gradsync.launch.cluster``), else torchrun's default (one process, one
    node, node rank 0, no restart; the rendezvous id: the job's id, else one of this launch).
    """

    script: str
    script_args: list[str] = field(default_factory=list)
    module: bool = False  # run `script` as a module (python -m)
    nproc_per_node: int | str | None = None  # N, or "auto" / "cpu" / "gpu" as torchrun
    nnodes: int | str | None = None  # N, or "MIN:MAX" (elastic)
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int | None = None
    standalone: bool = False
    rdzv_backend: str | None = None
    rdzv_conf: str | None = None
    monitor_interval: float | None = None
    log_dir: str | None = None
    tee: str | None = None
    redirects: str | None = None
    no_python: bool = False
    local_ranks_filter: str | None = None
    #: How each worker starts: "exec" (None: the default) a fresh interpreter, as torchrun
    #: starts it; "fork" (CPU training) a copy of this process, which imported torch and
    #: gradsync once (``gradsync.launch.worker``: what a copy starts with).
    start_method: str | None = None
    # The settings that have a launch flag (gradsync.settings.LAUNCH_SETTINGS, with their
    # declared types; tests/unit/test_settings.py checks that the two agree). The workers'
    # Accelerator() reads them from GRADSYNC_* variables. None (a switch: False) means "not
    # given": the workers then take the value from the config file, or the default.
    backend: str | None = None
    gradient_accumulation_steps: AccumulationSteps | None = None
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    sync_policy: RequestedPolicy | None = None
    mixed_precision: MixedPrecision | None = None
    seed: int | None = None
    audit: bool = False
    fsdp_mesh: MeshSpec | None = None
    parallelism: ParallelismSpec | None = None
    on_oom: OnOom | None = None
    comm_hook: CommHook | None = None
    comm_wrapper: CommWrapper | None = None
    comm_state_option: dict[str, Any] | None = None
    #: A YAML (or JSON) file: gradsync's settings, or Accelerate's config file (``accelerate
    #: config``), told apart by its keys.
    config_file: str | None = None
    #: ``accelerate launch`` flags by name (``gradsync.compat.accelerate.FLAGS``: ``num_processes``,
    #: ``use_fsdp``, ``zero_stage`` ...; a switch given is True), e.g. ``{"num_processes": 4}``.
    #: They win over the config file and must agree with the torchrun fields and settings given.
    accelerate: dict[str, Any] = field(default_factory=dict)

    @property
    def node_range(self) -> tuple[int, int]:
        """(min, max) nodes; equal unless ``nnodes`` is "MIN:MAX"."""
        return scheduler.node_range(self.nnodes if self.nnodes is not None else 1)

    @property
    def processes_per_node(self) -> int:
        """--nproc-per-node as a number (auto: the GPUs if any, else the CPU cores)."""
        n = self.nproc_per_node if self.nproc_per_node is not None else 1
        if isinstance(n, int) or (isinstance(n, str) and n.isdigit()):
            return check_positive_int("--nproc-per-node", int(n))
        if n not in ("auto", "cpu", "gpu"):
            raise ConfigError(
                f"--nproc-per-node={n!r} must be a whole number >= 1, auto, cpu or gpu"
            )
        if n == "cpu":
            return os.cpu_count() or 1
        gpus = _gpu_count()
        if n == "gpu" and gpus == 0:
            raise ConfigError(
                "--nproc-per-node=gpu, but no CUDA GPU is visible here; give a number or 'cpu'"
            )
        return gpus if gpus else os.cpu_count() or 1

    @property
    def world_size(self) -> int:
        return self.processes_per_node * self.node_range[0]


_STD = re.compile(r"^([0-3]|\d+:[0-3](,\d+:[0-3])*)$")


def check_torchrun_flags(c: LaunchConfig, max_nodes: int) -> None:
    if (
        isinstance(c.max_restarts, bool)
        or not isinstance(c.max_restarts, int)
        or c.max_restarts < 0
    ):
        raise ConfigError(f"--max-restarts={c.max_restarts!r} must be a whole number >= 0")
    if c.standalone and (max_nodes > 1 or c.rdzv_endpoint is not None):
        raise ConfigError(
            f"--standalone runs one node with a local rendezvous; it contradicts --nnodes={c.nnodes}"
            + (f" and --rdzv-endpoint={c.rdzv_endpoint}" if c.rdzv_endpoint else "")
            + ": drop one of them"
        )
    if c.monitor_interval is not None and not c.monitor_interval > 0:
        raise ConfigError(f"--monitor-interval={c.monitor_interval} must be > 0 (seconds)")
    for flag, value in (("--tee", c.tee), ("--redirects", c.redirects)):
        if value is not None and not _STD.match(str(value)):
            raise ConfigError(
                f"{flag}={value!r} must be 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or per "
                "local rank, e.g. 0:1,1:2"
            )
    if c.local_ranks_filter is not None and not re.fullmatch(r"\d+(,\d+)*", c.local_ranks_filter):
        raise ConfigError(
            f"--local-ranks-filter={c.local_ranks_filter!r} must be local ranks separated by commas, e.g. 0,1"
        )
    if c.log_dir is not None and Path(c.log_dir).exists() and not Path(c.log_dir).is_dir():
        raise ConfigError(f"--log-dir={c.log_dir!r} is an existing file; give a folder")
    if c.no_python and c.module:
        raise ConfigError("--no-python and -m cannot be used together; give one of them")
    if c.start_method not in (None, *START_METHODS):
        raise ConfigError(
            f"--start-method={c.start_method!r} is unknown; use exec (each worker a fresh "
            "interpreter, the default) or fork (CPU workers as copies of the launcher)"
        )
    if c.start_method == "fork" and c.no_python:
        raise ConfigError(
            "--start-method fork runs the script in a copy of the launcher's "
            "Python, and --no-python runs a program: drop one of them"
        )


def check_settings(settings: Mapping[str, Any]) -> None:
    if settings.get("backend") is not None:
        backends.check_name(settings["backend"])
    Config(**settings).validate()


def check_endpoint(endpoint: str) -> None:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"--rdzv-endpoint={endpoint!r} must be HOST:PORT, e.g. 127.0.0.1:29500")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"--rdzv-endpoint={endpoint!r} has port {port!r}, which is not a TCP port (1-65535); "
            "use HOST:PORT, e.g. 127.0.0.1:29500"
        )


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torchrun_namespace(own: list[str], tail: list[str]) -> Any:
    """torch.distributed.run's arguments: ``own`` (its flags and training script) parsed by
    its parser, with the ``PET_*`` variables gradsync already read hidden from it, then the
    script's arguments ``tail`` set as they are.

    What of torchrun this relies on (torch.distributed.run, ``_torch_range``'s releases): ``parse_args``,
    the name its parser gives the training script's arguments (``training_script_args``),
    and its reading ``PET_<FLAG>`` from the environment when its parser is built.

    Args:
        own: torchrun's flags, ending in its training script (gradsync's worker module).
        tail: the words after it: the script and its arguments, never parsed.

    Returns:
        The namespace ``torch.distributed.run.run`` takes.
    """
    from torch.distributed.run import parse_args

    hidden = [scheduler.pet_name(n) for n in (*scheduler.PET_FIELDS, *scheduler.PET_SWITCHES)]
    saved = {k: os.environ.pop(k) for k in hidden if k in os.environ}
    try:
        args = parse_args(own)
    finally:
        os.environ.update(saved)
    if not isinstance(getattr(args, "training_script_args", None), list):
        raise RuntimeError(
            "torch.distributed.run's arguments have no 'training_script_args' in torch "
            f"{_torch_version()}; gradsync launch supports torch {_torch_range.supported()}"
        )
    args.training_script_args = list(tail)
    return args


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def launch_env(launch: Mapping[str, Any], env: dict[str, str]) -> None:
    """The variables Accelerate's launch keys set: use_cpu (GRADSYNC_DEVICE=cpu), gpu_ids
    (CUDA_VISIBLE_DEVICES), num_cpu_threads_per_process (OMP_NUM_THREADS)."""
    if launch.get("use_cpu"):
        env[ENV_PREFIX + "DEVICE"] = "cpu"
    if "gpu_ids" in launch:
        env["CUDA_VISIBLE_DEVICES"] = str(launch["gpu_ids"])
    if "num_cpu_threads_per_process" in launch:
        env["OMP_NUM_THREADS"] = str(launch["num_cpu_threads_per_process"])
