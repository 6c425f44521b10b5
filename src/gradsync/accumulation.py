"""The accumulation window: the one owner of where training stands inside a window.

It decides which micro-step is a boundary (closes the window), how many micro-batches
the window holds (the loss scale), counts micro-steps and windows, and follows the
loader pass that feeds it. It knows nothing of backends or tensors. The Accelerator
drives it (``begin`` / ``end`` / ``drop``); prepared loaders tell it about their passes
(``track`` / ``fed``); everything else reads it through a ``WindowView``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gradsync._util import check_positive_int


@dataclass(frozen=True)
class MicroStep:
    """One micro-step's place in its window."""

    index: int  # position in the window, from 0
    size: int  # micro-batches in this window (the loss is scaled by 1/size)
    boundary: bool  # this micro-step closes the window: synchronise and step


class Feed(Protocol):
    """A pass over a prepared loader, as the window sees it."""

    @property
    def owner(self) -> object:
        """The loader this pass belongs to."""

    @property
    def remaining(self) -> int | None:
        """Batches left in the pass, the last yielded one included (None when unknown)."""

    @property
    def last(self) -> bool:
        """The last yielded batch is the pass's last."""

    @property
    def done(self) -> bool:
        """The pass is over."""

    def peek(self, n: int) -> int | None:
        """Read up to ``n`` batches ahead: ``remaining`` if the pass ends within them, else None."""

    def count_items(self, n: int, count: Callable[[Any], Any]) -> int:
        """Items (e.g. tokens) in the last yielded batch and the ``n - 1`` after it."""


class FeedTicket:
    """The window's record of one tracked pass (opaque to the pass that holds it)."""

    __slots__ = ("fresh", "ref", "serial", "started_at")

    def __init__(self, feed: Feed, started_at: int, serial: int) -> None:
        self.ref: weakref.ref[Feed] = weakref.ref(feed)
        self.started_at = started_at
        self.serial = serial
        self.fresh = False


