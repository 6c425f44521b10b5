"""The estimate on an N-D mesh: pp x dp_replicate x dp_shard x tp."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from gradsync._plan.estimate._flat import _size, hook_line
from gradsync._plan.estimate._hybrid import INTER_GBS, INTRA_GBS, HybridCluster, estimate_hybrid
from gradsync._plan.estimate._pipeline import Schedule
from gradsync._plan.estimate.compression import Compression, fsdp_hook
from gradsync.errors import ConfigError


# -- an N-D mesh: dp_replicate x dp_shard x tp -------------------------------------------
@dataclass(frozen=True)
class MeshCluster:
    """The inputs of the estimate on a (dp_replicate, dp_shard, tp) mesh: one model copy's
    gradient and parameter bytes, the three degrees, accumulation, interconnect.

    ``MeshCluster(G, P, dp_replicate=2, dp_shard=4, tp=2, k=8)`` is enough; the rest has
    defaults (the HSDP estimate's bandwidths, no latency, no compute)."""

    grad_bytes: float  # G: gradient bytes of one model copy (the reduction dtype)
    param_bytes: float  # P: parameter bytes an all-gather rebuilds
    dp_replicate: int = 1  # R
    dp_shard: int = 1  # S
    tp: int = 1  # T
    k: int = 1  # micro-steps per optimizer step
    tp_share: float = (
        1.0  # the share of the model's bytes the TP plan shards (the rest is replicated)
    )
    tp_bytes: float | None = (
        None  # TP traffic each rank sends per micro-step (model-dependent; None: unknown)
    )
    pp: int = 1  # P: pipeline stages, each an even 1/P of the model's bytes
    pp_activation_bytes: float | None = (
        None  # activation bytes one stage sends the next per micro-step (None: unknown)
    )
    pp_schedule: str = "1F1B"  # GPipe, 1F1B or Interleaved1F1B
    pp_microbatches: int | None = None  # M: parts per micro-step (None: P)
    pp_stages_per_rank: int = 1  # V (Interleaved1F1B)
    pp_saved_activation_bytes: float | None = (
        None  # bytes a rank's stage(s) save for backward for one part (None: unknown)
    )
    optimizer_state_bytes: float = 0.0  # optimizer state per parameter element (Adam fp32: 8)
    budget_bytes: float | None = None  # auto's budget per rank (None: auto's choice not shown)
    intra_gbs: float = INTRA_GBS  # bus bandwidth per rank inside a node, GB/s
    inter_gbs: float = INTER_GBS  # bus bandwidth per rank across nodes, GB/s
    latency_us: float = 0.0
    compute_ms: float = 0.0
    optimizer_ms: float = 0.0
    bucket_bytes: float = 25 * 2**20
    per_node: int | None = None  # processes per node (None: the dp_shard x tp block fits in one)
    dtype_bytes: float = 4.0  # bytes of one gradient element (what comm_hook compresses)
    # comm_hook fp16 / bf16: the reductions' dtype
    compression: Compression = field(default_factory=Compression)

    def check(self) -> MeshCluster:
        for name in ("pp", "dp_replicate", "dp_shard", "tp", "k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be an integer >= 1")
        if not 0.0 <= self.tp_share <= 1.0:
            raise ConfigError(
                f"tp_share={self.tp_share!r} must be between 0 and 1 (the share of the "
                "model's bytes the TP plan shards)"
            )
        for name in (
            "tp_bytes",
            "pp_activation_bytes",
            "pp_saved_activation_bytes",
            "budget_bytes",
        ):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name}={value!r} must be >= 0, or None when unknown")
        if self.per_node is not None and self.per_node % self.tp:
            raise ConfigError(
                f"tp={self.tp} does not divide the {self.per_node} processes per node: a TP "
                "group would span nodes; pick tp dividing the processes per node"
            )
        if self.optimizer_state_bytes < 0:
            raise ConfigError(f"optimizer_state_bytes={self.optimizer_state_bytes!r} must be >= 0")
        self.schedule().check()
        fsdp_hook(self.compression)
        return self

    def schedule(self) -> Schedule:
        return Schedule(self.pp, self.pp_schedule, self.pp_microbatches, self.pp_stages_per_rank)

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    def per_tp_rank(self, nbytes: float) -> float:
        """The bytes of ``nbytes`` one rank of a TP group of one pipeline stage holds: 1/P of
        the model, and of that 1/T of the sharded share."""
        return nbytes / self.pp * (self.tp_share / self.tp + 1.0 - self.tp_share)

    def pp_step_bytes(self) -> float | None:
        """What the busiest rank sends to its pipeline neighbours per optimizer step: each
        micro-step's activations forward and their gradients back (an inner stage sends
        both, the first and the last one of them; with V stages per rank each of them), k
        times; None when not given."""
        if self.pp == 1:
            return 0.0
        if self.pp_activation_bytes is None:
            return None
        return self.k * self.pp_activation_bytes * self.schedule().sends()

    def activation_bytes(self, stage: int = 0) -> float | None:
        """The saved activations pipeline rank ``stage`` holds at its peak (the first stage
        holds the most); None when ``pp_saved_activation_bytes`` is not given or there is no pipeline."""
        if self.pp == 1 or self.pp_saved_activation_bytes is None:
            return None
        return self.schedule().parts_held(stage) * self.pp_saved_activation_bytes


