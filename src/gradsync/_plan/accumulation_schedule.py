"""Accumulation schedules: how many micro-batches each window holds, by completed windows.

``gradient_accumulation_steps`` may be

* an int (the same k for every window),
* a step-keyed schedule, ``"0:2 100:4 300:8"``: from optimizer step 0 use 2, from step 100
  use 4, from step 300 use 8 (a dict ``{0: 2, 100: 4}`` means the same),
* a global-batch-size ramp-up in the style of Megatron's ``rampup_batch_size``,
  ``{"start": 64, "increment": 64, "samples": 100000}``: the global batch starts at
  ``start`` and grows by ``increment`` in equal steps over the first ``samples`` samples
  until it reaches ``global_batch_size``,
* a callable ``optimizer_step -> k``.

"Optimizer step" means a completed window: a step that fp16 skipped still counts, so every
rank agrees. A change takes effect when the next window starts. No torch here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gradsync._support.util import check_positive_int
from gradsync.errors import ConfigError


class Schedule(Protocol):
    def steps_at(self, window: int) -> int:
        """k for the window that starts after ``window`` completed windows."""

    def describe(self) -> str:
        """One line for logs and ``gradsync plan``."""


@dataclass(frozen=True)
class Constant:
    k: int

    def steps_at(self, window: int) -> int:
        return self.k

    def describe(self) -> str:
        return str(self.k)


@dataclass(frozen=True)
class StepKeyed:
    """k by optimizer step: ``points`` is a sorted tuple of (first step, k), from step 0."""

    points: tuple[tuple[int, int], ...]

    def steps_at(self, window: int) -> int:
        k = self.points[0][1]
        for start, value in self.points:
            if window >= start:
                k = value
            else:
                break
        return k

    def describe(self) -> str:
        return " ".join(f"{start}:{k}" for start, k in self.points)


@dataclass(frozen=True)
class RampUp:
    """The global batch grows from ``start`` by ``increment`` over ``samples`` samples up to
    ``target``; k = global batch / (micro batch x data-parallel world)."""

    start: int
    increment: int
    samples: int
    target: int
    per_micro_step: int  # micro batch size x data-parallel world size
    # Samples consumed before each window, extended as windows are asked for (each window
    # start asks; recomputing from window 0 every time would grow with the run's length).
    _consumed: list[int] = field(default_factory=lambda: [0], init=False, compare=False, repr=False)

    def global_batch_at(self, consumed: int) -> int:
        increments = (self.target - self.start) // self.increment
        if increments <= 0:
            return self.target
        per_increment = self.samples / increments
        return min(self.target, self.start + self.increment * int(consumed // per_increment))

    def steps_at(self, window: int) -> int:
        consumed = self._consumed
        while len(consumed) <= window and consumed[-1] < self.samples:
            consumed.append(consumed[-1] + self.global_batch_at(consumed[-1]))
        if window > 0 and (window >= len(consumed) or consumed[window] >= self.samples):
            return self.target // self.per_micro_step  # the ramp is over
        return self.global_batch_at(consumed[window]) // self.per_micro_step

    def describe(self) -> str:
        return (
            f"ramp-up: global batch {self.start} + {self.increment} per step over "
            f"{self.samples} samples, up to {self.target}"
        )


@dataclass(frozen=True)
class FromCallable:
    fn: Callable[[int], int]

    def steps_at(self, window: int) -> int:
        return check_positive_int(f"gradient_accumulation_steps({window})", self.fn(window))

    def describe(self) -> str:
        return f"{getattr(self.fn, '__qualname__', repr(self.fn))}(optimizer_step)"


def is_schedule(value: Any) -> bool:
    """``value`` is a schedule rather than a plain number of steps."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return False
    if isinstance(value, str):
        text = value.strip()
        return ":" in text or text.startswith("{")
    return isinstance(value, Mapping) or callable(value)


