"""BatchPlan: global batch = micro batch x accumulation steps x data-parallel world size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gradsync._plan.accumulation_schedule import Constant, RampUp, Schedule, is_schedule, parse
from gradsync._support.util import check_positive_int
from gradsync.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    """A consistent set of batch sizes for one job: global batch = micro batch x
    accumulation steps x data-parallel size. ``accel.plan`` is the job's."""

    micro_batch_size: int | None
    """Samples per micro-batch and process (None: not known yet; the first prepared
    dataloader's batch size fixes it)."""
    gradient_accumulation_steps: int
    """Micro-batches per optimizer step (of the first window under a schedule)."""
    data_parallel_size: int
    """The processes that each see their own data."""

    @property
    def global_batch_size(self) -> int | None:
        """Samples per optimizer step over all processes (None while the micro batch size
        is unknown)."""
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

        Args:
            data_parallel_size: the processes that each see their own data.
            global_batch_size: samples per optimizer step over all processes.
            micro_batch_size: samples per micro-batch and process.
            gradient_accumulation_steps: micro-batches per optimizer step (a number; see
                ``solve_with_schedule`` for schedules).

        Returns:
            The plan (accumulation steps 1 when neither it nor the global batch size is given).

        Raises:
            ConfigError: a size that is not a whole number >= 1, a global batch size that is
                not divisible by the others, three sizes that contradict each other, or a
                global batch size alone.
        """
        world = check_positive_int("data_parallel_size", data_parallel_size)
        g = (
            None
            if global_batch_size is None
            else check_positive_int("global_batch_size", global_batch_size)
        )
        m = (
            None
            if micro_batch_size is None
            else check_positive_int("micro_batch_size", micro_batch_size)
        )
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
                    f"of {per_step} (e.g. {max(1, g // per_step) * per_step}){_worlds_that_keep(g, m)}"
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
        """The plan as one line of text.

        Returns:
            The sizes and their product, e.g. ``micro_batch_size=4 x
                gradient_accumulation_steps=8 x data_parallel_size=2 = global_batch_size=64``
                (``?`` for a size not known yet).
        """
        m = "?" if self.micro_batch_size is None else str(self.micro_batch_size)
        g = "?" if self.global_batch_size is None else str(self.global_batch_size)
        return (
            f"micro_batch_size={m} x gradient_accumulation_steps={self.gradient_accumulation_steps} "
            f"x data_parallel_size={self.data_parallel_size} = global_batch_size={g}"
        )


def _worlds_that_keep(global_batch: int, micro: int) -> str:
    """The data-parallel sizes on which ``global_batch`` stays whole with micro-batches of
    ``micro`` (an elastic job resumed on another world: which sizes would keep it)."""
    if global_batch % micro:
        return ""
    sizes = [w for w in range(1, global_batch // micro + 1) if (global_batch // micro) % w == 0]
    shown = ", ".join(map(str, sizes[:8])) + (", ..." if len(sizes) > 8 else "")
    return f", or run on {shown} data-parallel processes to keep it"


def solve_with_schedule(
    *,
    data_parallel_size: int,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    gradient_accumulation_steps: Any = None,
) -> tuple[BatchPlan, Schedule]:
    """The plan of the first window and the accumulation schedule.

    With a plain number this is ``BatchPlan.solve``. With a schedule, k changes during
    training, so ``global_batch_size`` can only be a ramp-up's target.
    """
    value = gradient_accumulation_steps
    if not is_schedule(value):
        plan = BatchPlan.solve(
            data_parallel_size=data_parallel_size,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            gradient_accumulation_steps=value,
        )
        return plan, Constant(plan.gradient_accumulation_steps)
    sched = parse(
        value,
        micro_batch_size=micro_batch_size,
        data_parallel_size=data_parallel_size,
        global_batch_size=global_batch_size,
    )
    if global_batch_size is not None and not isinstance(sched, RampUp):
        raise ConfigError(
            f"global_batch_size={global_batch_size} fixes k, but gradient_accumulation_steps="
            f"{sched.describe()!r} changes it during training; give micro_batch_size instead "
            "(or a ramp-up {'start': ..., 'increment': ..., 'samples': ...} to reach global_batch_size)"
        )
    plan = BatchPlan.solve(
        data_parallel_size=data_parallel_size,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=check_positive_int(
            "gradient_accumulation_steps", sched.steps_at(0)
        ),
    )
    return plan, sched
