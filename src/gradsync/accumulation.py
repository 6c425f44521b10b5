"""The accumulation window: which micro-step closes it, and how many micro-batches it holds.

It knows nothing of backends or tensors. The Accelerator asks it at the start of each
micro-step whether to synchronise, and tells it when the micro-step is over.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradsync.batching import check_positive_int


@dataclass(frozen=True)
class MicroStep:
    """One micro-step's place in its window."""

    index: int  # position in the window, from 0
    size: int  # micro-batches in this window (the loss is scaled by 1/size)
    sync: bool  # this micro-step closes the window: synchronise and step


class Window:
    """Counts micro-steps into windows of ``steps``; the end of the data closes a window early.

    ``begin(remaining=..., last=...)`` is called at the start of each micro-step:
    ``remaining`` is how many batches are left in the epoch including this one (None when
    unknown), ``last`` whether this batch is the epoch's last. A window opened with
    ``remaining < steps`` has ``size == remaining`` (the partial last window), so loss
    scaling weighs every micro-batch of that window equally.
    """

    def __init__(self, steps: int) -> None:
        self._steps = check_positive_int("gradient_accumulation_steps", steps)
        self._pending_steps: int | None = None
        self._index = 0
        self._size = self._steps
        self._current: MicroStep | None = None
        self.completed_windows = 0

    @property
    def steps(self) -> int:
        """The configured window length (a change takes effect at the next window)."""
        return self._pending_steps if self._pending_steps is not None else self._steps

    @steps.setter
    def steps(self, value: int) -> None:
        value = check_positive_int("gradient_accumulation_steps", value)
        if self._index == 0 and self._current is None:
            self._steps = value
            self._pending_steps = None
        else:
            self._pending_steps = value

    @property
    def current(self) -> MicroStep | None:
        """The micro-step in progress, or None between micro-steps."""
        return self._current

    @property
    def at_window_start(self) -> bool:
        return self._index == 0

    def begin(self, *, remaining: int | None = None, last: bool = False) -> MicroStep:
        if self._current is not None:
            raise RuntimeError(
                "accumulate() was entered again before the previous micro-step ended; "
                "use one `with accel.accumulate(model):` block per micro-batch, not nested ones"
            )
        if self._index == 0:
            if self._pending_steps is not None:
                self._steps, self._pending_steps = self._pending_steps, None
            self._size = self._steps if remaining is None else max(1, min(self._steps, remaining))
        sync = last or self._index + 1 >= self._size
        if last and self._index + 1 < self._size:
            # An epoch ended early without a known length: the window is shorter than planned.
            self._size = self._index + 1
        self._current = MicroStep(self._index, self._size, sync)
        return self._current

    def end(self) -> MicroStep:
        step = self._current
        if step is None:
            raise RuntimeError("Window.end() without begin()")
        self._current = None
        if step.sync:
            self._index = 0
            self.completed_windows += 1
        else:
            self._index += 1
        return step

    def reset(self) -> None:
        """Drop a partly filled window (e.g. when a new epoch starts without a flush)."""
        self._index = 0
        self._current = None
