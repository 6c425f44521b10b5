"""How many optimizer steps a run will take, and whether an LR scheduler was built for them."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from gradsync._plan.accumulation_schedule import Schedule
from gradsync._support.util import check_positive_int
from gradsync.errors import UsageError

log = logging.getLogger("gradsync")


def plan_steps(
    schedule: Schedule,
    batches_per_epoch: int,
    num_epochs: int,
    *,
    start: int = 0,
    follow_data: bool = True,
) -> int:
    """Optimizer steps of ``num_epochs`` passes of ``batches_per_epoch`` micro-batches, windows
    sized by ``schedule`` from ``start`` completed windows on. With ``follow_data`` every pass
    ends its last window early (the partial window is a step); without, windows run on across
    passes and a last unfinished window is not a step."""
    window = start
    if follow_data:
        for _ in range(num_epochs):
            left = batches_per_epoch
            while left > 0:
                left -= min(schedule.steps_at(window), left)
                window += 1
        return window - start
    left = batches_per_epoch * num_epochs
    while left >= (k := schedule.steps_at(window)):
        left -= k
        window += 1
    return window - start


def declared_total(scheduler: Any) -> tuple[int, str] | None:
    """The number of steps an LR scheduler says it was built for, and where it says so."""
    inner = getattr(scheduler, "scheduler", scheduler)
    if isinstance(inner, torch.optim.lr_scheduler.OneCycleLR):
        return int(inner.total_steps), "OneCycleLR total_steps"
    if isinstance(inner, torch.optim.lr_scheduler.PolynomialLR):
        return int(inner.total_iters), "PolynomialLR total_iters"
    total = getattr(inner, "total_steps", None)
    if isinstance(total, int):
        return total, f"{type(inner).__name__}.total_steps"
    for fn in getattr(inner, "lr_lambdas", []):  # e.g. Transformers' get_*_schedule_with_warmup
        if isinstance(fn, functools.partial) and isinstance(
            fn.keywords.get("num_training_steps"), int
        ):
            return int(fn.keywords["num_training_steps"]), "LambdaLR num_training_steps"
    return None


def length_mismatch(scheduler: Any, planned: int) -> str | None:
    """A warning when an LR scheduler was built for another number of steps than planned."""
    found = declared_total(scheduler)
    if found is None or found[0] == planned:
        return None
    total, where = found
    return (
        f"gradsync: the LR scheduler was built for {total} steps ({where}), but the run will take "
        f"{planned} optimizer steps (accel.planned_optimizer_steps); build it with {planned} so "
        "its schedule ends with the training"
        + (
            f" ({total} = {total // planned} x {planned}: sized for Accelerate's rule, one "
            "scheduler step per process per update; gradsync.accelerate.Accelerator keeps "
            "that rule)"
            if planned and total % planned == 0 and total > planned
            else ""
        )
    )


def sized_per_process(scheduler: Any, steps_done: int, processes: int) -> str | None:
    """A warning when a run ends with its LR schedule about 1/``processes`` done: the
    schedule was sized for Accelerate's rule (the scheduler steps once per process per
    optimizer step), and under gradsync's rule (once per optimizer step) it stops early."""
    found = declared_total(scheduler)
    if found is None or processes < 2 or steps_done < 1:
        return None
    total, where = found
    # Stopped short, and nearer N x the steps taken than the steps taken (Accelerate's sizing,
    # whose per-epoch ceilings over the whole dataset make it only roughly N x).
    if steps_done > 0.75 * total or abs(total - processes * steps_done) >= abs(total - steps_done):
        return None
    lr = ", ".join(f"{v:.3g}" for v in getattr(scheduler, "get_last_lr", list)())
    return (
        f"gradsync: the run ended after {steps_done} optimizer steps, but its LR scheduler was "
        f"built for {total} steps ({where}), nearer {processes} x as many: it was sized for "
        f"Accelerate's rule (the scheduler steps once per process per update) and stopped "
        f"{'at LR ' + lr + ' ' if lr else ''}short of its end; import Accelerator from "
        "gradsync.accelerate to keep Accelerate's rule, or build the scheduler for "
        "accel.planned_optimizer_steps(num_epochs) steps"
    )


def warn_unfinished(
    schedulers: list[Any], steps: Any, processes: int, main: bool, warn: Any
) -> None:
    """At the end of a run (``end()``, or at exit): ``sized_per_process`` for each
    scheduler, said once on the main process through ``warn``."""
    if not main:
        return
    for scheduler in schedulers:
        message = sized_per_process(scheduler, steps(), processes)
        if message is not None:
            warn(message)
            return


class Planner:
    """``accel.planned_optimizer_steps`` and the check of each prepared scheduler's length
    against it (one warning per scheduler built for another number of steps)."""

    def __init__(self, window: Any, prepared: Any, *, follow_data: bool) -> None:
        self._window = window
        self._prepared = prepared
        self._follow_data = follow_data
        self.planned: int | None = None
        self._warned: set[int] = set()

    def planned_optimizer_steps(self, num_epochs: int, loader: Any = None) -> int:
        """See ``Accelerator.planned_optimizer_steps``."""
        check_positive_int("num_epochs", num_epochs)
        loaders = self._prepared.loaders
        loader = loader if loader is not None else (loaders[0] if loaders else None)
        if loader is None:
            raise UsageError(
                "planned_optimizer_steps() needs a prepared dataloader: "
                "accel.prepare(loader) first, or pass loader=..."
            )
        try:
            per_epoch = len(loader)
        except TypeError:
            raise UsageError(
                "planned_optimizer_steps() needs a dataloader with a length; this one has none "
                "(an IterableDataset without __len__): count the steps yourself"
            ) from None
        self.planned = plan_steps(
            self._window.schedule,
            per_epoch,
            num_epochs,
            start=self._window.completed_windows,
            follow_data=self._follow_data,
        )
        for scheduler in self._prepared.schedulers:
            self.check_length(scheduler)
        return self.planned

    def check_length(self, scheduler: Any) -> None:
        """Warn once per scheduler built for another number of steps than planned."""
        if self.planned is None or id(scheduler) in self._warned:
            return
        message = length_mismatch(scheduler, self.planned)
        if message is not None:
            self._warned.add(id(scheduler))
            log.warning(message)
