"""`gradsync launch | plan | env | bench`: argument parsing only; the work is done elsewhere."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gradsync.errors import ConfigError


def _add_batch_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--global-batch-size", type=int, default=None, metavar="G")
    p.add_argument("--micro-batch-size", type=int, default=None, metavar="M")
    p.add_argument("--gradient-accumulation-steps", type=int, default=None, metavar="K")


def _positive(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give a whole number >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1; give a whole number >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradsync", description="Gradient accumulation that is correct on every backend."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    launch = sub.add_parser("launch", help="run a training script on N processes (torchrun)")
    launch.add_argument("--nproc-per-node", type=_positive, default=1, metavar="N")
    launch.add_argument("--nnodes", type=_positive, default=1, metavar="N")
    launch.add_argument("--node-rank", type=int, default=0, metavar="R")
    launch.add_argument("--master-addr", default=None, metavar="A")
    launch.add_argument("--master-port", type=int, default=None, metavar="P")
    launch.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT")
    launch.add_argument("--rdzv-id", default="gradsync", metavar="ID")
    launch.add_argument("--backend", default=None, metavar="B",
                        help="auto, single, ddp, fsdp, deepspeed or fairscale (default: the config file's, else auto)")
    _add_batch_flags(launch)
    launch.add_argument("--sync-policy", default=None, metavar="P",
                        help="auto, defer, every_step or native")
    launch.add_argument("--seed", type=int, default=None)
    launch.add_argument("--mixed-precision", default=None, metavar="MP", help="no, bf16 or fp16")
    launch.add_argument("--audit", action="store_true", help="count collectives per micro-step")
    launch.add_argument("--config", default=None, metavar="YAML", help="a gradsync YAML config")
    launch.add_argument("--dry-run", action="store_true",
                        help="print the torchrun command and the settings, start nothing")
    launch.add_argument("-m", dest="module", action="store_true", help="run SCRIPT as a module")
    launch.add_argument("script", help="the training script")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")

    plan = sub.add_parser("plan", help="derive and check the batch sizes")
    _add_batch_flags(plan)
    plan.add_argument("--nproc-per-node", type=_positive, default=1, metavar="N")
    plan.add_argument("--nnodes", type=_positive, default=1, metavar="N")

    sub.add_parser("env", help="print versions and the backends available here")

    bench = sub.add_parser("bench", help="run the sync-overhead benchmark")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    return parser


def _launch(args: argparse.Namespace) -> int:
    from gradsync.launch.torchrun import LaunchConfig, Launcher

    config = LaunchConfig(
        script=args.script,
        script_args=list(args.script_args),
        module=args.module,
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        backend=args.backend,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        sync_policy=args.sync_policy,
        seed=args.seed,
        mixed_precision=args.mixed_precision,
        audit=args.audit,
        config_file=args.config,
    )
    launcher = Launcher(config)
    if args.dry_run:
        print(launcher.describe())
        return 0
    return launcher.run()


def _plan(args: argparse.Namespace) -> int:
    from gradsync.batching import BatchPlan

    world = args.nproc_per_node * args.nnodes
    if args.global_batch_size is not None and args.micro_batch_size is None and args.gradient_accumulation_steps is None:
        raise ConfigError(
            f"--global-batch-size={args.global_batch_size} needs --micro-batch-size or "
            "--gradient-accumulation-steps to derive the other"
        )
    plan = BatchPlan.solve(
        data_parallel_size=world,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
    )
    print(f"data-parallel processes: {world} ({args.nnodes} node(s) x {args.nproc_per_node})")
    print(f"micro batch size:        {plan.micro_batch_size if plan.micro_batch_size else '?'} per process")
    print(f"accumulation steps:      {plan.gradient_accumulation_steps}")
    print(f"global batch size:       {plan.global_batch_size if plan.global_batch_size else '?'} per optimizer step")
    return 0


def _env() -> int:
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
    return 0


def _bench(args: argparse.Namespace) -> int:
    from gradsync.launch import bench

    return bench.main(list(args.bench_args))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # The benchmark parses its own flags (argparse's REMAINDER refuses a leading --flag).
        from gradsync.launch import bench

        return bench.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "launch":
            return _launch(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "env":
            return _env()
        return _bench(args)
    except ConfigError as err:
        print(f"gradsync: error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:  # torch missing where the launcher must start the workers
        print(f"gradsync: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
