"""The estimate on N data-parallel ranks: one row per backend and mode (``estimate``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from gradsync._plan.estimate.compression import RUNS_ON, Compression
from gradsync.errors import ConfigError

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
    dtype_bytes: float = 4.0  # bytes of one gradient element (what comm_hook compresses)
    # comm_hook: what each gradient reduction sends
    compression: Compression = field(default_factory=Compression)

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
        self.compression.check()
        return self

    @property
    def grad_factor(self) -> float:
        """What one gradient reduction sends under ``compression``, over its plain bytes."""
        return self.compression.factor(self.grad_bytes, self.dtype_bytes, self.bucket_bytes)


@dataclass(frozen=True)
class Row:
    backend: str
    mode: str  # "naive (every_step)", "defer", "defer + params"
    sent_bytes: float  # bytes each rank sends per optimizer step
    comm_ms: float  # communication time per optimizer step
    step_ms: float  # k * compute + optimizer + communication
    speedup: float  # naive step time / this step time
    payload_bytes: float = 0.0  # gradient reductions handed to the process group per step


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
    f = c.grad_factor  # comm_hook's share of the gradient bytes
    hook_calls = {"power_sgd": 3, "batched_power_sgd": 2}.get(c.compression.hook, 1)
    ar, rs, ag = (
        ("all-reduce", 2 * r * g * f, _calls(c, g) * hook_calls),
        ("reduce-scatter", r * g * f, _calls(c, g)),
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
    runs = RUNS_ON.get(c.compression.hook, BACKENDS)
    payload = c.grad_bytes * c.grad_factor
    rows: list[Row] = []
    for key, ops in _ops(c).items():
        backend, mode = key.split("/")
        if backend not in backends or backend not in runs:
            continue
        sent = sum(nbytes * n for _, nbytes, n, _ in ops)
        reductions = sum(n for name, _, n, _ in ops if name != "all-gather")
        comm = sum(_time_ms(c, nbytes, calls) * n for _, nbytes, n, calls in ops)
        if c.sync_ms is not None:
            # A measured sync: scale it by how many gradient syncs the mode issues per step.
            gathers = sum(
                _time_ms(c, nbytes, calls) * n
                for name, nbytes, n, calls in ops
                if name == "all-gather"
            )
            comm = reductions * c.sync_ms + gathers
        step = c.k * c.compute_ms + c.optimizer_ms + comm
        rows.append(Row(backend, mode, sent, comm, step, 1.0, reductions * payload))
    naive = {row.backend: row.step_ms for row in rows if row.mode.startswith("naive")}
    return [replace(r, speedup=naive[r.backend] / r.step_ms) for r in rows]


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
        f"{'backend':<8} {'mode':<20} {'sent/rank':>11} {'comm ms':>10} {'step ms':>10} "
        f"{'speed-up':>9} {'reduced':>11}",
    ]
    if c.compression.hook != "no":
        lines[2:2] = [
            hook_line(
                c.compression,
                c.grad_factor,
                c.grad_bytes,
                sync=c.sync_ms,
                column="; 'reduced': that per optimizer step, the bytes gradsync's audit counts",
            )
        ]
    for r in rows:
        lines.append(
            f"{r.backend:<8} {r.mode:<20} {_size(r.sent_bytes):>11} {r.comm_ms:>10.1f} "
            f"{r.step_ms:>10.1f} {r.speedup:>8.2f}x {_size(r.payload_bytes):>11}"
        )
    return "\n".join(lines)


def hook_line(
    compression: Compression,
    factor: float,
    grad_bytes: float,
    sync: float | None = None,
    column: str = "",
) -> str:
    """The header line that says what ``compression`` sends per gradient reduction."""
    runs = RUNS_ON[compression.hook]
    where = "" if len(runs) == len(BACKENDS) else f"; it runs on {', '.join(runs)} only"
    measured = "; the measured --sync-ms is taken as it is" if sync is not None else ""
    if compression.hook in ("power_sgd", "batched_power_sgd"):
        where += "; after its first start_powerSGD_iter steps, which send the plain gradients"
    return (
        f"{compression.describe()}: one gradient reduction hands {_size(grad_bytes * factor)} "
        f"to the process group instead of {_size(grad_bytes)} ({factor:.3f}x{column}){where}"
        f"{measured}"
    )