@dataclass(frozen=True)
class MeshRow:
    policy: str  # one of HYBRID_POLICIES ("defer_replicate" only where dp_replicate > 1)
    shard_bytes: (
        float  # bytes a rank sends per optimizer step in its dp_shard group (RS + all-gathers)
    )
    replicate_bytes: (
        float  # bytes a rank sends per optimizer step in its dp_replicate group (all-reduce)
    )
    tp_bytes: (
        float | None
    )  # bytes a rank sends per optimizer step in its TP group (None: model-dependent)
    grad_memory: float  # gradient bytes a rank holds through the window
    param_memory: float  # parameter bytes a rank holds through the window: its shard, and the gathered copy when kept
    extra_memory: (
        float  # beyond every_step's: gradients above G_T/S, and P_T for parameters kept gathered
    )
    deferral_bytes: (
        float  # what auto weighs against its budget (the adapter's deferral_extra_bytes)
    )
    comm_ms: float  # data-parallel communication per step (TP and pipeline traffic not included)
    step_ms: float
    speedup: float  # every_step step time / this step time
    pp_bytes: float | None = (
        0.0  # bytes a rank sends its pipeline neighbours per step (None: unknown)
    )
    activation_memory: float | None = (
        None  # saved activations the first stage's ranks hold at the peak (None: unknown)
    )
    optimizer_memory: float = 0.0  # optimizer state a rank holds (its shard)


def auto_policy(rows: list[MeshRow], budget_bytes: float, replicas: int) -> str:
    """The policy ``auto`` picks on this mesh for a budget per rank: the first of ``defer +
    params``, ``defer``, ``defer_replicate`` (more than one replica) whose ``deferral_bytes``
    fit, else ``every_step``."""
    by = {row.policy: row for row in rows}
    order = ["defer + params", "defer"] + (["defer_replicate"] if replicas > 1 else [])
    return next((p for p in order if by[p].deferral_bytes <= budget_bytes), "every_step")


