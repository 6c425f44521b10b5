"""`gradsync`'s argument parser: every subcommand's flags (the settings' from their
declarations, torchrun's, Accelerate's launch flags). No parser here abbreviates
(``allow_abbrev=False``): a flag is taken only as spelled, and whatever follows `gradsync
launch`'s script name reaches the script as given.
"""

from __future__ import annotations

import argparse

from gradsync.launch.flags import (
    add_flag,
    add_launch_flags,
    add_setting_flags,
    positive,
    positive_list,
)
from gradsync.settings import BY_NAME

# The settings `gradsync plan` takes flags for.
BATCH = ("global_batch_size", "micro_batch_size", "gradient_accumulation_steps")


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
    add_launch_flags(launch)
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
    add_launch_flags(verify)
    checks = verify.add_argument_group("verification")
    checks.add_argument(
        "--steps",
        type=positive,
        default=3,
        metavar="S",
        help="optimizer steps to run and compare (default 3)",
    )
    add_flag(
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
    add_flag(
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
    add_setting_flags(plan, [BY_NAME[name] for name in BATCH])
    plan.add_argument(
        "--nproc-per-node",
        type=positive_list,
        default=[1],
        metavar="N[,N...]",
        help="processes per node; several, comma-separated, for one row each",
    )
    plan.add_argument(
        "--nnodes",
        type=positive_list,
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
    add_setting_flags(plan, [BY_NAME[name] for name in ("comm_hook", "comm_wrapper")])
    add_setting_flags(plan, [BY_NAME["comm_state_option"]])
    est.add_argument(
        "--shapes",
        default=None,
        metavar="AxB*N,...",
        help="the gradients' shapes, e.g. 4096x4096*32,4096*65 (32 matrices, 65 vectors): "
        "PowerSGD compresses by shape; they give the model size when --params is not given",
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
        "--pp-activation-bytes",
        type=float,
        default=None,
        metavar="B",
        help="--parallelism with pp: activation bytes one stage sends the next per "
        "micro-step (model-dependent, left out when not given)",
    )
    est.add_argument(
        "--pp-saved-activation-bytes",
        type=float,
        default=None,
        metavar="B",
        help="--parallelism with pp: bytes a rank's stage(s) save for backward for one of the "
        "pp_microbatches parts (measure one part's forward through the stage under "
        "torch.autograd.graph.saved_tensors_hooks, parameters left out); the estimate "
        "multiplies it by the parts --pp-schedule holds at its peak",
    )
    est.add_argument(
        "--optimizer-state-bytes",
        type=float,
        default=0.0,
        metavar="B",
        help="--parallelism: optimizer state bytes per parameter, sharded like the gradients "
        "(8: Adam's two fp32 moments; default 0: not counted)",
    )
    add_setting_flags(
        plan, [BY_NAME[n] for n in ("pp_schedule", "pp_microbatches", "pp_stages_per_rank")]
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
