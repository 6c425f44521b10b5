"""The estimate on an FSDP2 hybrid-sharding (HSDP) mesh: R replicas x S shards."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gradsync._plan.estimate._flat import _size, hook_line
from gradsync._plan.estimate.compression import Compression, fsdp_hook
from gradsync.errors import ConfigError

#: The policies the HSDP estimate compares, in output order.
HYBRID_POLICIES = ("every_step", "defer_replicate", "defer", "defer + params")

#: Default bandwidths for the HSDP estimate, GB/s per rank (docs/benchmark.md gives sources):
#: all-reduce bus bandwidth inside one 8x H100 NVLink 4 / NVSwitch node, and across nodes
#: with one NDR 400 Gb/s InfiniBand NIC per GPU (50 GB/s line rate; nccl-tests reach 46-48).
INTRA_GBS = 476.0
INTER_GBS = 46.0


def hybrid_mesh(text: str, world: int, per_node: int) -> tuple[int, int]:
    """An HSDP mesh (R, S) from ``"R,S"`` (one of them may be -1: inferred from the world) or
    ``"node"`` (S = processes per node, R = nodes).

    Args:
        text: the mesh as given to ``--fsdp-mesh``.
        world: the number of ranks.
        per_node: processes per node.

    Returns:
        (R replicas, S shards), with R * S == world.

    Raises:
        ConfigError: the mesh cannot be read, or does not fit the world.
    """
    if text.strip() == "node":
        return world // per_node, per_node
    parts = [p.strip() for p in text.split(",")]
    try:
        r, s = (int(p) for p in parts)
    except ValueError:
        raise ConfigError(
            f"--fsdp-mesh={text!r}: give R,S (replicas, shards; one may be -1) or 'node'"
        ) from None
    if (r, s).count(-1) == 2 or any(n == 0 or n < -1 for n in (r, s)):
        raise ConfigError(
            f"--fsdp-mesh={text!r}: give two positive sizes, or one of them -1 to infer it"
        )
    if r == -1:
        r = world // s if world % s == 0 else 0
    elif s == -1:
        s = world // r if world % r == 0 else 0
    if r * s != world:
        raise ConfigError(
            f"--fsdp-mesh={text!r} does not fit {world} ranks: R x S must equal the "
            "world (nodes x processes per node)"
        )
    return r, s


@dataclass(frozen=True)
class HybridCluster:
    """The inputs of the HSDP estimate: model size, mesh, accumulation, two interconnects."""

    grad_bytes: float  # G: gradient bytes of one model copy (the reduction dtype)
    param_bytes: float  # P: parameter bytes an all-gather rebuilds
    replicas: int  # R: replicas, across nodes (the replicate group's size)
    shards: int  # S: shards, inside a node (the shard group's size)
    k: int  # micro-steps per optimizer step
    intra_gbs: float = INTRA_GBS  # bus bandwidth per rank inside a node, GB/s
    inter_gbs: float = INTER_GBS  # bus bandwidth per rank across nodes, GB/s
    latency_us: float = 0.0  # fixed cost of one collective call
    compute_ms: float = 0.0  # forward + backward of one micro-step
    optimizer_ms: float = 0.0  # one optimizer step
    bucket_bytes: float = 25 * 2**20  # one collective call per this many bytes
    per_node: int | None = None  # processes per node (None: S); S must divide it to stay in a node
    dtype_bytes: float = 4.0  # bytes of one gradient element (what comm_hook compresses)
    # comm_hook fp16 / bf16: the reductions' dtype
    compression: Compression = field(default_factory=Compression)

    def check(self) -> HybridCluster:
        for name in ("grad_bytes", "param_bytes", "intra_gbs", "inter_gbs", "bucket_bytes"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be > 0")
        for name in ("latency_us", "compute_ms", "optimizer_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be >= 0")
        if self.replicas < 1 or self.shards < 1 or self.k < 1:
            raise ConfigError(
                f"replicas={self.replicas}, shards={self.shards} and k={self.k} must be >= 1"
            )
        fsdp_hook(self.compression)
        return self

    @property
    def shard_crosses_nodes(self) -> bool:
        """S does not divide the processes per node: some shard groups span two nodes."""
        return self.per_node is not None and self.per_node % self.shards != 0


@dataclass(frozen=True)
class HybridRow:
    policy: str  # one of HYBRID_POLICIES
    intra_bytes: float  # bytes each rank sends per optimizer step inside its node (shard group)
    cross_bytes: float  # bytes each rank sends per optimizer step across nodes (replicate group)
    cross_allreduces: float  # all-reduces across replicas per optimizer step
    grad_memory: float  # gradient bytes a rank holds through the window
    extra_memory: float  # memory beyond every_step's: grad_memory - G/S (+ P kept gathered)
    comm_ms: float
    step_ms: float
    speedup: float  # every_step step time / this step time


def estimate_hybrid(cluster: HybridCluster) -> list[HybridRow]:
    """Bytes each rank sends inside its node and across nodes, gradient memory, communication
    and step time per optimizer step, for each policy of ``HYBRID_POLICIES``.

    Args:
        cluster: the inputs.

    Returns:
        One row per policy, in ``HYBRID_POLICIES``' order.
    """
    c = cluster.check()
    g, p, r, s, k = c.grad_bytes, c.param_bytes, c.replicas, c.shards, c.k
    shard = g / s
    f = c.compression.factor(g, c.dtype_bytes, c.bucket_bytes)  # the reduce dtype's share
    rs = (s - 1) / s * g * f if s > 1 else 0.0  # reduce-scatter in the shard group
    ag = (s - 1) / s * p if s > 1 else 0.0  # all-gather in the shard group
    ar = 2 * (r - 1) / r * shard * f if r > 1 else 0.0  # the shard all-reduced across replicas
    calls_g, calls_p, calls_ar = (max(1, math.ceil(n / c.bucket_bytes)) for n in (g, p, shard))
    # (reduce-scatters, all-gathers, all-reduces) per step; gradient bytes held
    plan = {
        "every_step": (k, 2 * k, k, shard),
        "defer_replicate": (k, 2 * k, 1, shard),
        "defer": (1, 2 * k, 1, g),
        "defer + params": (1, 1, 1, g),
    }
    intra_bw = (c.inter_gbs if c.shard_crosses_nodes else c.intra_gbs) * 1e9
    rows = []
    for policy, (n_rs, n_ag, n_ar, held) in plan.items():
        in_shard = n_rs * rs + n_ag * ag
        across = n_ar * ar
        calls = (
            (n_rs * calls_g if s > 1 else 0)
            + (n_ag * calls_p if s > 1 else 0)
            + (n_ar * calls_ar if r > 1 else 0)
        )
        comm = (
            calls * c.latency_us / 1e3 + (in_shard / intra_bw + across / (c.inter_gbs * 1e9)) * 1e3
        )
        intra, cross = (0.0, in_shard + across) if c.shard_crosses_nodes else (in_shard, across)
        step = k * c.compute_ms + c.optimizer_ms + comm
        kept = p if policy == "defer + params" else 0.0  # the gathered copy, beside the shard
        rows.append(
            HybridRow(
                policy,
                intra,
                cross,
                float(n_ar if r > 1 else 0),
                held,
                held - shard + kept,
                comm,
                step,
                1.0,
            )
        )
    base = rows[0].step_ms
    return [
        HybridRow(**{**vars(row), "speedup": base / row.step_ms if row.step_ms else 1.0})
        for row in rows
    ]


def format_hybrid(cluster: HybridCluster, rows: list[HybridRow]) -> str:
    """The HSDP rows as the text ``gradsync plan --estimate --fsdp-mesh R,S`` prints.

    Args:
        cluster: the inputs.
        rows: ``estimate_hybrid(cluster)``.

    Returns:
        A header naming the inputs and one line per policy.
    """
    c = cluster
    lines = [
        f"HSDP on a {c.replicas} x {c.shards} mesh (R replicas across nodes x S shards in a node), k={c.k}: "
        f"gradients {_size(c.grad_bytes)}, a shard {_size(c.grad_bytes / c.shards)}; "
        f"{c.intra_gbs:g} GB/s per rank inside a node, {c.inter_gbs:g} GB/s across nodes, "
        f"{c.latency_us:g} us per collective call",
        "(reduce-scatter and all-gathers in the shard group, (S-1)/S x bytes per rank; the shard "
        "all-reduced across replicas, 2(R-1)/R x G/S per rank; grad memory: the gradients a rank holds "
        "through the window; extra: memory beyond every_step's (gradients above G/S, parameters kept "
        "gathered)",
    ]
    if c.compression.hook != "no":
        f = c.compression.factor(c.grad_bytes, c.dtype_bytes, c.bucket_bytes)
        lines.append(hook_line(c.compression, f, c.grad_bytes))
    if c.shard_crosses_nodes:
        lines.append(
            f"warning: S={c.shards} does not divide the {c.per_node} processes per node: shard "
            "groups cross nodes, so their traffic is counted as cross-node"
        )
    lines += [
        "",
        f"{'policy':<16} {'in-node/rank':>13} {'cross-node/rank':>16} {'cross ARs':>10} "
        f"{'grad memory':>12} {'extra':>10} {'comm ms':>10} {'step ms':>10} {'speed-up':>9}",
    ]
    for row in rows:
        lines.append(
            f"{row.policy:<16} {_size(row.intra_bytes):>13} {_size(row.cross_bytes):>16} "
            f"{row.cross_allreduces:>10.0f} {_size(row.grad_memory):>12} {_size(row.extra_memory):>10} "
            f"{row.comm_ms:>10.1f} {row.step_ms:>10.1f} {row.speedup:>8.2f}x"
        )
    return "\n".join(lines)
