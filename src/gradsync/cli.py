"""`gradsync launch | verify | plan | env | bench`: argument parsing only; the work is done
elsewhere.

No parser here abbreviates (``allow_abbrev=False``): a flag is taken only as spelled, and
whatever follows `gradsync launch`'s script name reaches the script as given.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gradsync._util import closest
from gradsync.compat.accelerate import FLAGS, refused_flag
from gradsync.errors import ConfigError
from gradsync.settings import BY_NAME, LAUNCH_SETTINGS, Setting

if TYPE_CHECKING:
    from gradsync.launch.torchrun import LaunchConfig

# The settings `gradsync plan` takes flags for.
_BATCH = ("global_batch_size", "micro_batch_size", "gradient_accumulation_steps")


def _flag_type(s: Setting) -> Callable[[str], Any]:
    """An argparse type for a setting's flag: its text read as its GRADSYNC_* variable's is."""
    kind = "int" if int in s.members else "float" if float in s.members else "JSON"

    def convert(text: str) -> Any:
        try:
            return s.from_text(text, str(s.flag))
        except ConfigError:
            hint = f" (give {s.hint})" if s.hint else ""
            raise argparse.ArgumentTypeError(f"invalid {kind} value: {text!r}{hint}") from None

    convert.__name__ = kind
    return convert


def _add_setting_flags(p: argparse.ArgumentParser, settings: Sequence[Setting]) -> None:
    """The flags of ``settings`` (gradsync.settings declares them), in both spellings."""
    for s in settings:
        if s.flag is None:
            raise TypeError(f"setting {s.name} has no flag")
        help_ = s.doc.replace("%", "%%")
        if s.switch:
            _add(p, s.flag, dest=s.name, action="store_true", help=help_)
        elif bool in s.members:
            _add(
                p,
                s.flag,
                dest=s.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_,
            )
        else:
            _add(
                p,
                s.flag,
                dest=s.name,
                type=_flag_type(s),
                default=None,
                metavar=s.metavar or s.name.upper(),
                help=help_,
            )


def _positive_list(text: str) -> list[int]:
    """An argparse type: whole numbers >= 1, comma-separated."""
    return [_positive(part.strip()) for part in text.split(",") if part.strip()]


def _add(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    dest: str | None = None,
    **kwargs: Any,
) -> None:
    """A flag in torchrun's two spellings, --max-restarts and --max_restarts (the second
    hidden from --help, so errors and usage name the first)."""
    dest = dest or flag[2:].replace("-", "_")
    p.add_argument(flag, dest=dest, **kwargs)
    snake = "--" + flag[2:].replace("-", "_")
    if snake != flag:
        kwargs.pop("metavar", None)
        p.add_argument(snake, **{**kwargs, "help": argparse.SUPPRESS}, dest=dest)


def _nproc(text: str) -> int | str:
    """--nproc-per-node: a whole number >= 1, or auto / cpu / gpu (as torchrun)."""
    if text in ("auto", "cpu", "gpu"):
        return text
    return _positive(text)


def _nnodes(text: str) -> str:
    """--nnodes: N, or MIN:MAX for an elastic job; each a whole number >= 1."""
    parts = text.split(":")
    if len(parts) > 2:
        raise argparse.ArgumentTypeError(f"{text!r} must be N or MIN:MAX, e.g. 1:4")
    values = [_positive(part) for part in parts]
    if len(values) == 2 and values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: MIN must not exceed MAX, e.g. 1:4")
    return text


def _positive(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an integer; give a whole number >= 1"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1; give a whole number >= 1")
    return value


def _add_accelerate_flags(group: Any) -> None:
    """``accelerate launch``'s flags (``gradsync.compat.accelerate.FLAGS``), in both spellings, as
    ``accelerate_<name>`` (None: not given)."""
    _add(
        group,
        "--config-file",
        dest="config_file",
        default=None,
        metavar="YAML",
        help="the same as --config (Accelerate's spelling)",
    )
    group.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="accepted: a failing worker is reported in one block anyway",
    )
    for f in FLAGS:
        flag = "--" + f.name.replace("_", "-")
        help_ = f.help.replace("%", "%%")
        if f.switch:
            _add(group, flag, dest="accelerate_" + f.name, action="store_true", help=help_)
        else:
            kind: Callable[[str], Any] = {"int": int, "float": float}.get(f.kind, str)
            _add(
                group,
                flag,
                dest="accelerate_" + f.name,
                type=kind,
                default=None,
                metavar=f.metavar or "V",
                help=help_,
            )


def _add_launch_flags(launch: argparse.ArgumentParser) -> None:
    """The flags of ``gradsync launch`` (torchrun's, the settings', Accelerate's), which
    ``gradsync verify`` takes too."""
    # torchrun's own flags, in both spellings (--nproc-per-node / --nproc_per_node). Not given
    # (None): from the scheduler's environment, else torchrun's default.
    _add(
        launch,
        "--nproc-per-node",
        type=_nproc,
        default=None,
        metavar="N",
        help="processes per node: N, auto, cpu or gpu (default: SLURM_GPUS_ON_NODE "
        "or PET_NPROC_PER_NODE when set, else 1)",
    )
    launch.add_argument(
        "--nnodes",
        type=_nnodes,
        default=None,
        metavar="N|MIN:MAX",
        help="nodes: N, or MIN:MAX for an elastic job (more than one needs "
        "--rdzv-endpoint, or --master-addr and --master-port, unless the "
        "scheduler gives them; default: the SLURM step's nodes, PET_NNODES, or 1)",
    )
    _add(
        launch,
        "--node-rank",
        type=int,
        default=None,
        metavar="R",
        help="this node's rank, 0 to nnodes-1 (with --master-addr; default: SLURM_NODEID, "
        "PET_NODE_RANK, or 0)",
    )
    _add(
        launch,
        "--master-addr",
        default=None,
        metavar="A",
        help="address of the node with node rank 0 (a static rendezvous)",
    )
    _add(
        launch,
        "--master-port",
        type=int,
        default=None,
        metavar="P",
        help="TCP port of the node with node rank 0 (1-65535)",
    )
    launch.add_argument(
        "--standalone",
        action="store_true",
        help="one node, a local rendezvous on a free port (the default on one node)",
    )
    _add(
        launch,
        "--rdzv-backend",
        default=None,
        metavar="B",
        help="rendezvous backend, e.g. c10d (the default with --rdzv-endpoint), static",
    )
    _add(
        launch,
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="where the nodes meet (a multi-node or elastic job)",
    )
    _add(
        launch,
        "--rdzv-id",
        default=None,
        metavar="ID",
        help="the job's id at the rendezvous: the same on every node (default: the "
        "scheduler's job id; outside one, unique to this launch on one node)",
    )
    _add(
        launch,
        "--rdzv-conf",
        default=None,
        metavar="K=V,...",
        help="more rendezvous options, passed to torchrun",
    )
    _add(
        launch,
        "--max-restarts",
        type=int,
        default=None,
        metavar="N",
        help="restart every worker up to N times after a failure (default: PET_MAX_RESTARTS, or 0)",
    )
    _add(
        launch,
        "--monitor-interval",
        type=float,
        default=None,
        metavar="S",
        help="seconds between torchrun's checks of the workers (> 0; default: torchrun's)",
    )
    _add(
        launch,
        "--log-dir",
        default=None,
        metavar="DIR",
        help="a folder for torchrun's per-worker log files",
    )
    launch.add_argument(
        "--tee",
        default=None,
        metavar="STD",
        help="also write the workers' output to the log files: 0 none, "
        "1 stdout, 2 stderr, 3 both, or per local rank, e.g. 0:1,1:2",
    )
    launch.add_argument(
        "--redirects",
        default=None,
        metavar="STD",
        help="write the workers' output to the log files only (values as --tee)",
    )
    _add(
        launch, "--no-python", action="store_true", help="run SCRIPT as a program, not with python"
    )
    _add(
        launch,
        "--local-ranks-filter",
        default=None,
        metavar="RANKS",
        help="show the output of these local ranks only, e.g. 0,1",
    )
    _add(
        launch,
        "--start-method",
        default=None,
        metavar="exec|fork",
        help="exec: each worker a fresh interpreter (the default); fork: on CPU, copies of "
        "the launcher, which imported torch and gradsync once (seconds of CPU less "
        "per worker; docs/checkpoints.md)",
    )
    # The settings' flags (given: exported to the workers; not given: the config file's value).
    _add_setting_flags(launch, LAUNCH_SETTINGS)
    launch.add_argument(
        "--config",
        default=None,
        metavar="YAML",
        help="a config file: gradsync's settings, or Accelerate's (as `accelerate "
        "config` writes it), told apart by its keys",
    )
    _add(
        launch,
        "--dry-run",
        action="store_true",
        help="print the torchrun command and the settings, start nothing",
    )
    launch.add_argument(
        "-m", "--module", dest="module", action="store_true", help="run SCRIPT as a module"
    )
    _add_accelerate_flags(
        launch.add_argument_group(
            "accelerate launch's flags",
            "in both spellings (--num_processes or --num-processes); "
            "each means what the key of its name in Accelerate's config file means "
            "(docs/launch-accelerate.md)",
        )
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradsync",
        description="Gradient accumulation that is correct on every backend.",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    launch = sub.add_parser(
        "launch",
        help="run a training script on N processes (torchrun)",
        allow_abbrev=False,
        description="Under SLURM (srun --ntasks-per-node=1 gradsync launch ...) and Kubeflow "
        "(torchrun's PET_* variables), the flags not given come from the scheduler.",
    )
    _add_launch_flags(launch)
    launch.add_argument("script", help="the training script")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")

    verify = sub.add_parser(
        "verify",
        help="check that a script, launched so, equals one process on the same global windows",
        allow_abbrev=False,
        description="Runs the script as `gradsync launch` would (the same flags) for --steps "
        "optimizer steps, then as one process whose windows hold the same k x N "
        "micro-batches (N: the data-parallel ranks; R x S under --parallelism), and compares the parameters and window losses step by step. "
        "Exit status: 0 equal within the tolerance, 1 different, 2 could not verify.",
    )
    _add_launch_flags(verify)
    checks = verify.add_argument_group("verification")
    checks.add_argument(
        "--steps",
        type=_positive,
        default=3,
        metavar="S",
        help="optimizer steps to run and compare (default 3)",
    )
    _add(
        checks,
        "--max-seconds",
        type=float,
        default=900.0,
        metavar="S",
        help="stop and exit 2 when both runs together take longer (default 900)",
    )
    checks.add_argument(
        "--rtol",
        type=float,
        default=None,
        metavar="R",
        help="relative tolerance (default by precision: fp32 1e-5, bf16 1e-2, fp16 2e-3)",
    )
    _add(
        checks,
        "--verify-dir",
        default=None,
        metavar="DIR",
        help="keep the records and both runs' output here (default: a temporary folder, removed)",
    )
    verify.add_argument("script", help="the training script")
    verify.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")

    plan = sub.add_parser(
        "plan",
        help="derive and check the batch sizes, for one or several world sizes (--estimate: and the communication)",
        allow_abbrev=False,
    )
    _add_setting_flags(plan, [BY_NAME[name] for name in _BATCH])
    plan.add_argument(
        "--nproc-per-node",
        type=_positive_list,
        default=[1],
        metavar="N[,N...]",
        help="processes per node; several, comma-separated, for one row each",
    )
    plan.add_argument(
        "--nnodes",
        type=_positive_list,
        default=[1],
        metavar="N[,N...]",
        help="nodes; several, comma-separated, for one row each",
    )
    plan.add_argument(
        "--config",
        default=None,
        metavar="YAML",
        help="a gradsync config file (flags override its batch settings)",
    )
    plan.add_argument(
        "--parallelism",
        default=None,
        metavar="DIMS",
        help="the N-D mesh, e.g. dp_shard=2,tp=2: the global batch is micro x k x "
        "(dp_replicate x dp_shard)",
    )
    plan.add_argument(
        "--ladder",
        action="store_true",
        help="also show the micro batch x k steps on_oom='split' walks (the global batch kept)",
    )
    est = plan.add_argument_group("communication estimate (--estimate)")
    est.add_argument(
        "--estimate",
        action="store_true",
        help="print bytes sent per rank and step time, naive vs deferred, per backend",
    )
    est.add_argument(
        "--params", type=float, default=None, metavar="N", help="parameters of the model, e.g. 7e9"
    )
    est.add_argument(
        "--grad-bytes",
        type=float,
        default=None,
        metavar="B",
        help="gradient bytes of the model (instead of --params)",
    )
    est.add_argument(
        "--dtype-bytes",
        type=float,
        default=4,
        metavar="B",
        help="bytes per gradient element (default 4: fp32; 2: bf16)",
    )
    est.add_argument(
        "--param-dtype-bytes",
        type=float,
        default=None,
        metavar="B",
        help="bytes per gathered parameter element (default: --dtype-bytes)",
    )
    est.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        metavar="GB/s",
        help="bus bandwidth per rank (nccl-tests busbw), GB/s",
    )
    est.add_argument(
        "--latency-us",
        type=float,
        default=None,
        metavar="US",
        help="fixed cost of one collective call, microseconds",
    )
    est.add_argument(
        "--compute-ms",
        type=float,
        default=None,
        metavar="MS",
        help="forward + backward of one micro-step, ms",
    )
    est.add_argument(
        "--optimizer-ms", type=float, default=0.0, metavar="MS", help="one optimizer step, ms"
    )
    est.add_argument(
        "--sync-ms",
        type=float,
        default=None,
        metavar="MS",
        help="measured time of one gradient sync inside a step (replaces the bandwidth model)",
    )
    est.add_argument(
        "--bucket-mib",
        type=float,
        default=25.0,
        metavar="MIB",
        help="gradient bucket size: one collective call per bucket (default 25, DDP's)",
    )
    est.add_argument(
        "--estimate-backends",
        default="ddp,fsdp,zero2,zero3",
        metavar="LIST",
        help="comma list of ddp, fsdp, zero2, zero3, hsdp (hsdp: FSDP2 hybrid sharding "
        "on --fsdp-mesh, default 'node')",
    )
    est.add_argument(
        "--fsdp-mesh",
        default=None,
        metavar="R,S|node",
        help="also estimate FSDP2 hybrid sharding on an R x S mesh (R replicas across "
        "nodes, S shards in a node; one may be -1; 'node': S = processes per node)",
    )
    est.add_argument(
        "--tp-share",
        type=float,
        default=1.0,
        metavar="F",
        help="--parallelism: the share of the model's bytes the TP plan shards (default 1; "
        "norms and other replicated weights are the rest)",
    )
    est.add_argument(
        "--tp-bytes",
        type=float,
        default=None,
        metavar="B",
        help="--parallelism: TP bytes each rank sends per micro-step (activations; "
        "model-dependent, left out when not given)",
    )
    est.add_argument(
        "--memory-budget",
        type=float,
        default=None,
        metavar="B",
        help="--parallelism: sync_memory_budget per rank, bytes: the estimate says which "
        "policy auto picks",
    )
    est.add_argument(
        "--intra-bandwidth",
        type=float,
        default=None,
        metavar="GB/s",
        help="HSDP: bus bandwidth per rank inside a node (default 476: 8x H100 over "
        "NVLink 4 / NVSwitch, measured all-reduce busbw)",
    )
    est.add_argument(
        "--inter-bandwidth",
        type=float,
        default=None,
        metavar="GB/s",
        help="HSDP: bus bandwidth per rank across nodes (default 46: one NDR 400 Gb/s "
        "InfiniBand NIC per GPU; one 100 Gb/s Ethernet NIC per 8-GPU node: 1.56)",
    )

    sub.add_parser(
        "env",
        help="print versions, the backends available here and where this "
        "process runs (scheduler, rank and world, master)",
        allow_abbrev=False,
    )

    bench = sub.add_parser("bench", help="run the sync-overhead benchmark", allow_abbrev=False)
    bench.add_argument(
        "bench_args",
        nargs=argparse.REMAINDER,
        help="the benchmark's own flags (--quick, --backends, --ks, --modes, "
        "--reps, --out, ...); gradsync bench --help lists them",
    )
    return parser


def launch_config(args: argparse.Namespace) -> LaunchConfig:
    """The LaunchConfig that parsed ``gradsync launch`` arguments stand for.

    Args:
        args: ``build_parser().parse_args(["launch", ...])``.

    Returns:
        The launch, with the settings' flags as given (None: not given).
    """
    from gradsync.launch.torchrun import LaunchConfig

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


def _launch(args: argparse.Namespace) -> int:
    from gradsync.launch.torchrun import Launcher

    config = launch_config(args)
    launcher = Launcher(config)
    if args.dry_run:
        for line in launcher.warnings:
            print(f"gradsync: warning: {line}", file=sys.stderr)
        print(launcher.describe())
        return 0
    return launcher.run()


def _verify(args: argparse.Namespace) -> int:
    from gradsync.launch.torchrun import Launcher
    from gradsync.verify.runner import verify

    config = launch_config(args)
    if args.dry_run:
        launcher = Launcher(config)
        print(launcher.describe())
        print(
            f"then: the same script in one process (backend single, each window k x "
            f"{launcher.config.world_size} micro-batches replayed), {args.steps} optimizer steps each"
        )
        return 0
    report = verify(
        config,
        steps=args.steps,
        max_seconds=args.max_seconds,
        rtol=args.rtol,
        folder=args.verify_dir,
    )
    print(report.render(), flush=True)
    return report.exit_code


def _plan(args: argparse.Namespace) -> int:
    from gradsync.config import from_yaml
    from gradsync.launch import plan

    settings = from_yaml(args.config) if args.config else {}
    for name in (*_BATCH, "parallelism"):
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
    from gradsync._estimate import Cluster, estimate, format_table

    if not row["k"].isdigit():
        raise ConfigError(
            f"--estimate needs a constant number of accumulation steps, not the schedule "
            f"{row['k']!r}; give --gradient-accumulation-steps K for the phase to estimate"
        )
    world, k = int(row["world"]), int(row["k"])

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
        )
        rows = estimate(cluster, backends)
        print()
        print(format_table(cluster, rows, nodes=int(row["nodes"]), per_node=int(row["per_node"])))
    if hybrid:
        _estimate_hybrid(args, row, mesh or "node", grad_bytes, numel * param_dtype, k)
    if args.parallelism is not None:
        _estimate_mesh(args, row, grad_bytes, numel * param_dtype, k)


def _estimate_mesh(
    args: argparse.Namespace, row: dict[str, str], grad_bytes: float, param_bytes: float, k: int
) -> None:
    from gradsync._estimate import (
        INTER_GBS,
        INTRA_GBS,
        MeshCluster,
        estimate_mesh,
        format_mesh,
    )
    from gradsync.mesh import parse

    r, s, t = (
        parse(args.parallelism, "--parallelism").resolve(int(row["world"]), "--parallelism").shape
    )
    cluster = MeshCluster(
        grad_bytes=grad_bytes,
        param_bytes=param_bytes,
        dp_replicate=r,
        dp_shard=s,
        tp=t,
        k=k,
        tp_share=args.tp_share,
        tp_bytes=args.tp_bytes,
        budget_bytes=args.memory_budget,
        intra_gbs=args.intra_bandwidth if args.intra_bandwidth is not None else INTRA_GBS,
        inter_gbs=args.inter_bandwidth if args.inter_bandwidth is not None else INTER_GBS,
        latency_us=args.latency_us,
        compute_ms=args.compute_ms,
        optimizer_ms=args.optimizer_ms,
        bucket_bytes=args.bucket_mib * 2**20,
        per_node=int(row["per_node"]),
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
    from gradsync._estimate import (
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
    )
    print()
    print(format_hybrid(cluster, estimate_hybrid(cluster)))


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
    from gradsync import _environment as environment

    print("where this process runs:")
    print("\n".join(f"  {line}" for line in environment.detect().describe().splitlines()))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from gradsync.launch import bench

    return bench.main(list(args.bench_args))


def _unknown(parser: argparse.ArgumentParser, command: str, word: str) -> str:
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # The benchmark parses its own flags (argparse's REMAINDER refuses a leading --flag).
        from gradsync.launch import bench

        return bench.main(argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command in ("launch", "verify"):
        args.script_args = script_words(argv, args.script, args.script_args)
    if unknown:
        print(f"gradsync: error: {_unknown(parser, args.command, unknown[0])}", file=sys.stderr)
        return 2
    try:
        if args.command == "launch":
            return _launch(args)
        if args.command == "verify":
            return _verify(args)
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
