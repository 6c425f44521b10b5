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

from gradsync._plan.accumulation_schedule import Constant, Schedule
from gradsync._support.util import check_positive_int
from gradsync.errors import UsageError


class MicroStep:
    """One micro-step's place in its window (read-only by convention: a plain slotted class,
    made on every micro-step, where a frozen dataclass costs microseconds to create).

    Attributes:
        index: the position in the window, from 0.
        size: the micro-batches in this window (the loss is scaled by 1/size).
        boundary: this micro-step closes the window: synchronise and step.
    """

    __slots__ = ("boundary", "index", "size")

    def __init__(self, index: int, size: int, boundary: bool) -> None:
        self.index = index
        self.size = size
        self.boundary = boundary

    def __repr__(self) -> str:
        return f"MicroStep(index={self.index}, size={self.size}, boundary={self.boundary})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MicroStep):
            return NotImplemented
        return (self.index, self.size, self.boundary) == (other.index, other.size, other.boundary)

    def __hash__(self) -> int:
        return hash((self.index, self.size, self.boundary))


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

    def lengths_ahead(self, n: int) -> tuple[list[int], bool]:
        """The first-dimension lengths of up to ``n`` batches after the last yielded one, and
        whether the pass ends after them."""


class FeedTicket:
    """The window's record of one tracked pass (opaque to the pass that holds it)."""

    __slots__ = ("fresh", "ref", "serial", "started_at")

    def __init__(self, feed: Feed, started_at: int, serial: int) -> None:
        self.ref: weakref.ref[Feed] = weakref.ref(feed)
        self.started_at = started_at
        self.serial = serial
        self.fresh = False


@dataclass
class _Split:
    """A loader batch that ``split_batch`` cut into ``n`` micro-batches of ``size`` rows."""

    n: int
    size: int
    feed: Feed | None = None
    done: int = 0  # micro-steps of it begun so far


