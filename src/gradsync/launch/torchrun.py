"""LaunchConfig -> torch.distributed.run arguments plus the GRADSYNC_* settings of the workers.

The fields not given are filled in from the scheduler's environment first
(``gradsync.launch.cluster``: SLURM, torchrun's ``PET_*`` variables). The script's own
arguments never go through torchrun's parser (which abbreviates: ``--max`` would match its
``--max-restarts``): only torchrun's own flags are parsed, and the script's arguments are set
on the result.

Importing this module imports no torch backend; ``Launcher.run`` imports torch's launcher
only when it starts the workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from gradsync import backends, mesh
from gradsync._plan.accumulation_schedule import Schedule, is_schedule
from gradsync._plan.batch_plan import BatchPlan, solve_with_schedule
from gradsync._support.util import unknown
from gradsync.accelerate import _compat as accelerate
from gradsync.config import ENV_PREFIX, env_vars, from_yaml, read_yaml
from gradsync.errors import ConfigError
from gradsync.launch import cluster as scheduler
from gradsync.launch import failures, signals
from gradsync.launch.config import (
    LaunchConfig,
    check_endpoint,
    check_settings,
    check_torchrun_flags,
    launch_env,
    torchrun_namespace,
)
from gradsync.launch.failures import ERRORS_ENV, RESTART_STATE_ENV
from gradsync.settings import (
    BY_NAME,
    LAUNCH_SETTINGS,
)


class Launcher:
    """Fills in a LaunchConfig from the scheduler's environment, validates it before any
    process starts, then runs torch.distributed.run.

    Args:
        config: the launch as given.
        environ: the variables the defaults are read from (``os.environ`` by default).

    Attributes:
        requested: the launch as given.
        config: the launch to run, its defaults filled in.
        environment: where this launch runs (``gradsync._support.environment.detect``).
        sources: the fields derived from the environment -> where each came from.
        warnings: lines to print before starting (e.g. more CPU ranks than SLURM's CPUs).
    """

    def __init__(self, config: LaunchConfig, environ: Mapping[str, str] | None = None) -> None:
        self._environ = os.environ if environ is None else environ
        self.requested = config
        self.warnings: list[str] = []
        self.file_sources: dict[str, str] = {}
        self._file_settings: dict[str, Any] = {}  # the config file's settings, read once
        self._accelerate_file = False  # the config file is Accelerate's
        self._accelerated: dict[str, Any] = {}  # the settings Accelerate's flags give
        self._launch_env: dict[str, str] = {}  # from Accelerate's flags: always set
        self._launch_env_defaults: dict[str, str] = {}  # from its file: unless already set
        self._single_origin: str | None = None  # Accelerate's distributed_type NO (one process)
        self._total: int | None = None  # Accelerate's num_processes: over all nodes
        self._total_origin = ""
        self._total_by_flag = False
        self._file_fields: dict[str, tuple[Any, str]] = {}  # from Accelerate's file's launch keys
        self._flag_sources: dict[str, str] = {}  # torchrun fields from Accelerate's flags
        config = self._read_config(config)
        derived = scheduler.resolve(config, self._environ)
        filled = self._divide_processes(self._fill_from_file(config, derived), derived)
        if filled is not config:  # the file's fields and the processes: given now
            config, derived = filled, scheduler.resolve(filled, self._environ)
        self._check_single(dataclasses.replace(config, **derived.values))
        self.config = dataclasses.replace(config, **derived.values)
        self.environment = derived.environment
        self.sources = derived.sources
        self.schedule: Schedule | None = None
        self.plan = self.validate()
        self.warnings += scheduler.cpu_warnings(self.config.processes_per_node, self._environ)

    def _read_config(self, config: LaunchConfig) -> LaunchConfig:
        """Read the config file and Accelerate's flags: the settings they give, the torchrun
        fields Accelerate's flags stand for (which must agree with torchrun's flags given),
        and those its file's launch keys would fill in (``_fill_from_file``)."""
        flags, flag_source = accelerate.from_flags(config.accelerate)
        path = config.config_file
        file_data: dict[str, Any] | None = None
        if path:
            raw = read_yaml(path)
            if accelerate.is_accelerate(raw):
                file_data, self._accelerate_file = raw, True
            else:
                self._file_settings = from_yaml(path)
        if not flags and file_data is None:
            return config
        base = self._file_settings.get("deepspeed_config")
        by_flags = accelerate.translate(
            flags,
            flag_source,
            deepspeed_base=base,
            base_label=f"deepspeed_config in {path!r}",
            backend=config.backend,
        )
        everything = by_flags
        if file_data is not None:
            everything = accelerate.translate(
                accelerate.merge(file_data, flags),
                accelerate.Source(repr(path), flag_source.flags),
                backend=config.backend,
            )
        self.warnings += everything.notes
        for name in by_flags.settings:
            value = everything.settings[name]
            mine = getattr(config, name, None) if name in BY_NAME and BY_NAME[name].flag else None
            if mine is not None and mine != value:
                raise ConfigError(
                    f"{by_flags.origins[name]} means {name}={value!r}, which contradicts "
                    f"{BY_NAME[name].flag}={mine}; give one of them"
                )
            self._accelerated[name] = value
        if file_data is not None:
            self._file_settings = {
                k: v for k, v in everything.settings.items() if k not in by_flags.settings
            }
        self._single_origin = (
            everything.origins.get("backend")
            if everything.settings.get("backend") == "single"
            else None
        )
        self._total = everything.launch.get("num_processes")
        self._total_origin = everything.origins.get("num_processes", "")
        self._total_by_flag = "num_processes" in by_flags.launch
        from_file = {k: v for k, v in everything.launch.items() if k not in by_flags.launch}
        launch_env(by_flags.launch, self._launch_env)
        launch_env(from_file, self._launch_env_defaults)
        self._file_fields = {
            name: (value, everything.origins.get(key, f"{key} in {path!r}"))
            for name, (value, key) in accelerate.torchrun_fields(
                everything.launch, config.rdzv_backend
            ).items()
        }
        return self._flag_fields(config, by_flags)

    def _flag_fields(self, config: LaunchConfig, by_flags: accelerate.Translation) -> LaunchConfig:
        """The torchrun fields Accelerate's flags stand for; one that contradicts the torchrun
        flag given (or a second way to say where the nodes meet) is a ConfigError."""
        given_rendezvous = [n for n in _RENDEZVOUS if getattr(config, n) is not None] or (
            ["standalone"] if config.standalone else []
        )
        values: dict[str, Any] = {}
        for name, (value, key) in accelerate.torchrun_fields(
            by_flags.launch, config.rdzv_backend
        ).items():
            mine = getattr(config, name)
            said = by_flags.origins.get(key, f"--{key}")
            if mine is not None and str(mine) != str(value):
                raise ConfigError(
                    f"{said} contradicts {scheduler.flag(name)}={mine}; give one of them"
                )
            if name in _RENDEZVOUS and given_rendezvous and mine is None:
                raise ConfigError(
                    f"{said} and {scheduler.flag(given_rendezvous[0])} both say where the nodes "
                    "meet; give one of them"
                )
            values[name] = value
            self._flag_sources[name] = said
        return dataclasses.replace(config, **values) if values else config

    def _fill_from_file(self, config: LaunchConfig, derived: scheduler.Derived) -> LaunchConfig:
        """The torchrun fields of Accelerate's file, where neither a flag nor the scheduler's
        environment gives one (flags > scheduler > the file > torchrun's defaults); the
        rendezvous is taken whole from one of them."""
        rendezvous_elsewhere = config.standalone or any(
            getattr(config, n) is not None or n in derived.sources for n in _RENDEZVOUS
        )
        values: dict[str, Any] = {}
        for name, (value, origin) in self._file_fields.items():
            if getattr(config, name) is not None or name in derived.sources:
                continue
            if name in (*_RENDEZVOUS, "rdzv_backend") and rendezvous_elsewhere:
                continue
            values[name] = value
            self.file_sources[name] = origin
        return dataclasses.replace(config, **values) if values else config

    def _divide_processes(self, config: LaunchConfig, derived: scheduler.Derived) -> LaunchConfig:
        """Accelerate's num_processes, the total over all nodes, as the processes per node.
        A flag's wins over the scheduler's count (and must agree with --nproc-per-node); the
        file's counts only where neither gives one."""
        total = self._total
        if total is None:
            return config
        if not self._total_by_flag and (
            config.nproc_per_node is not None or "nproc_per_node" in derived.sources
        ):
            return config
        nnodes = config.nnodes if config.nnodes is not None else derived.values.get("nnodes", 1)
        low, high = scheduler.node_range(nnodes)
        nodes_from = self._source_of("nnodes", derived)
        if low != high:
            raise ConfigError(
                f"{self._total_origin} is the total over a fixed number of machines, and "
                f"--nnodes={nnodes}{nodes_from} is a range; give --nproc-per-node instead"
            )
        if total % low:
            raise ConfigError(
                f"{self._total_origin} does not divide evenly over {low} machines{nodes_from}; "
                f"give a multiple of {low}, or --nproc-per-node"
            )
        per_node = total // low
        if config.nproc_per_node is not None:
            given = dataclasses.replace(config, nnodes=low).processes_per_node
            if given != per_node:
                raise ConfigError(
                    f"{self._total_origin} contradicts --nproc-per-node={config.nproc_per_node} "
                    f"on {low} machine(s){nodes_from} ({given * low} processes); give one of them"
                )
            return config
        if not self._total_by_flag:
            self.file_sources["nproc_per_node"] = self._total_origin
        return dataclasses.replace(config, nproc_per_node=per_node)

    def _source_of(self, name: str, derived: scheduler.Derived) -> str:
        source = (
            derived.sources.get(name) or self.file_sources.get(name) or self._flag_sources.get(name)
        )
        return f" (from {source})" if source else ""

    def _check_single(self, config: LaunchConfig) -> None:
        """Accelerate's distributed_type NO runs one process: several are a contradiction."""
        origin = self._single_origin
        if origin is None or self.requested.backend is not None:
            return
        if config.world_size > 1:
            raise ConfigError(
                f"{origin} runs one process, but this launch starts {config.world_size}; use "
                "distributed_type MULTI_GPU or MULTI_CPU (--multi_gpu), or start one process"
            )

    def validate(self) -> BatchPlan:
        c = self.config
        nproc = c.processes_per_node
        min_nodes, max_nodes = c.node_range
        node_rank = c.node_rank or 0
        if not 0 <= node_rank < max_nodes:
            raise ConfigError(
                f"--node-rank={node_rank}{self._source('node_rank')} must be in 0..{max_nodes - 1} "
                f"for --nnodes={c.nnodes}{self._source('nnodes')}"
            )
        check_torchrun_flags(c, max_nodes)
        if not c.module and not c.no_python:
            script = Path(c.script)
            if script.is_dir():
                raise ConfigError(
                    f"script {c.script!r} is a directory; give the path of your training script "
                    "inside it (or -m module.name to run a module)"
                )
            if not script.is_file():
                raise ConfigError(
                    f"script {c.script!r} does not exist; give the path of your training script "
                    "(or -m module.name to run a module)"
                )
        if c.backend is not None:
            backends.check_name(c.backend)
        for s in LAUNCH_SETTINGS:  # a value out of a fixed set is named by its flag
            value = getattr(c, s.name)
            if s.choices is not None and value is not None and value not in s.choices:
                raise ConfigError(unknown(str(s.flag), value, s.choices))
        if c.master_port is not None and not 0 < c.master_port < 65536:
            raise ConfigError(f"--master-port={c.master_port} must be a TCP port (1-65535)")
        if c.rdzv_endpoint is not None:
            check_endpoint(c.rdzv_endpoint)
        if max_nodes > 1 and c.rdzv_endpoint is None and c.master_addr is None:
            raise ConfigError(
                f"--nnodes={c.nnodes}{self._source('nnodes')} needs --rdzv-endpoint HOST:PORT (or "
                "--master-addr and --master-port) so the nodes can find each other"
            )
        # The same checks the workers' Config makes, on the flags and on the file apart, so
        # that a bad value stops here and the message says where it came from.
        check_settings(self._given())
        from_file = self._from_file()
        try:
            check_settings(from_file)
        except ConfigError as err:
            raise ConfigError(f"config file {c.config_file!r}: {err}") from None
        merged = self._merged()
        for nodes in sorted({min_nodes, max_nodes}, reverse=True):  # elastic: both ends must work
            plan, self.schedule = solve_with_schedule(  # R x S of an N-D mesh read distinct data
                data_parallel_size=mesh.data_parallel_size(
                    merged.get("parallelism"), nproc * nodes
                ),
                global_batch_size=merged.get("global_batch_size"),
                micro_batch_size=merged.get("micro_batch_size"),
                gradient_accumulation_steps=merged.get("gradient_accumulation_steps"),
            )
        return plan

    def _source(self, name: str) -> str:
        """A suffix naming where field ``name`` came from (`` (from SLURM_NODEID=1)``, `` (from
        num_machines=2 in 'accelerate.yaml')``), if not given."""
        source = (
            self.sources.get(name) or self.file_sources.get(name) or self._flag_sources.get(name)
        )
        return f" (from {source})" if source else ""

    def _given(self) -> dict[str, Any]:
        """The worker settings given on the command line (or to LaunchConfig), Accelerate's
        flags' included."""
        given = dict(self._accelerated)
        for s in LAUNCH_SETTINGS:
            value = getattr(self.config, s.name)
            if value is not None and not (s.switch and value is False):  # a switch given is on
                given[s.name] = value
        return given

    def _merged(self) -> dict[str, Any]:
        """The config file's settings, overridden by the given ones: what the workers will use."""
        merged = self._from_file()
        merged.update(self._given())
        return merged

    def worker_env(self) -> dict[str, str]:
        """The GRADSYNC_* variables every worker gets: only the settings that were given.

        Settings that are not given are not exported, so the workers read them from the
        config file (``GRADSYNC_CONFIG``) or fall back to the defaults.
        """
        sizes = ("gradient_accumulation_steps", "micro_batch_size", "global_batch_size")
        given = {k: v for k, v in self._given().items() if k not in sizes}
        # The batch sizes go as the plan derived them from the flags and the file (the global
        # batch size follows from the other two); none go when neither gave any.
        merged = self._merged()
        min_nodes, max_nodes = self.config.node_range
        elastic = min_nodes != max_nodes and merged.get("global_batch_size") is not None
        if is_schedule(merged.get("gradient_accumulation_steps")) or elastic:
            # A schedule goes as given (its k changes); so do the sizes it is read with. An
            # elastic job's global batch goes as given too: each (re)start's workers solve k
            # for the world that actually joined (validate checked both ends).
            given.update({k: merged[k] for k in sizes if merged.get(k) is not None})
        elif any(merged.get(name) is not None for name in sizes):
            given["gradient_accumulation_steps"] = self.plan.gradient_accumulation_steps
            if self.plan.micro_batch_size is not None:
                given["micro_batch_size"] = self.plan.micro_batch_size
        env: dict[str, str] = {}
        if self._accelerate_file:
            # Accelerate's file is translated here, once: its settings go as variables (those
            # the environment already sets win, as over a gradsync file), not as the file.
            env.update(
                env_vars(
                    {
                        k: v
                        for k, v in self._file_settings.items()
                        if k not in sizes and BY_NAME[k].env not in self._environ
                    }
                )
            )
        elif self.config.config_file:
            env[ENV_PREFIX + "CONFIG"] = str(Path(self.config.config_file).resolve())
        env.update(env_vars(given))
        return env

    def thread_env(self) -> dict[str, str]:
        """OMP_NUM_THREADS for the workers when the caller's environment does not set it: the
        CPUs this process may use (its affinity, SLURM_CPUS_PER_TASK, its cgroup's quota)
        split over this node's processes (torchrun would otherwise set 1 and warn)."""
        if "OMP_NUM_THREADS" in self._environ:
            return {}
        threads = scheduler.threads_per_process(self.config.processes_per_node, self._environ)
        return {"OMP_NUM_THREADS": str(threads)}

    def _from_file(self) -> dict[str, Any]:
        return dict(self._file_settings)

    def torchrun_argv(self) -> list[str]:
        """The arguments of torch.distributed.run (after `python -m torch.distributed.run`):
        torchrun's own, then the script's (``run`` never parses those)."""
        own, tail = self._torchrun_parts()
        return own + tail

    def _torchrun_parts(self) -> tuple[list[str], list[str]]:
        """(torchrun's flags up to its training script, what follows it)."""
        c = self.config
        argv = [f"--nproc-per-node={c.nproc_per_node}", f"--nnodes={c.nnodes}"]
        if c.rdzv_endpoint is not None:
            argv += [
                f"--rdzv-backend={c.rdzv_backend or 'c10d'}",
                f"--rdzv-endpoint={c.rdzv_endpoint}",
                f"--rdzv-id={c.rdzv_id}",
            ]
        elif c.master_addr is not None or c.master_port is not None or c.node_range[1] > 1:
            argv += [f"--node-rank={c.node_rank}"]
            if c.master_addr is not None:
                argv.append(f"--master-addr={c.master_addr}")
            if c.master_port is not None:
                argv.append(f"--master-port={c.master_port}")
            if c.rdzv_backend is not None:
                argv.append(f"--rdzv-backend={c.rdzv_backend}")
        else:
            argv.append("--standalone")
        argv.append(f"--max-restarts={c.max_restarts}")
        for flag, value in (
            ("--rdzv-conf", c.rdzv_conf),
            ("--monitor-interval", c.monitor_interval),
            ("--log-dir", c.log_dir),
            ("--tee", c.tee),
            ("--redirects", c.redirects),
            ("--local-ranks-filter", c.local_ranks_filter),
        ):
            if value is not None:
                argv.append(f"{flag}={value}")
        if c.no_python:
            return [*argv, "--no-python", c.script], list(c.script_args)
        # Each worker runs the script through gradsync's wrapper, which records its error:
        # a fresh interpreter runs its module, or torchrun's agent runs its file in each copy.
        wrapper = (
            ["--run-path", "--start-method=fork", str(WORKER)]
            if c.start_method == "fork"
            else ["-m", "gradsync.launch.worker"]
        )
        return [*argv, *wrapper], [*(["-m"] if c.module else []), c.script, *c.script_args]

    def run_env(self) -> dict[str, str]:
        """The variables set while torchrun runs: the workers' settings and, with restarts or
        forked workers, torchrun's opt-out of its shared rendezvous store. Restarted workers
        often hang in init_process_group with it (pytorch issue 135712); its server thread
        names each worker that connects (getnameinfo), and a copy forked while that thread
        held glibc's resolver lock waited on it for good at its first name lookup."""
        env = {**self.thread_env(), **self.worker_env()}
        env.update({k: v for k, v in self._launch_env_defaults.items() if k not in self._environ})
        env.update(self._launch_env)
        if (self.config.max_restarts or 0) > 0 or self.config.start_method == "fork":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = os.environ.get(
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"
            )
        return env

    def describe(self) -> str:
        env = self.run_env()
        cmd = shlex.join([sys.executable, "-m", "torch.distributed.run", *self.torchrun_argv()])
        lines = [f"command: {cmd}", f"plan: {self.plan.describe()}"]
        if self.sources:
            lines.append(
                f"from the environment ({self.environment.scheduler}): "
                + ", ".join(
                    f"{scheduler.flag(name)}={getattr(self.config, name)} ({source})"
                    for name, source in self.sources.items()
                )
            )
        if self.file_sources:
            lines.append(
                f"from {self.config.config_file!r} (Accelerate's format): "
                + ", ".join(
                    f"{scheduler.flag(name)}={getattr(self.config, name)} ({source})"
                    for name, source in self.file_sources.items()
                )
            )
        lines.append("environment:")
        lines += [f"  {k}={v}" for k, v in sorted(env.items())]
        return "\n".join(lines)

    def run(self) -> int:
        """Start the workers and wait; return their exit status (0 when all succeeded), or
        128 + the signal's number when a signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT) stopped
        the launch (``gradsync.launch.signals``)."""
        with signals.stopping():
            try:
                from torch.distributed.elastic.multiprocessing import SignalException
                from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
                from torch.distributed.run import run
            except ImportError as err:
                raise ImportError(
                    f"starting the workers needs torch, which cannot be imported here ({err}); "
                    "install it: pip install torch (the project's constraints.txt pins the tested version)"
                ) from None
            except signals.Stopped as early:
                return signals.stopped(early.signum, sys.stderr, workers=False)
        env = self.run_env()
        with contextlib.ExitStack() as cleanup:
            if self.config.start_method == "fork":
                _prepare_fork()
                # torchrun's agent then reports only the first worker it sees fail: the
                # workers also write their records here, for the report to name the first.
                # (A folder without a finalizer: the copies run the launcher's exit
                # handlers, and a TemporaryDirectory's would remove it in each.)
                env[ERRORS_ENV] = tempfile.mkdtemp(prefix="gradsync-errors-")
                cleanup.callback(shutil.rmtree, env[ERRORS_ENV], ignore_errors=True)
            env[RESTART_STATE_ENV] = tempfile.mkdtemp(prefix="gradsync-restart-")
            cleanup.callback(shutil.rmtree, env[RESTART_STATE_ENV], ignore_errors=True)
            for line in self.warnings:
                print(f"gradsync: warning: {line}", file=sys.stderr, flush=True)
            own, tail = self._torchrun_parts()
            args = torchrun_namespace(own, tail)
            stop: tuple[int, bool] | None = None
            failed: Any = None
            with _environ(env), failures.quiet_torchrun(), signals.forwarding(), signals.stopping():
                try:
                    run(args)
                except ChildFailedError as err:
                    failed = err
                except SignalException as err:  # torchrun's agent stopped the workers
                    stop = (int(err.sigval), True)
                except signals.Stopped as err:  # before the workers started
                    stop = (err.signum, False)
            # Said once the handlers from before are back (torchrun's would raise in the middle).
            if stop is not None:
                return signals.stopped(stop[0], sys.stderr, workers=stop[1])
            if failed is not None:
                return failures.report(failed, sys.stderr, recorded=env.get(ERRORS_ENV))
            return 0


_RENDEZVOUS = ("rdzv_endpoint", "master_addr", "master_port")

#: The wrapper each worker runs the script with (``python -m gradsync.launch.worker``); not
#: imported here, so that ``-m`` finds it unimported.
WORKER = Path(__file__).resolve().with_name("worker.py")

#: ``--start-method``: a fresh interpreter per worker (the default), or a copy of the launcher.


def _prepare_fork() -> None:
    """Before the workers start as copies of this process (``--start-method fork``): refuse
    where torch sees a CUDA device, import what every training script imports (torch, the
    dynamo an optimizer imports on first use, gradsync's Accelerator), and freeze it, so
    that no worker's garbage collector walks those objects again and their pages stay
    shared."""
    import gc

    import torch

    if torch.cuda.is_available():
        raise ConfigError(
            "--start-method fork starts the workers as copies of the launcher, for training on "
            "CPU; torch sees a CUDA device here, which a copy cannot use once the launcher has "
            "asked for it: drop --start-method fork"
        )
    import torch._dynamo  # what an optimizer imports on first use

    import gradsync.accelerator  # noqa: F401

    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