def parse_step_keyed(text: str) -> StepKeyed:
    """``"0:2 100:4"`` (spaces or commas between entries) -> StepKeyed."""
    points: dict[int, int] = {}
    for entry in text.replace(",", " ").split():
        step, sep, k = entry.partition(":")
        if not sep or not step.strip().isdigit():
            raise ConfigError(
                f"gradient_accumulation_steps={text!r}: {entry!r} is not STEP:K; write the schedule "
                "as 'STEP:K STEP:K ...' with whole numbers, e.g. '0:2 100:4 300:8'"
            )
        points[int(step)] = check_positive_int(
            f"gradient_accumulation_steps (at step {step})", k.strip()
        )
    return _keyed(points, text)


def _keyed(points: Mapping[int, int], shown: object) -> StepKeyed:
    if 0 not in points:
        raise ConfigError(
            f"gradient_accumulation_steps={shown!r} must say k from optimizer step 0 (e.g. '0:2 100:4')"
        )
    return StepKeyed(tuple(sorted(points.items())))


def parse(
    value: Any,
    *,
    micro_batch_size: int | None = None,
    data_parallel_size: int = 1,
    global_batch_size: int | None = None,
) -> Schedule:
    """A Schedule from any accepted form (see the module doc)."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except ValueError:
                raise ConfigError(
                    f"gradient_accumulation_steps={text!r} is not valid JSON"
                ) from None
        elif ":" in text:
            return parse_step_keyed(text)
        else:
            return Constant(check_positive_int("gradient_accumulation_steps", text))
    if isinstance(value, Mapping):
        if set(value) >= {"start", "increment", "samples"}:
            return _ramp(value, micro_batch_size, data_parallel_size, global_batch_size)
        try:
            points = {
                int(k): check_positive_int(f"gradient_accumulation_steps (at step {k})", v)
                for k, v in value.items()
            }
        except (TypeError, ValueError):
            raise ConfigError(
                f"gradient_accumulation_steps={dict(value)!r} is neither a ramp-up "
                "{'start': G0, 'increment': I, 'samples': N} nor a step-keyed {step: k} mapping"
            ) from None
        return _keyed(points, dict(value))
    if callable(value) and not isinstance(value, type):
        return FromCallable(value)
    return Constant(check_positive_int("gradient_accumulation_steps", value))


def _ramp(value: Mapping[str, Any], micro: int | None, world: int, target: int | None) -> RampUp:
    unknown = set(value) - {"start", "increment", "samples"}
    if unknown:
        raise ConfigError(
            f"gradient_accumulation_steps ramp-up has unknown key(s) {', '.join(sorted(unknown))}; "
            "use start, increment and samples"
        )
    start = check_positive_int("gradient_accumulation_steps ramp-up start", value["start"])
    increment = check_positive_int(
        "gradient_accumulation_steps ramp-up increment", value["increment"]
    )
    samples = check_positive_int("gradient_accumulation_steps ramp-up samples", value["samples"])
    if micro is None or target is None:
        raise ConfigError(
            "a global-batch-size ramp-up needs micro_batch_size and global_batch_size (the batch "
            "it ramps up to); give both"
        )
    per = micro * world
    for name, number in (("start", start), ("increment", increment), ("global_batch_size", target)):
        if number % per:
            raise ConfigError(
                f"ramp-up {name}={number} is not a multiple of micro_batch_size x world size = "
                f"{micro} x {world} = {per}; every global batch of the ramp must split into whole "
                "micro-batches"
            )
    if start > target:
        raise ConfigError(f"ramp-up start={start} is above global_batch_size={target}")
    return RampUp(start, increment, samples, target, per)


def check(value: Any) -> None:
    """Validate what can be checked without the batch sizes (a ramp-up needs them)."""
    if isinstance(value, str) and value.strip().startswith("{"):
        try:
            value = json.loads(value)
        except ValueError:
            raise ConfigError(f"gradient_accumulation_steps={value!r} is not valid JSON") from None
    if isinstance(value, Mapping) and set(value) >= {"start", "increment", "samples"}:
        for key in ("start", "increment", "samples"):
            check_positive_int(f"gradient_accumulation_steps ramp-up {key}", value[key])
        return
    parse(value)