class Window:
    """Counts micro-steps into windows of ``steps``; the end of the data closes a window early.

    At the start of each micro-step, ``begin()`` looks at the loader pass that fed it: how
    many batches remain in the epoch (None when unknown) and whether this batch is the
    last. A window opened with fewer batches remaining than ``steps`` has ``size ==
    remaining`` (the partial last window), so loss scaling weighs every micro-batch of that
    window equally. Without a prepared loader, ``remaining`` / ``last`` may be given.

    ``steps`` is an int or a ``Schedule`` of k by completed windows. With
    ``follow_data=False`` windows ignore where the data stands: they always hold ``steps``
    micro-batches and run on across the end of a pass.
    """

    def __init__(self, steps: int | Schedule, *, follow_data: bool = True) -> None:
        if isinstance(steps, int) or not hasattr(steps, "steps_at"):
            steps = Constant(check_positive_int("gradient_accumulation_steps", steps))
        self._schedule: Schedule = steps
        self._steps = check_positive_int("gradient_accumulation_steps", steps.steps_at(0))
        self._pending_steps: int | None = None
        self._fixed: int | None = None  # k set during the run (it replaced the schedule)
        self._follow_data = follow_data
        self._split: _Split | None = None
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
        """k of the window in progress or, between windows, of the next one (a change takes
        effect at the next window)."""
        if self._pending_steps is not None:
            return self._pending_steps
        if self.is_open:
            return self._steps
        return check_positive_int(
            "gradient_accumulation_steps", self._schedule.steps_at(self._completed)
        )

    @steps.setter
    def steps(self, value: int) -> None:
        """Use ``value`` from the next window on (it replaces a schedule)."""
        value = check_positive_int("gradient_accumulation_steps", value)
        self._schedule = Constant(value)
        self._fixed = value
        if self._index == 0 and self._current is None:
            self._steps = value
            self._pending_steps = None
        else:
            self._pending_steps = value

    @property
    def schedule(self) -> Schedule:
        return self._schedule

    def split(self, n: int, size: int) -> None:
        """The loader batch just yielded is cut into ``n`` micro-batches of ``size`` rows: the
        next ``n`` micro-steps come from it (``Accelerator.split_batch``)."""
        if self._split is not None and self._split.done < self._split.n:
            raise UsageError(
                f"split_batch() was called again while {self._split.n - self._split.done} "
                "micro-batch(es) of the previous split have not run yet; run one accumulate() "
                "block per micro-batch it returned"
            )
        self._split = _Split(n, size)

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
        """The open window is being fed by a pass of ``loader`` (never with follow_data=False:
        windows then run on into the next pass)."""
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
        tickets = self._tickets
        if len(tickets) == 1:  # one loader: the common case, without the bookkeeping below
            only = tickets[0]
            feed = only.ref()
            if feed is None or feed.done:
                self._tickets = []
                return None
            if not only.fresh:
                return None
            only.fresh = False
            return feed
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
                if best is None or (ticket.started_at, -ticket.serial) > (
                    best.started_at,
                    -best.serial,
                ):
                    best, best_feed = ticket, feed
        self._tickets = live
        return best_feed

    # -- driven by the Accelerator ------------------------------------------
    def begin(
        self, *, remaining: int | None = None, last: bool = False, force: bool | None = None
    ) -> MicroStep:
        """Start a micro-step and decide whether it is a boundary (``force``: the caller
        decides, as ``no_sync`` / ``trigger_sync_in_backward`` do; the loss is then scaled
        by the planned k, whatever the number of micro-steps the window ends up with)."""
        if self._current is not None:
            raise UsageError(
                "accumulate() was entered again before the previous micro-step ended; "
                "use one `with accel.accumulate(model):` block per micro-batch, not nested ones"
            )
        feed = self._feeding()
        split = self._split_step(feed) if self._split is not None else None
        if split is not None:
            feed = split.feed
        if self._index == 0:  # a window starts: its k, from the schedule (or the user's change)
            self._pending_steps = None
            self._steps = check_positive_int(
                "gradient_accumulation_steps", self._schedule.steps_at(self._completed)
            )
        if feed is not None and self._follow_data:
            remaining, last = feed.remaining, feed.last
            if split is not None:
                remaining, last = self._split_position(split, remaining, last)
        if self._resumed and feed is not None:
            # A window loaded mid-way: the resumed pass of its loader goes on feeding it.
            self._resumed = False
            self._feeder, self._feed = feed.owner, feed
        if self._index == 0:
            self._feeder = feed.owner if feed is not None and self._follow_data else None
            self._feed = feed
            self._items = None
            if remaining is None and feed is not None and self._follow_data and split is None:
                remaining = feed.peek(self._steps)  # unsized: look up to a window ahead
                last = remaining == 1
            self._size = self._steps if remaining is None else max(1, min(self._steps, remaining))
        if force is not None:
            self._current = MicroStep(self._index, self._steps, force)
            self._boundary = force
            return self._current
        boundary = last or self._index + 1 >= self._size
        if last and self._index + 1 < self._size:
            # An epoch ended early without a known length: the window is shorter than planned.
            self._size = self._index + 1
        self._current = MicroStep(self._index, self._size, boundary)
        self._boundary = boundary
        return self._current

    def _split_step(self, feed: Feed | None) -> _Split | None:
        """The split this micro-step belongs to, if any (advancing it)."""
        split = self._split
        if split is None:
            return None
        if split.feed is None:  # the first micro-batch of the split: the batch was just fed
            if feed is None:
                raise UsageError(
                    "split_batch() was called, but no prepared dataloader fed the batch it split; "
                    "split batches of a loader returned by accel.prepare(...)"
                )
            split.feed = feed
        elif feed is not None:
            raise UsageError(
                f"a new batch was fed while {split.n - split.done} micro-batch(es) of the "
                "previous split_batch() had not run; run one accumulate() block per micro-batch"
            )
        split.done += 1
        if split.done == split.n:
            self._split = None
        return split

    def _split_position(
        self, split: _Split, remaining: int | None, last: bool
    ) -> tuple[int | None, bool]:
        """Micro-steps left in the pass (this one included) and whether this is its last,
        counting every later loader batch as the micro-batches it will be split into."""
        assert split.feed is not None
        here = split.n - split.done + 1
        if last:
            return here, here == 1
        lengths, ends = split.feed.lengths_ahead(self._steps)
        ahead = sum(-(-n // split.size) for n in lengths)
        return (here + ahead if ends else None), False

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
        self._split = None
        self._boundary = False
        self._resumed = False

    # -- checkpoints -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where training stands: windows completed, the micro-step within the open window,
        its size and the schedule (plain values, the same on every rank)."""
        if self._current is not None:
            raise UsageError(
                "the accumulation window cannot be saved inside `with accel.accumulate(model):`; "
                "call accel.save_state() after the block"
            )
        if self._split is not None and self._split.done < self._split.n:
            raise UsageError(
                f"the accumulation window cannot be saved with {self._split.n - self._split.done} "
                "micro-batch(es) of a split_batch() still to run; save after its last micro-batch"
            )
        return {
            "steps": self._steps,
            "pending_steps": self._pending_steps,
            "index": self._index,
            "size": self._size,
            "boundary": self._boundary,
            "completed": self._completed,
            "items": self._items,
            "fixed": self._fixed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put the window back where ``state_dict`` found it; an open window is fed on by the
        next pass of a prepared loader (its resumed pass)."""
        self._steps = check_positive_int("gradient_accumulation_steps", state["steps"])
        pending = state.get("pending_steps")
        self._pending_steps = None
        if pending is not None:  # a change of k made during the saved window
            self._pending_steps = check_positive_int("gradient_accumulation_steps", pending)
            self._schedule = Constant(self._pending_steps)
        fixed = state.get("fixed")
        if fixed is not None:  # k was set during the saved run: it goes on with it
            self._fixed = check_positive_int("gradient_accumulation_steps", fixed)
            self._schedule = Constant(self._fixed)
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

    # ``boundary`` reads the window's field directly: it runs on every micro-step.
    @property
    def boundary(self) -> bool:
        return self._window._boundary

    @property
    def is_open(self) -> bool:
        return self._window.is_open

    @property
    def skips_step(self) -> bool:
        return self._window.skips_step
