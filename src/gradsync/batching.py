"""BatchPlan: global batch = micro batch x accumulation steps x data-parallel world size."""

from __future__ import annotations

from dataclasses import dataclass

from gradsync._util import check_positive_int
from gradsync.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    """A consistent set of batch sizes for one job."""

    micro_batch_size: int | None
    gradient_accumulation_steps: int
    data_parallel_size: int

    @property
    def global_batch_size(self) -> int | None:
        if self.micro_batch_size is None:
            return None
        return self.micro_batch_size * self.gradient_accumulation_steps * self.data_parallel_size

    @classmethod
    def solve(
        cls,
        *,
        data_parallel_size: int,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        gradient_accumulation_steps: int | None = None,
    ) -> BatchPlan:
        """Derive the missing size from the two given; check all three agree when all are given.

        With only ``gradient_accumulation_steps`` (or nothing) the micro batch size stays unknown.
        """
        world = check_positive_int("data_parallel_size", data_parallel_size)
        g = None if global_batch_size is None else check_positive_int("global_batch_size", global_batch_size)
        m = None if micro_batch_size is None else check_positive_int("micro_batch_size", micro_batch_size)
        k = (
            None
            if gradient_accumulation_steps is None
            else check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
        )
        if g is not None and m is not None:
            per_step = m * world
            if g % per_step:
                raise ConfigError(
                    f"global_batch_size={g} is not divisible by micro_batch_size x world size "
                    f"= {m} x {world} = {per_step}; choose a global batch size that is a multiple "
                    f"of {per_step} (e.g. {max(1, g // per_step) * per_step})"
                )
            derived = g // per_step
            if k is not None and k != derived:
                raise ConfigError(
                    f"gradient_accumulation_steps={k} contradicts global_batch_size={g} / "
                    f"(micro_batch_size={m} x world size {world}) = {derived}; give only two of the three"
                )
            return cls(m, derived, world)
        if g is not None and k is not None:
            per_micro = k * world
            if g % per_micro:
                raise ConfigError(
                    f"global_batch_size={g} is not divisible by gradient_accumulation_steps x world "
                    f"size = {k} x {world} = {per_micro}; choose a global batch size that is a "
                    f"multiple of {per_micro}"
                )
            return cls(g // per_micro, k, world)
        if g is not None:
            raise ConfigError(
                f"global_batch_size={g} needs micro_batch_size or gradient_accumulation_steps "
                "to derive the other; give one of them too"
            )
        return cls(m, k if k is not None else 1, world)

    def describe(self) -> str:
        m = "?" if self.micro_batch_size is None else str(self.micro_batch_size)
        g = "?" if self.global_batch_size is None else str(self.global_batch_size)
        return (
            f"micro_batch_size={m} x gradient_accumulation_steps={self.gradient_accumulation_steps} "
            f"x data_parallel_size={self.data_parallel_size} = global_batch_size={g}"
        )
