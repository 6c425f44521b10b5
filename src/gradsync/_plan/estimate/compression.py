"""What ``comm_hook`` makes of one gradient reduction: the bytes handed to the process group,
as gradsync's audit counts them (no torch).

* ``"no"``: the gradients as they are, numel x their dtype's bytes.
* ``"fp16"`` / ``"bf16"``: numel x 2 (nothing saved when the gradients are 2-byte already).
* ``"power_sgd"`` (DDP only), laid out as torch's ``powerSGD_hook`` does: each gradient is
  viewed as an n x m matrix (n its first dimension, m the rest), and the rank is
  r' = min(n, m, r). Where (n + m) r' x ``min_compression_rate`` < n m, its P (n x r') and
  Q (m x r') are all-reduced; every other tensor, the 1-D ones (biases, norms) always among
  them, is all-reduced whole. ``comm_wrapper`` fp16 / bf16 sends all of it in 2 bytes.
* ``"batched_power_sgd"``: each bucket as one square matrix of side s = ceil(sqrt(numel)),
  P and Q of s x min(s, r) each; buckets of ``bucket_bytes`` (DDP's smaller first bucket and
  its rebuilt layout are not modelled).

PowerSGD sends the plain gradients for its first ``start_powerSGD_iter`` optimizer steps
(counted once per window under deferral, once per micro-step under every_step); the
estimate is of the steps after. The shapes come from ``parse_shapes``: ``"4096x4096*32,
4096*65"`` is 32 matrices of 4096 x 4096 and 65 vectors of 4096.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradsync._support.util import unknown
from gradsync.errors import ConfigError
from gradsync.options.compression import COMM_HOOKS, COMM_WRAPPERS, POWER_SGD

__all__ = ["Compression", "fsdp_hook", "parse_shapes"]

#: The backends of the flat estimate that run each hook ("no" runs everywhere).
RUNS_ON: dict[str, tuple[str, ...]] = {
    "fp16": ("ddp", "fsdp", "zero2", "zero3"),
    "bf16": ("ddp", "fsdp", "zero2", "zero3"),
}
RUNS_ON.update({hook: ("ddp",) for hook in POWER_SGD})


def parse_shapes(text: str) -> tuple[tuple[int, ...], ...]:
    """Gradient shapes from ``"AxB[xC...][*count],..."`` (e.g. ``"4096x4096*32,4096*65"``).

    Raises:
        ConfigError: a part that is not a shape, in one line.
    """
    shapes: list[tuple[int, ...]] = []
    for part in (p.strip() for p in text.split(",")):
        dims, _, count = part.partition("*")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x"))
            times = int(count) if count else 1
        except ValueError:
            shape, times = (), 0
        if not shape or times < 1 or min(shape) < 1:
            raise ConfigError(
                f"--shapes: {part!r} is no shape; give AxB[xC][*count], comma-separated, "
                "e.g. 4096x4096*32,4096*65 (32 matrices of 4096 x 4096, 65 vectors of 4096)"
            )
        shapes += [shape] * times
    return tuple(shapes)


@dataclass(frozen=True)
class Compression:
    """A ``comm_hook`` and what its payload depends on."""

    hook: str = "no"
    wrapper: str = "no"  # PowerSGD's matrices sent as fp16 / bf16 ("no": the gradients' dtype)
    rank: int = 1  # PowerSGD's matrix_approximation_rank
    min_compression_rate: float = 2.0  # PowerSGD's: compress where it saves this factor
    shapes: tuple[tuple[int, ...], ...] = ()  # the gradients' shapes (PowerSGD needs them)

    def check(self) -> Compression:
        if self.hook not in COMM_HOOKS:
            raise ConfigError(unknown("comm_hook", self.hook, COMM_HOOKS))
        if self.wrapper not in COMM_WRAPPERS or (
            self.wrapper != "no" and self.hook not in POWER_SGD
        ):
            raise ConfigError(
                f"comm_wrapper={self.wrapper!r} needs a PowerSGD comm_hook and one of "
                f"{', '.join(COMM_WRAPPERS)}"
            )
        if self.rank < 1 or self.min_compression_rate <= 0:
            raise ConfigError(
                f"matrix_approximation_rank={self.rank!r} must be >= 1 and "
                f"min_compression_rate={self.min_compression_rate!r} > 0"
            )
        if self.hook == "power_sgd" and not self.shapes:
            raise ConfigError(
                "comm_hook='power_sgd' compresses each weight matrix by its shape: give the "
                "model's gradient shapes, e.g. --shapes 4096x4096*32,4096*65"
            )
        return self

    @property
    def numel(self) -> int:
        """The elements of the given shapes (0: none given)."""
        return sum(math.prod(shape) for shape in self.shapes)

    def payload(self, grad_bytes: float, dtype_bytes: float, bucket_bytes: float) -> float:
        """The bytes one reduction of ``grad_bytes`` of gradients (``dtype_bytes`` each) hands
        to the process group under this hook.

        Args:
            grad_bytes: the gradients' bytes, uncompressed.
            dtype_bytes: the bytes of one gradient element.
            bucket_bytes: the bucket size (``batched_power_sgd`` compresses bucket by bucket).
        """
        numel = grad_bytes / dtype_bytes
        if self.hook == "no":
            return grad_bytes
        if self.hook in ("fp16", "bf16"):
            return numel * min(2.0, dtype_bytes)
        size = min(2.0, dtype_bytes) if self.wrapper != "no" else dtype_bytes
        if self.hook == "batched_power_sgd":
            per_bucket = max(1, math.floor(bucket_bytes / dtype_bytes))
            buckets = [per_bucket] * int(numel // per_bucket)
            if numel % per_bucket:
                buckets.append(math.ceil(numel % per_bucket))
            sides = [math.ceil(math.sqrt(b)) for b in buckets]
            return size * sum(2 * s * min(s, self.rank) for s in sides)
        elements = 0
        for shape in self.shapes:
            n = shape[0]
            m = math.prod(shape[1:])
            r = min(n, m, self.rank)
            worth = (n + m) * r * self.min_compression_rate < n * m
            elements += (n + m) * r if worth else n * m
        return size * elements * (numel / self.numel)

    def factor(self, grad_bytes: float, dtype_bytes: float, bucket_bytes: float) -> float:
        """``payload`` over the uncompressed bytes."""
        return self.payload(grad_bytes, dtype_bytes, bucket_bytes) / grad_bytes

    def describe(self) -> str:
        """The hook as the estimate's header names it."""
        if self.hook not in POWER_SGD:
            return f"comm_hook={self.hook}"
        wrapper = f", comm_wrapper={self.wrapper}" if self.wrapper != "no" else ""
        return f"comm_hook={self.hook} (rank {self.rank}{wrapper})"


def fsdp_hook(compression: Compression) -> Compression:
    """``compression`` checked for the FSDP2 estimates (HSDP, N-D mesh): fp16 and bf16 are
    its reduce dtype; PowerSGD is one line, as the adapter says it."""
    compression.check()
    if compression.hook in POWER_SGD:
        raise ConfigError(
            f"comm_hook={compression.hook!r} runs on ddp only, and the HSDP and N-D mesh "
            "estimates are FSDP2's (its reduce dtype): use comm_hook fp16 or bf16 there"
        )
    return compression
