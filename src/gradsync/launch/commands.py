"""What each `gradsync` subcommand does with its parsed arguments (gradsync.cli parses
them): launch, verify, plan (with its estimate), env, bench."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gradsync._support.util import closest
from gradsync.accelerate._compat import FLAGS, refused_flag
from gradsync.errors import ConfigError
from gradsync.launch.parser import BATCH
from gradsync.settings import BY_NAME, LAUNCH_SETTINGS

if TYPE_CHECKING:
    from gradsync._plan.estimate.compression import Compression
    from gradsync.launch.config import LaunchConfig


def launch_config(args: argparse.Namespace) -> LaunchConfig:
    """The LaunchConfig that parsed ``gradsync launch`` arguments stand for.

    Args:
        args: ``build_parser().parse_args(["launch", ...])``.

    Returns:
        The launch, with the settings' flags as given (None: not given).
    """
    from gradsync.launch.config import LaunchConfig

    config_file = args.config
    if getattr(args, "config_file", None) is not None:
        if config_file is not None and config_file != args.config_file:
            raise ConfigError(
                f"--config={config_file!r} and --config_file={args.config_file!r} name two "
                "files; give one (it may be gradsync's or Accelerate's)"
            )
        config_file = args.config_file
    accelerate = {
        f.name: getattr(args, "accelerate_" + f.name)
        for f in FLAGS
        if getattr(args, "accelerate_" + f.name, None) not in (None, False)
    }
    return LaunchConfig(
        script=args.script,
        script_args=list(args.script_args),
        module=args.module,
        nproc_per_node=args.nproc_per_node,
        nnodes=None
        if args.nnodes is None
        else int(args.nnodes)
        if args.nnodes.isdigit()
        else args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        standalone=args.standalone,
        rdzv_backend=args.rdzv_backend,
        rdzv_conf=args.rdzv_conf,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        log_dir=args.log_dir,
        tee=args.tee,
        redirects=args.redirects,
        no_python=args.no_python,
        local_ranks_filter=args.local_ranks_filter,
        start_method=args.start_method,
        config_file=config_file,
        accelerate=accelerate,
        **{s.name: getattr(args, s.name) for s in LAUNCH_SETTINGS},
    )


def launch(args: argparse.Namespace) -> int:
    from gradsync.launch.torchrun import Launcher

    config = launch_config(args)
    launcher = Launcher(config)
    if args.dry_run:
        for line in launcher.warnings:
            print(f"gradsync: warning: {line}", file=sys.stderr)
        print(launcher.describe())
        return 0
    return launcher.run()


def plan(args: argparse.Namespace) -> int:
    from gradsync.config import from_yaml
    from gradsync.launch import plan

    settings = from_yaml(args.config) if args.config else {}
    for name in (*BATCH, "parallelism"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    if (
        settings.get("global_batch_size") is not None
        and settings.get("micro_batch_size") is None
        and settings.get("gradient_accumulation_steps") is None
    ):
        raise ConfigError(
            f"--global-batch-size={settings['global_batch_size']} needs --micro-batch-size or "
            "--gradient-accumulation-steps to derive the other"
        )
    if args.parallelism is not None and args.fsdp_mesh is not None:
        raise ConfigError(
            f"--parallelism={args.parallelism!r} and --fsdp-mesh={args.fsdp_mesh!r} both give "
            "the mesh; give one (--fsdp-mesh R,S is --parallelism dp_replicate=R,dp_shard=S)"
        )
    table = plan.rows(settings, args.nproc_per_node, args.nnodes)
    if args.ladder:
        plan.add_ladders(table)
    if len(table) == 1:
        if "error" in table[0]:
            raise ConfigError(table[0]["error"])
        print(plan.single(table[0]))
    else:
        print(plan.render(table))
    if args.estimate:
        mesh = args.fsdp_mesh
        if mesh is None and settings.get("fsdp_mesh") is not None:  # from the config file
            value = settings["fsdp_mesh"]
            mesh = value if isinstance(value, str) else ",".join(str(n) for n in value)
        for row in table:
            if "error" not in row:
                _estimate(args, row, mesh)
    return 2 if any("error" in row for row in table) else 0


def _estimate(args: argparse.Namespace, row: dict[str, str], mesh: str | None = None) -> None:
    from gradsync._plan.estimate import Cluster, estimate, format_table

    if not row["k"].isdigit():
        raise ConfigError(
            f"--estimate needs a constant number of accumulation steps, not the schedule "
            f"{row['k']!r}; give --gradient-accumulation-steps K for the phase to estimate"
        )
    world, k = int(row["world"]), int(row["k"])

    compression = _compression(args)
    if compression.shapes and args.params is None and args.grad_bytes is None:
        args.params = compression.numel
    if (args.params is None) == (args.grad_bytes is None):
        raise ConfigError(
            "--estimate needs the model size: give --params N (e.g. 7e9) or --grad-bytes B, not both"
        )
    backends = tuple(b.strip() for b in args.estimate_backends.split(",") if b.strip())
    hybrid = "hsdp" in backends or mesh is not None
    backends = tuple(b for b in backends if b != "hsdp")
    if args.parallelism is not None:  # the N-D mesh's rows take the place of the others
        hybrid, backends = False, ()
    needed = (("--bandwidth", args.bandwidth),) if backends else ()
    missing = [
        flag
        for flag, value in (
            *needed,
            ("--latency-us", args.latency_us),
            ("--compute-ms", args.compute_ms),
        )
        if value is None
    ]
    if missing:
        raise ConfigError(
            f"--estimate needs {', '.join(missing)}: the interconnect and the compute "
            "time per micro-step (docs/benchmark.md lists figures for common clusters)"
        )
    grad_bytes = args.grad_bytes if args.grad_bytes is not None else args.params * args.dtype_bytes
    numel = grad_bytes / args.dtype_bytes
    param_dtype = args.param_dtype_bytes if args.param_dtype_bytes is not None else args.dtype_bytes
    if backends:
        cluster = Cluster(
            grad_bytes=grad_bytes,
            param_bytes=numel * param_dtype,
            world=world,
            k=k,
            bandwidth_gbs=args.bandwidth,
            latency_us=args.latency_us,
            compute_ms=args.compute_ms,
            optimizer_ms=args.optimizer_ms,
            bucket_bytes=args.bucket_mib * 2**20,
            sync_ms=args.sync_ms,
            dtype_bytes=args.dtype_bytes,
            compression=compression,
        )
        rows = estimate(cluster, backends)
        print()
        print(format_table(cluster, rows, nodes=int(row["nodes"]), per_node=int(row["per_node"])))
    if hybrid:
        _estimate_hybrid(args, row, mesh or "node", grad_bytes, numel * param_dtype, k)
    if args.parallelism is not None:
        _estimate_mesh(args, row, grad_bytes, numel * param_dtype, k)


def _compression(args: argparse.Namespace) -> Compression:
    """``--comm-hook``, ``--comm-wrapper``, ``--comm-state-option`` and ``--shapes``, checked
    as the settings are (an unknown name answers with the closest one)."""
    from types import SimpleNamespace

    from gradsync._plan.estimate.compression import Compression, parse_shapes

    hook = BY_NAME["comm_hook"].validate(args.comm_hook or "no", None)
    config = SimpleNamespace(comm_hook=hook)
    wrapper = BY_NAME["comm_wrapper"].validate(args.comm_wrapper or "no", config)
    options = BY_NAME["comm_state_option"].validate(args.comm_state_option or {}, config)
    return Compression(
        hook=hook,
        wrapper=wrapper,
        rank=int(options.get("matrix_approximation_rank", 1)),
        min_compression_rate=float(options.get("min_compression_rate", 2.0)),
        shapes=parse_shapes(args.shapes) if args.shapes else (),
    ).check()


def _estimate_mesh(
    args: argparse.Namespace, row: dict[str, str], grad_bytes: float, param_bytes: float, k: int
) -> None:
    from gradsync._plan.estimate import (
        INTER_GBS,
        INTRA_GBS,
        MeshCluster,
        estimate_mesh,
        format_mesh,
    )
    from gradsync.mesh import parse

    dims = parse(args.parallelism, "--parallelism").resolve(int(row["world"]), "--parallelism")
    cluster = MeshCluster(
        grad_bytes=grad_bytes,
        param_bytes=param_bytes,
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        tp=dims.tp,
        pp=dims.pp,
        k=k,
        tp_share=args.tp_share,
        tp_bytes=args.tp_bytes,
        pp_activation_bytes=args.pp_activation_bytes,
        pp_schedule=BY_NAME["pp_schedule"].validate(args.pp_schedule or "1F1B", None),
        pp_microbatches=args.pp_microbatches,
        pp_stages_per_rank=args.pp_stages_per_rank or 1,
        pp_saved_activation_bytes=args.pp_saved_activation_bytes,
        optimizer_state_bytes=args.optimizer_state_bytes,
        budget_bytes=args.memory_budget,
        intra_gbs=args.intra_bandwidth if args.intra_bandwidth is not None else INTRA_GBS,
        inter_gbs=args.inter_bandwidth if args.inter_bandwidth is not None else INTER_GBS,
        latency_us=args.latency_us,
        compute_ms=args.compute_ms,
        optimizer_ms=args.optimizer_ms,
        bucket_bytes=args.bucket_mib * 2**20,
        per_node=int(row["per_node"]),
        dtype_bytes=args.dtype_bytes,
        compression=_compression(args),
    )
    print()
    print(format_mesh(cluster, estimate_mesh(cluster)))


def _estimate_hybrid(
    args: argparse.Namespace,
    row: dict[str, str],
    mesh: str,
    grad_bytes: float,
    param_bytes: float,
    k: int,
) -> None:
    from gradsync._plan.estimate import (
        INTER_GBS,
        INTRA_GBS,
        HybridCluster,
        estimate_hybrid,
        format_hybrid,
        hybrid_mesh,
    )

    per_node = int(row["per_node"])
    replicas, shards = hybrid_mesh(mesh, int(row["world"]), per_node)
    cluster = HybridCluster(
        grad_bytes=grad_bytes,
        param_bytes=param_bytes,
        replicas=replicas,
        shards=shards,
        k=k,
        intra_gbs=args.intra_bandwidth if args.intra_bandwidth is not None else INTRA_GBS,
        inter_gbs=args.inter_bandwidth if args.inter_bandwidth is not None else INTER_GBS,
        latency_us=args.latency_us,
        compute_ms=args.compute_ms,
        optimizer_ms=args.optimizer_ms,
        bucket_bytes=args.bucket_mib * 2**20,
        per_node=per_node,
        dtype_bytes=args.dtype_bytes,
        compression=_compression(args),
    )
    print()
    print(format_hybrid(cluster, estimate_hybrid(cluster)))


def env() -> int:
    import platform

    import gradsync
    from gradsync import backends

    print(f"gradsync {gradsync.__version__}, Python {platform.python_version()}")
    try:
        import torch

        print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    except ImportError:
        print("torch: not installed")
    for name in backends.available():
        print(f"backend {name}: {backends.status(name)}")
    from gradsync._support import environment

    print("where this process runs:")
    print("\n".join(f"  {line}" for line in environment.detect().describe().splitlines()))
    return 0


def bench(args: argparse.Namespace) -> int:
    from gradsync.launch import bench

    return bench.main(list(args.bench_args))


def unknown_flag(parser: argparse.ArgumentParser, command: str, word: str) -> str:
    """One line for an argument ``gradsync COMMAND`` does not take, with the closest flag."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[
        command
    ]
    if not word.startswith("-"):
        return f"unexpected argument {word!r} for gradsync {command}; see gradsync {command} --help"
    flag = word.split("=", 1)[0]
    name = flag.lstrip("-").replace("-", "_")
    why = refused_flag(flag) if command in ("launch", "verify") and flag.startswith("--") else None
    if why is not None:
        return f"{flag} (accelerate launch's) is not taken by gradsync {command}: {why}"
    if name in BY_NAME and BY_NAME[name].flag is None:
        return (
            f"unknown flag {flag} for gradsync {command}: the setting {name} has no flag; set "
            f"it in the config file (--config) or as {BY_NAME[name].env}"
        )
    flags = [o for a in sub._actions if a.help != argparse.SUPPRESS for o in a.option_strings]
    prefixed = [f for f in flags if f.startswith(flag.replace("_", "-"))]  # no abbreviation
    near = closest(flag.replace("_", "-"), flags)
    close = prefixed[:3] or ([near] if near else [])
    hint = f" (did you mean {' or '.join(close)}?)" if close else f"; see gradsync {command} --help"
    return f"unknown flag {flag} for gradsync {command}{hint}"


def script_words(argv: Sequence[str], script: str, parsed: Sequence[str]) -> list[str]:
    """The words after the script's name, exactly as given: argparse drops the first ``--``
    among them, which ``python train.py -- x`` would pass on.

    Args:
        argv: the command line (after ``gradsync``).
        script: the script (or module) name argparse found.
        parsed: the script's arguments as argparse returned them.

    Returns:
        The script's arguments.
    """
    words, n = list(argv), len(parsed)
    at = len(words) - n - 1
    if at >= 0 and words[at] == script and words[at + 1 :] == list(parsed):
        return list(parsed)
    at -= 1  # one "--" dropped
    if at >= 0 and words[at] == script:
        tail = words[at + 1 :]
        if "--" in tail:
            rest = list(tail)
            rest.remove("--")
            if rest == list(parsed):
                return tail
    return list(parsed)
