"""LaunchConfig -> torch.distributed.run argv plus the GRADSYNC_* settings of the workers.

Importing this module imports no torch backend; ``Launcher.run`` imports torch's launcher
only when it starts the workers.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gradsync import backends
from gradsync.batching import BatchPlan, check_positive_int
from gradsync.config import SYNC_POLICIES, Config, from_yaml, to_env
from gradsync.errors import ConfigError


@dataclass
class LaunchConfig:
    """Everything `gradsync launch` needs; the CLI only fills it in."""

    script: str
    script_args: list[str] = field(default_factory=list)
    module: bool = False  # run `script` as a module (python -m)
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "gradsync"
    max_restarts: int = 0
    # What the workers' Accelerator() reads from GRADSYNC_* variables.
    backend: str = "auto"
    gradient_accumulation_steps: int | None = None
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    sync_policy: str | None = None
    seed: int | None = None
    mixed_precision: str | None = None
    audit: bool = False
    config_file: str | None = None

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


class Launcher:
    """Validates a LaunchConfig before any process starts, then runs torch.distributed.run."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.plan = self.validate()

    def validate(self) -> BatchPlan:
        c = self.config
        check_positive_int("--nproc-per-node", c.nproc_per_node)
        check_positive_int("--nnodes", c.nnodes)
        if not 0 <= c.node_rank < c.nnodes:
            raise ConfigError(
                f"--node-rank={c.node_rank} must be in 0..{c.nnodes - 1} for --nnodes={c.nnodes}"
            )
        if not c.module and not Path(c.script).is_file():
            raise ConfigError(
                f"script {c.script!r} does not exist; give the path of your training script "
                "(or -m module.name to run a module)"
            )
        backends.check_name(c.backend)
        if c.sync_policy is not None and c.sync_policy not in SYNC_POLICIES:
            raise ConfigError(
                f"--sync-policy={c.sync_policy!r} is unknown; use one of {', '.join(SYNC_POLICIES)}"
            )
        if c.master_port is not None and not 0 < c.master_port < 65536:
            raise ConfigError(f"--master-port={c.master_port} must be a TCP port (1-65535)")
        if c.rdzv_endpoint is not None and ":" not in c.rdzv_endpoint:
            raise ConfigError(
                f"--rdzv-endpoint={c.rdzv_endpoint!r} must be HOST:PORT, e.g. 127.0.0.1:29500"
            )
        if c.nnodes > 1 and c.rdzv_endpoint is None and c.master_addr is None:
            raise ConfigError(
                f"--nnodes={c.nnodes} needs --rdzv-endpoint HOST:PORT (or --master-addr and "
                "--master-port) so the nodes can find each other"
            )
        sizes = self._sizes()
        return BatchPlan.solve(data_parallel_size=c.world_size, **sizes)

    def _sizes(self) -> dict[str, int | None]:
        c = self.config
        sizes: dict[str, int | None] = {
            "global_batch_size": c.global_batch_size,
            "micro_batch_size": c.micro_batch_size,
            "gradient_accumulation_steps": c.gradient_accumulation_steps,
        }
        if c.config_file:
            from_file = from_yaml(c.config_file)
            for key in sizes:
                if sizes[key] is None and from_file.get(key) is not None:
                    sizes[key] = from_file[key]
        return sizes

    def worker_env(self) -> dict[str, str]:
        """The GRADSYNC_* variables every worker gets."""
        c = self.config
        settings = Config(
            backend=c.backend,
            gradient_accumulation_steps=self.plan.gradient_accumulation_steps,
            micro_batch_size=self.plan.micro_batch_size,
            global_batch_size=None,  # derived from the other two; passing all three is redundant
            sync_policy=c.sync_policy or "auto",
            seed=c.seed,
            mixed_precision=c.mixed_precision or "no",
            audit=c.audit,
        )
        env = to_env(settings)
        env["GRADSYNC_GRADIENT_ACCUMULATION_STEPS"] = str(self.plan.gradient_accumulation_steps)
        env["GRADSYNC_BACKEND"] = c.backend
        if c.config_file:
            env["GRADSYNC_CONFIG"] = str(Path(c.config_file).resolve())
        return env

    def torchrun_argv(self) -> list[str]:
        """The arguments of torch.distributed.run (after `python -m torch.distributed.run`)."""
        c = self.config
        argv = [f"--nproc-per-node={c.nproc_per_node}", f"--nnodes={c.nnodes}"]
        if c.rdzv_endpoint is not None:
            argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={c.rdzv_endpoint}", f"--rdzv-id={c.rdzv_id}"]
        elif c.master_addr is not None or c.master_port is not None or c.nnodes > 1:
            argv += [f"--node-rank={c.node_rank}"]
            if c.master_addr is not None:
                argv.append(f"--master-addr={c.master_addr}")
            if c.master_port is not None:
                argv.append(f"--master-port={c.master_port}")
        else:
            argv.append("--standalone")
        argv.append(f"--max-restarts={c.max_restarts}")
        if c.module:
            argv.append("-m")
        argv.append(c.script)
        return argv + list(c.script_args)

    def describe(self) -> str:
        env = self.worker_env()
        cmd = shlex.join([sys.executable, "-m", "torch.distributed.run", *self.torchrun_argv()])
        lines = [f"command: {cmd}", f"plan: {self.plan.describe()}", "environment:"]
        lines += [f"  {k}={v}" for k, v in sorted(env.items())]
        return "\n".join(lines)

    def run(self) -> int:
        """Start the workers and wait; return their exit status (0 when all succeeded)."""
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run

        args = parse_args(self.torchrun_argv())
        with _environ(self.worker_env()):
            try:
                run(args)
            except ChildFailedError as err:
                codes = [f.exitcode for f in err.failures.values() if f.exitcode]
                return codes[0] if codes and codes[0] > 0 else 1
        return 0


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