def estimate_mesh(cluster: MeshCluster) -> list[MeshRow]:
    """Bytes per mesh dimension per optimizer step and memory per rank, for each policy, on a
    (pp, dp_replicate, dp_shard, tp) mesh.

    Args:
        cluster: the inputs.

    Returns:
        One row per policy of ``HYBRID_POLICIES`` (``defer_replicate`` only where
        dp_replicate > 1).
    """
    c = cluster.check()
    r, s, k = c.dp_replicate, c.dp_shard, c.k
    g, p = c.per_tp_rank(c.grad_bytes), c.per_tp_rank(c.param_bytes)
    # Bytes per dimension: with no node boundary, the shard group's traffic is "intra" and the
    # replicate group's "cross". Times: the dp_shard x tp block of consecutive ranks in a node.
    flat = HybridCluster(
        grad_bytes=g,
        param_bytes=p,
        replicas=r,
        shards=s,
        k=k,
        intra_gbs=c.intra_gbs,
        inter_gbs=c.inter_gbs,
        latency_us=c.latency_us,
        # A stage is busy compute_ms per schedule step and idle for the bubble besides.
        compute_ms=c.compute_ms / (1.0 - c.schedule().bubble()),
        optimizer_ms=c.optimizer_ms,
        bucket_bytes=c.bucket_bytes,
        dtype_bytes=c.dtype_bytes,
        compression=c.compression,
    )
    per_dim = estimate_hybrid(flat)
    timed = estimate_hybrid(
        replace(flat, per_node=c.per_node // c.tp if c.per_node is not None else None)
    )
    tp_bytes = 0.0 if c.tp == 1 else None if c.tp_bytes is None else k * c.tp_bytes
    kept = {"defer + params"}
    deferral = {
        "every_step": 0.0,
        "defer_replicate": math.ceil(g / s),
        "defer": g - g // s,
        "defer + params": g - g // s + p,
    }
    optim = c.per_tp_rank(c.grad_bytes / c.dtype_bytes) / s * c.optimizer_state_bytes
    rows = []
    for bytes_row, time_row in zip(per_dim, timed):
        policy = bytes_row.policy
        if policy == "defer_replicate" and r == 1:
            continue
        rows.append(
            MeshRow(
                policy=policy,
                shard_bytes=bytes_row.intra_bytes,
                replicate_bytes=bytes_row.cross_bytes,
                tp_bytes=tp_bytes,
                grad_memory=bytes_row.grad_memory,
                param_memory=p / s + (p if policy in kept else 0.0),
                extra_memory=bytes_row.extra_memory,
                deferral_bytes=float(deferral[policy]),
                comm_ms=time_row.comm_ms,
                step_ms=time_row.step_ms,
                speedup=time_row.speedup,
                pp_bytes=c.pp_step_bytes(),
                activation_memory=c.activation_bytes(0),
                optimizer_memory=optim,
            )
        )
    return rows


def format_mesh(cluster: MeshCluster, rows: list[MeshRow]) -> str:
    """The rows as ``gradsync plan --estimate --parallelism ...`` prints them.

    Args:
        cluster: the inputs.
        rows: ``estimate_mesh(cluster)``.

    Returns:
        A header naming the inputs and one line per policy.
    """
    c = cluster
    g_t = c.per_tp_rank(c.grad_bytes)
    stage = "" if c.pp == 1 else " of a stage"
    share = (
        ""
        if c.tp_share == 1.0
        else f" (tp_share {c.tp_share:g} of the model sharded, the rest replicated)"
    )
    tp = (
        "the TP traffic (activations, every micro-step under every policy) is model-dependent: "
        "give --tp-bytes per micro-step to add it"
        if c.tp > 1 and c.tp_bytes is None
        else "tp: k x the given TP bytes per micro-step, under every policy"
        if c.tp > 1
        else "no TP group"
    )
    pp, pp_head = ("", "") if c.pp == 1 else (f"pp={c.pp} x ", f" {'pp/rank':>10}")
    pp_note = (
        ""
        if c.pp == 1
        else "; pp: the activations to the next stage and their gradients back, every "
        "micro-step under every policy"
        + (
            " (give --pp-activation-bytes per micro-step to add them)"
            if c.pp_activation_bytes is None
            else ""
        )
    )
    lines = [
        f"mesh {pp}dp_replicate={c.dp_replicate} x dp_shard={c.dp_shard} x tp={c.tp} ({c.world} ranks), k={c.k}: "
        f"gradients {_size(c.grad_bytes)} per model copy, {_size(g_t)} per TP rank{stage}{share}, "
        f"{_size(g_t / c.dp_shard)} per rank after dp_shard; {c.intra_gbs:g} GB/s inside a node, "
        f"{c.inter_gbs:g} GB/s across nodes, {c.latency_us:g} us per collective call",
        f"(dp_shard: reduce-scatter and all-gathers, (S-1)/S x bytes per rank; dp_replicate: the shard "
        f"all-reduced, 2(R-1)/R x G/S per rank; {tp}; grads / params: what a rank holds through the "
        f"window; auto weighs: the bytes auto compares with its budget{pp_note})",
    ]
    if c.pp > 1:
        lines.append(_pipeline_line(c))
    if c.compression.hook != "no":
        f = c.compression.factor(g_t, c.dtype_bytes, c.bucket_bytes)
        lines.append(hook_line(c.compression, f, g_t))
    budget = ""
    if c.budget_bytes is not None:
        chosen = auto_policy(rows, c.budget_bytes, c.dp_replicate)
        budget = f"auto with a budget of {_size(c.budget_bytes)} per rank -> {chosen}"
    mem_head = "" if c.pp == 1 else f" {'optim':>10} {'acts':>10} {'memory/rank':>14}"
    lines += [
        "",
        f"{'policy':<16} {'dp_shard/rank':>14} {'dp_repl/rank':>13} {'tp/rank':>10}{pp_head} {'grads':>10} "
        f"{'params':>10}{mem_head} {'extra':>10} {'auto weighs':>12} {'comm ms':>9} {'step ms':>9} {'speed-up':>9}",
    ]
    for row in rows:
        tp_text = "model-dep." if row.tp_bytes is None else _size(row.tp_bytes)
        pp_text = (
            ""
            if c.pp == 1
            else f" {'model-dep.' if row.pp_bytes is None else _size(row.pp_bytes):>10}"
        )
        lines.append(
            f"{row.policy:<16} {_size(row.shard_bytes):>14} {_size(row.replicate_bytes):>13} {tp_text:>10}{pp_text} "
            f"{_size(row.grad_memory):>10} {_size(row.param_memory):>10}{_memory_text(c, row)} {_size(row.extra_memory):>10} "
            f"{_size(row.deferral_bytes):>12} {row.comm_ms:>9.1f} {row.step_ms:>9.1f} {row.speedup:>8.2f}x"
        )
    if budget:
        lines += ["", budget]
    return "\n".join(lines)


def _memory_text(c: MeshCluster, row: MeshRow) -> str:
    """With a pipeline: the optimizer state, the saved activations at the first stage's peak,
    and what a rank holds in all (``+acts`` where the activations are not given)."""
    if c.pp == 1:
        return ""
    acts = row.activation_memory
    total = row.grad_memory + row.param_memory + row.optimizer_memory + (acts or 0.0)
    total_text = _size(total) + ("" if acts is not None else "+acts")
    acts_text = "model-dep." if acts is None else _size(acts)
    return f" {_size(row.optimizer_memory):>10} {acts_text:>10} {total_text:>14}"


def _pipeline_line(c: MeshCluster) -> str:
    """The schedule's bubble and the parts whose activations each pipeline rank holds."""
    sched = c.schedule()
    v = f", V={sched.per_rank} stages per rank" if sched.per_rank > 1 else ""
    held = ", ".join(f"{n:g}" for n in sched.held_by_rank())
    acts = (
        f"x {_size(c.pp_saved_activation_bytes)} saved per part = {_size(c.activation_bytes(0) or 0.0)} "
        "on the first (the acts column)"
        if c.pp_saved_activation_bytes is not None
        else "give --pp-saved-activation-bytes per part to count them"
    )
    optim = (
        f"optimizer state {c.optimizer_state_bytes:g} B per parameter, sharded like the gradients"
        if c.optimizer_state_bytes
        else "optimizer state not counted (give --optimizer-state-bytes, e.g. 8 for Adam's fp32 moments)"
    )
    return (
        f"pp: {sched.name}, M={sched.parts} parts per micro-step{v}: bubble {sched.formula()} = "
        f"{100 * sched.bubble():.1f} % of a schedule step (step ms: compute-ms / (1 - bubble)); "
        f"saved activations held at the peak, parts per pipeline rank: {held} {acts}; {optim}; "
        "memory/rank: grads + params + optim + acts"
    )