class Window:
    """Counts micro-steps into windows of ``steps``; the end of the data closes a window early.

    At the start of each micro-step, ``begin()`` looks at the loader pass that fed it: how
    many batches remain in the epoch (None when unknown) and whether this batch is the
    last. A window opened with fewer batches remaining than ``steps`` has ``size ==
    remaining`` (the partial last window), so loss scaling weighs every micro-batch of that
    window equally. Without a prepared loader, ``remaining`` / ``last`` may be given.
    """

    def __init__(self, steps: int) -> None:
        self._steps = check_positive_int("gradient_accumulation_steps", steps)
        self._pending_steps: int | None = None
        self._index = 0
        self._size = self._steps
        self._current: MicroStep | None = None
        self._boundary = True  # the last decision (True before the first micro-step)
        self._completed = 0
        self._tickets: list[FeedTicket] = []
        self._yields = 0
        self._serial = 0
        self._feeder: object | None = None  # the loader whose pass feeds the open window
        self._feed: Feed | None = None  # that pass (held while the window is open)
        self._items: int | None = None  # items in the global window, when counted
        self._resumed = False  # loaded mid-window: the next pass that feeds it is adopted

    # -- reading ------------------------------------------------------------
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
    def boundary(self) -> bool:
        """The micro-step in progress closes its window; between micro-steps, the last
        micro-step's decision (False after a dropped window, True before the first)."""
        return self._boundary

    @property
    def is_open(self) -> bool:
        """Inside a micro-step, or between the micro-steps of an unfinished window."""
        return self._index > 0 or self._current is not None

    @property
    def completed_windows(self) -> int:
        return self._completed

    @property
    def feed(self) -> Feed | None:
        """The loader pass feeding the open window (None without a prepared loader)."""
        return self._feed

    @property
    def items(self) -> int | None:
        """Items (e.g. tokens) in the whole global window in progress, or the last one
        between windows; None until counted."""
        return self._items

    @property
    def skips_step(self) -> bool:
        """The window holds no item at all: its optimizer step is skipped."""
        return self._items == 0

    def set_items(self, n: int) -> None:
        """The Accelerator counted the window's items (all ranks, all micro-batches)."""
        self._items = n

    def fed_by(self, loader: object) -> bool:
        """The open window is being fed by a pass of ``loader``."""
        return self.is_open and self._feeder is loader

    @property
    def index(self) -> int:
        """Micro-steps done in the open window (0 between windows)."""
        return self._index

    # -- told by prepared loaders -------------------------------------------
    def track(self, feed: Feed) -> FeedTicket:
        """A loader pass starts; it calls ``fed(ticket)`` each time it yields a batch."""
        self._serial += 1
        ticket = FeedTicket(feed, self._yields, self._serial)
        self._tickets.append(ticket)
        return ticket

    def fed(self, ticket: FeedTicket) -> None:
        ticket.fresh = True
        self._yields += 1

    def _feeding(self) -> Feed | None:
        """The pass that fed this micro-step: of the passes that yielded since the previous
        micro-step, the one started last (an inner loop of a nested pair); among passes
        started together (``zip``), the first."""
        best: FeedTicket | None = None
        best_feed: Feed | None = None
        live: list[FeedTicket] = []
        for ticket in self._tickets:
            feed = ticket.ref()
            if feed is None or feed.done:
                continue
            live.append(ticket)
            if ticket.fresh:
                ticket.fresh = False
                if best is None or (ticket.started_at, -ticket.serial) > (best.started_at, -best.serial):
                    best, best_feed = ticket, feed
        self._tickets = live
        return best_feed

    # -- driven by the Accelerator ------------------------------------------
    def begin(self, *, remaining: int | None = None, last: bool = False) -> MicroStep:
        """Start a micro-step and decide whether it is a boundary."""
        if self._current is not None:
            raise RuntimeError(
                "accumulate() was entered again before the previous micro-step ended; "
                "use one `with accel.accumulate(model):` block per micro-batch, not nested ones"
            )
        feed = self._feeding()
        if feed is not None:
            remaining, last = feed.remaining, feed.last
        if self._resumed and feed is not None:
            # A window loaded mid-way: the resumed pass of its loader goes on feeding it.
            self._resumed = False
            self._feeder, self._feed = feed.owner, feed
        if self._index == 0:
            if self._pending_steps is not None:
                self._steps, self._pending_steps = self._pending_steps, None
            self._feeder = feed.owner if feed is not None else None
            self._feed = feed
            self._items = None
            if remaining is None and feed is not None:
                remaining = feed.peek(self._steps)  # unsized: look up to a window ahead
                last = remaining == 1
            self._size = self._steps if remaining is None else max(1, min(self._steps, remaining))
        boundary = last or self._index + 1 >= self._size
        if last and self._index + 1 < self._size:
            # An epoch ended early without a known length: the window is shorter than planned.
            self._size = self._index + 1
        self._current = MicroStep(self._index, self._size, boundary)
        self._boundary = boundary
        return self._current

    def end(self) -> MicroStep:
        """The micro-step finished; at a boundary the window closes."""
        step = self._current
        if step is None:
            raise RuntimeError("Window.end() without begin()")
        self._current = None
        if step.boundary:
            self._index = 0
            self._completed += 1
            self._feeder = None
            self._feed = None
        else:
            self._index += 1
        return step

    def drop(self) -> None:
        """Abandon the open window (an error inside it, or a new epoch before it closed):
        the next micro-step starts a new window, and nothing steps until it closes."""
        self._index = 0
        self._current = None
        self._feeder = None
        self._feed = None
        self._items = None
        self._boundary = False
        self._resumed = False

    # -- checkpoints -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where training stands: windows completed, the micro-step within the open window,
        its size and the schedule (plain values, the same on every rank)."""
        if self._current is not None:
            raise RuntimeError(
                "the accumulation window cannot be saved inside `with accel.accumulate(model):`; "
                "call accel.save_state() after the block"
            )
        return {
            "steps": self._steps, "pending_steps": self._pending_steps, "index": self._index,
            "size": self._size, "boundary": self._boundary, "completed": self._completed,
            "items": self._items,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put the window back where ``state_dict`` found it; an open window is fed on by the
        next pass of a prepared loader (its resumed pass)."""
        self._steps = check_positive_int("gradient_accumulation_steps", state["steps"])
        pending = state.get("pending_steps")
        self._pending_steps = None if pending is None else check_positive_int(
            "gradient_accumulation_steps", pending)
        self._index = int(state["index"])
        self._size = int(state["size"])
        self._boundary = bool(state["boundary"])
        self._completed = int(state["completed"])
        self._items = state.get("items")
        self._current = None
        self._feeder = None
        self._feed = None
        self._resumed = self._index > 0

    @property
    def view(self) -> WindowView:
        return WindowView(self)


class WindowView:
    """The window as the prepared optimizer sees it: read-only."""

    __slots__ = ("_window",)

    def __init__(self, window: Window) -> None:
        self._window = window

    @property
    def boundary(self) -> bool:
        return self._window.boundary

    @property
    def is_open(self) -> bool:
        return self._window.is_open

    @property
    def skips_step(self) -> bool:
        return self._window.skips_step
