"""What deferring the gradient sync saves on a cluster, estimated before renting it (no torch).

For one optimizer step of k micro-steps on N data-parallel ranks, with G bytes of gradients
and P bytes of (gathered) parameters per model copy, each rank sends:

* DDP, ring all-reduce of the gradients:     2(N-1)/N * G per all-reduce
* FSDP2 / ZeRO, reduce-scatter of gradients:   (N-1)/N * G per reduce-scatter
* FSDP2 / ZeRO, all-gather of parameters:      (N-1)/N * P per all-gather

and a collective of B bytes sent per rank over C calls (buckets) takes ``C * latency +
B / bandwidth``, ``bandwidth`` being the bus bandwidth one rank gets (what nccl-tests calls
busbw). The step time is ``k * compute + optimizer + communication``, with no overlap of
communication and compute (an upper bound on what the communication costs; where the
backend hides some of it behind backward, deferral saves less). ``sync_ms`` replaces the
modelled time of one gradient sync by a measured one (the benchmark's in-step cost).

Per optimizer step, what each schedule issues:

=====================  =========================================  ==============================
backend / mode         per micro-step                             once per step
=====================  =========================================  ==============================
ddp naive              all-reduce G                               -
ddp defer              -                                          all-reduce G
fsdp naive             2 all-gathers P (forward, backward), RS G  -
fsdp defer             2 all-gathers P                            reduce-scatter G
fsdp defer + params    -                                          all-gather P, reduce-scatter G
zero2 naive (native)   reduce-scatter G                           all-gather P (updated params)
zero2 defer            -                                          reduce-scatter G, all-gather P
zero3 naive (native)   2 all-gathers P, reduce-scatter G          -
zero3 defer            2 all-gathers P                            reduce-scatter G
=====================  =========================================  ==============================

FSDP2 hybrid sharding (HSDP) on an R x S mesh (R replicas across nodes, S shards inside a
node) splits the traffic in two: the reduce-scatter of the gradients and the all-gathers of
the parameters run inside the shard group (in the node, ``intra_gbs``), and the reduced
shard, G/S bytes, is all-reduced across the R replicas (across nodes, ``inter_gbs``):
2(R-1)/R * G/S bytes per rank per all-reduce. Per optimizer step:

=====================  =========================================  ===========================
policy                 per micro-step                             once per step
=====================  =========================================  ===========================
every_step             2 all-gathers P, RS G, all-reduce G/S      -
defer_replicate        2 all-gathers P, RS G                      all-reduce G/S
defer                  2 all-gathers P                            RS G, all-reduce G/S
defer + params         -                                          all-gather P, RS G, AR G/S
=====================  =========================================  ===========================

and the gradient memory each rank holds beyond ``every_step``'s sharded gradients (G/S):
``defer_replicate`` the partial all-reduce buffer, G/S (its sharded ``.grad`` is set only at
the boundary, so at most G/S more); ``defer`` the unsharded gradients, G instead of G/S;
``defer + params`` those and the parameters kept gathered, P more (FSDP2 keeps each rank's
shard beside the gathered copy: benchmarks/hsdp_bytes.py measures G + P held before the boundary).

With tensor parallelism on a (dp_replicate R, dp_shard S, tp T) mesh (``estimate_mesh``), each
rank first holds 1/T of the TP-sharded weights (a share ``tp_share`` of the model; the rest,
norms and biases a plan leaves whole, is replicated over the TP group), and FSDP2 shards that
over S: per rank, G_T = G x (tp_share / T + 1 - tp_share) gradient bytes and P_T likewise
before the 1/S. The data-parallel rows above then hold with G_T and P_T in place of G and P:
reduce-scatter and all-gathers in the dp_shard group, the all-reduce of G_T/S across
dp_replicate. The TP group's own traffic (the activations of colwise/rowwise layers in
forward and backward) depends on the model, not on the gradients: it runs on every micro-step
under every policy, since it is the computation itself; given ``tp_bytes`` per micro-step it
is k x that per step, else it is reported as model-dependent. ``deferral_bytes`` is what a
policy holds that ``auto`` weighs against its budget, as the FSDP adapter counts it
(``backend.memory["deferral_extra_bytes"]``): ``defer`` G_T - G_T/S, ``defer + params``
G_T - G_T/S + P_T, ``defer_replicate`` its partial buffer G_T/S, ``every_step`` 0;
``auto`` takes the first of defer + params, defer, defer_replicate (R > 1) that fits the
budget, else every_step. ``extra_memory`` is what the window holds beyond every_step's as
benchmarks/hsdp_bytes.py measures it: the gradients above G_T/S, and for kept parameters
the whole gathered copy P_T, since FSDP2 keeps each rank's shard beside it (the adapter
counts it so too); ``defer_replicate``'s partial buffer takes the place of
the sharded gradients (0 more).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gradsync.errors import ConfigError

__all__ = [
    "BACKENDS",
    "HYBRID_POLICIES",
    "Cluster",
    "HybridCluster",
    "HybridRow",
    "MeshCluster",
    "MeshRow",
    "Row",
    "auto_policy",
    "estimate",
    "estimate_hybrid",
    "estimate_mesh",
    "format_hybrid",
    "format_mesh",
    "format_table",
    "hybrid_mesh",
]

#: The backends the estimate knows, in output order.
BACKENDS = ("ddp", "fsdp", "zero2", "zero3")


@dataclass(frozen=True)
class Cluster:
    """The inputs: model size, world, accumulation, interconnect and compute times."""

    grad_bytes: float  # G: gradient bytes of one model copy
    param_bytes: float  # P: parameter bytes an all-gather rebuilds (the compute dtype)
    world: int  # N data-parallel ranks
    k: int  # micro-steps per optimizer step
    bandwidth_gbs: float  # bus bandwidth per rank, GB/s (1e9 bytes)
    latency_us: float  # fixed cost of one collective call
    compute_ms: float  # forward + backward of one micro-step
    optimizer_ms: float = 0.0  # one optimizer step (+ zero_grad)
    bucket_bytes: float = 25 * 2**20  # DDP's bucket size: one all-reduce call per bucket
    sync_ms: float | None = None  # measured time of one gradient sync (replaces the model)

    def check(self) -> Cluster:
        for name in ("grad_bytes", "param_bytes", "bandwidth_gbs", "bucket_bytes"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be > 0")
        for name in ("latency_us", "compute_ms", "optimizer_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be >= 0")
        if self.sync_ms is not None and self.sync_ms < 0:
            raise ConfigError(f"sync_ms={self.sync_ms!r} must be >= 0")
        if self.world < 1 or self.k < 1:
            raise ConfigError(f"world={self.world} and k={self.k} must be >= 1")
        return self


@dataclass(frozen=True)
class Row:
    backend: str
    mode: str  # "naive (every_step)", "defer", "defer + params"
    sent_bytes: float  # bytes each rank sends per optimizer step
    comm_ms: float  # communication time per optimizer step
    step_ms: float  # k * compute + optimizer + communication
    speedup: float  # naive step time / this step time


def _ring(c: Cluster) -> float:
    """(N-1)/N: the share of a buffer each rank sends in a reduce-scatter or all-gather."""
    return (c.world - 1) / c.world


def _calls(c: Cluster, nbytes: float) -> int:
    return max(1, math.ceil(nbytes / c.bucket_bytes))


def _time_ms(c: Cluster, sent: float, calls: int) -> float:
    if c.world == 1:
        return 0.0
    return calls * c.latency_us / 1e3 + sent / (c.bandwidth_gbs * 1e9) * 1e3


def _ops(c: Cluster) -> dict[str, list[tuple[str, float, float, int]]]:
    """(backend/mode) -> [(collective, bytes sent per call-group, times per step, calls)]."""
    r, k, g, p = _ring(c), c.k, c.grad_bytes, c.param_bytes
    ar, rs, ag = (
        ("all-reduce", 2 * r * g, _calls(c, g)),
        ("reduce-scatter", r * g, _calls(c, g)),
        ("all-gather", r * p, _calls(c, p)),
    )

    def times(op: tuple[str, float, int], n: float) -> tuple[str, float, float, int]:
        return (op[0], op[1], n, op[2])

    return {
        "ddp/naive (every_step)": [times(ar, k)],
        "ddp/defer": [times(ar, 1)],
        "fsdp/naive (every_step)": [times(ag, 2 * k), times(rs, k)],
        "fsdp/defer": [times(ag, 2 * k), times(rs, 1)],
        "fsdp/defer + params": [times(ag, 1), times(rs, 1)],
        "zero2/naive (every_step)": [times(rs, k), times(ag, 1)],
        "zero2/defer": [times(rs, 1), times(ag, 1)],
        "zero3/naive (every_step)": [times(ag, 2 * k), times(rs, k)],
        "zero3/defer": [times(ag, 2 * k), times(rs, 1)],
    }


def estimate(cluster: Cluster, backends: tuple[str, ...] = BACKENDS) -> list[Row]:
    """Bytes sent per rank, communication and step time per optimizer step, per backend and mode."""
    c = cluster.check()
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ConfigError(
            f"backend {unknown[0]!r} is unknown to the estimate; use {', '.join(BACKENDS)}"
        )
    rows: list[Row] = []
    for key, ops in _ops(c).items():
        backend, mode = key.split("/")
        if backend not in backends:
            continue
        sent = sum(nbytes * n for _, nbytes, n, _ in ops)
        comm = sum(_time_ms(c, nbytes, calls) * n for _, nbytes, n, calls in ops)
        if c.sync_ms is not None:
            # A measured sync: scale it by how many gradient syncs the mode issues per step.
            grad_syncs = sum(n for name, _, n, _ in ops if name != "all-gather")
            gathers = sum(
                _time_ms(c, nbytes, calls) * n
                for name, nbytes, n, calls in ops
                if name == "all-gather"
            )
            comm = grad_syncs * c.sync_ms + gathers
        step = c.k * c.compute_ms + c.optimizer_ms + comm
        rows.append(Row(backend, mode, sent, comm, step, 1.0))
    naive = {row.backend: row.step_ms for row in rows if row.mode.startswith("naive")}
    return [
        Row(r.backend, r.mode, r.sent_bytes, r.comm_ms, r.step_ms, naive[r.backend] / r.step_ms)
        for r in rows
    ]


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def format_table(cluster: Cluster, rows: list[Row], *, nodes: int, per_node: int) -> str:
    c = cluster
    sync = f", one gradient sync measured at {c.sync_ms:g} ms" if c.sync_ms is not None else ""
    lines = [
        f"estimate per optimizer step: gradients {_size(c.grad_bytes)}, parameters gathered "
        f"{_size(c.param_bytes)}; {c.world} ranks ({nodes} node(s) x {per_node}), k={c.k}; "
        f"{c.bandwidth_gbs:g} GB/s bus bandwidth and {c.latency_us:g} us per collective call; "
        f"compute {c.compute_ms:g} ms per micro-step, optimizer {c.optimizer_ms:g} ms{sync}",
        "(ring: all-reduce sends 2(N-1)/N x bytes per rank, reduce-scatter and all-gather (N-1)/N x "
        "bytes; time = calls x latency + bytes sent / bandwidth; no overlap with compute)",
        "",
        f"{'backend':<8} {'mode':<20} {'sent/rank':>11} {'comm ms':>10} {'step ms':>10} {'speed-up':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r.backend:<8} {r.mode:<20} {_size(r.sent_bytes):>11} {r.comm_ms:>10.1f} "
            f"{r.step_ms:>10.1f} {r.speedup:>8.2f}x"
        )
    return "\n".join(lines)


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
    rs = (s - 1) / s * g if s > 1 else 0.0  # reduce-scatter in the shard group
    ag = (s - 1) / s * p if s > 1 else 0.0  # all-gather in the shard group
    ar = 2 * (r - 1) / r * shard if r > 1 else 0.0  # all-reduce of the shard across replicas
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
    budget_bytes: float | None = None  # auto's budget per rank (None: auto's choice not shown)
    intra_gbs: float = INTRA_GBS  # bus bandwidth per rank inside a node, GB/s
    inter_gbs: float = INTER_GBS  # bus bandwidth per rank across nodes, GB/s
    latency_us: float = 0.0
    compute_ms: float = 0.0
    optimizer_ms: float = 0.0
    bucket_bytes: float = 25 * 2**20
    per_node: int | None = None  # processes per node (None: the dp_shard x tp block fits in one)

    def check(self) -> MeshCluster:
        for name in ("dp_replicate", "dp_shard", "tp", "k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be an integer >= 1")
        if not 0.0 <= self.tp_share <= 1.0:
            raise ConfigError(
                f"tp_share={self.tp_share!r} must be between 0 and 1 (the share of the "
                "model's bytes the TP plan shards)"
            )
        for name in ("tp_bytes", "budget_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name}={value!r} must be >= 0, or None when unknown")
        if self.per_node is not None and self.per_node % self.tp:
            raise ConfigError(
                f"tp={self.tp} does not divide the {self.per_node} processes per node: a TP "
                "group would span nodes; pick tp dividing the processes per node"
            )
        return self

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    def per_tp_rank(self, nbytes: float) -> float:
        """The bytes of ``nbytes`` one rank of a TP group holds: 1/T of the sharded share."""
        return nbytes * (self.tp_share / self.tp + 1.0 - self.tp_share)


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
    comm_ms: float  # data-parallel communication per step (TP traffic not included)
    step_ms: float
    speedup: float  # every_step step time / this step time


def auto_policy(rows: list[MeshRow], budget_bytes: float, replicas: int) -> str:
    """The policy ``auto`` picks on this mesh for a budget per rank: the first of ``defer +
    params``, ``defer``, ``defer_replicate`` (more than one replica) whose ``deferral_bytes``
    fit, else ``every_step``."""
    by = {row.policy: row for row in rows}
    order = ["defer + params", "defer"] + (["defer_replicate"] if replicas > 1 else [])
    return next((p for p in order if by[p].deferral_bytes <= budget_bytes), "every_step")


def estimate_mesh(cluster: MeshCluster) -> list[MeshRow]:
    """Bytes per mesh dimension per optimizer step and memory per rank, for each policy, on a
    (dp_replicate, dp_shard, tp) mesh.

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
        compute_ms=c.compute_ms,
        optimizer_ms=c.optimizer_ms,
        bucket_bytes=c.bucket_bytes,
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
    lines = [
        f"mesh dp_replicate={c.dp_replicate} x dp_shard={c.dp_shard} x tp={c.tp} ({c.world} ranks), k={c.k}: "
        f"gradients {_size(c.grad_bytes)} per model copy, {_size(g_t)} per TP rank{share}, "
        f"{_size(g_t / c.dp_shard)} per rank after dp_shard; {c.intra_gbs:g} GB/s inside a node, "
        f"{c.inter_gbs:g} GB/s across nodes, {c.latency_us:g} us per collective call",
        f"(dp_shard: reduce-scatter and all-gathers, (S-1)/S x bytes per rank; dp_replicate: the shard "
        f"all-reduced, 2(R-1)/R x G/S per rank; {tp}; grads / params: what a rank holds through the "
        "window; auto weighs: the bytes auto compares with its budget)",
    ]
    budget = ""
    if c.budget_bytes is not None:
        chosen = auto_policy(rows, c.budget_bytes, c.dp_replicate)
        budget = f"auto with a budget of {_size(c.budget_bytes)} per rank -> {chosen}"
    lines += [
        "",
        f"{'policy':<16} {'dp_shard/rank':>14} {'dp_repl/rank':>13} {'tp/rank':>10} {'grads':>10} "
        f"{'params':>10} {'extra':>10} {'auto weighs':>12} {'comm ms':>9} {'step ms':>9} {'speed-up':>9}",
    ]
    for row in rows:
        tp_text = "model-dep." if row.tp_bytes is None else _size(row.tp_bytes)
        lines.append(
            f"{row.policy:<16} {_size(row.shard_bytes):>14} {_size(row.replicate_bytes):>13} {tp_text:>10} "
            f"{_size(row.grad_memory):>10} {_size(row.param_memory):>10} {_size(row.extra_memory):>10} "
            f"{_size(row.deferral_bytes):>12} {row.comm_ms:>9.1f} {row.step_ms:>9.1f} {row.speedup:>8.2f}x"
        )
    if budget:
        lines += ["", budget]
    return "\n".join(lines)
