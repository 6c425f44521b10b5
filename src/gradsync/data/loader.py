"""The prepared dataloader: passes that read ahead, know where the epoch stands and tell
the accumulation window; its position, for checkpoints.

Each pass over a prepared loader tells the window where the epoch stands (how many batches
remain, whether this batch is the last), so the window can close at the end of the data
and size the partial last window.
"""

from __future__ import annotations

import collections
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data.distributed import DistributedSampler

from gradsync._support import dist
from gradsync._support.util import check_non_negative_int, check_positive_int
from gradsync.data.batches import (
    batch_length,
    checked_count,
    halves,
    pieces,
    split_batch,
    to_device,
)
from gradsync.data.dealing import BatchDeal, IterableDeal
from gradsync.data.sharding import BatchShard
from gradsync.errors import ConfigError
from gradsync.storage.rng import RngState, dealing_rng, get_rng, set_rng

if TYPE_CHECKING:
    from gradsync._plan.window import Window

ItemCounter = Callable[[Any], Any]
log = logging.getLogger("gradsync")


@dataclass
class Epochs:
    """A prepared loader's epochs: the one place they are counted.

    ``next``: the epoch of the next pass (``set_epoch`` or counted up by itself);
    ``current``: the epoch of the pass in progress (or the last one); ``sampler_seen``: the
    epoch its DistributedSampler had when a pass last started (a change made in between is
    the user's own ``sampler.set_epoch``, which then drives the sampler)."""

    next: int = 0
    given: bool = False  # ``next`` was set by set_epoch (or a resume), not counted
    current: int = 0
    sampler_seen: int = 0
    user_drives_sampler: bool = False

    def start_pass(self, sampler: Any) -> int:
        """A pass starts: align a DistributedSampler, then move on; the pass's epoch."""
        if isinstance(sampler, DistributedSampler):
            if not self.given and sampler.epoch != self.sampler_seen:
                self.user_drives_sampler = True  # leave the sampler's epochs to the user
            if self.given or not self.user_drives_sampler:
                sampler.set_epoch(self.next)
            self.sampler_seen = sampler.epoch
        self.current = self.next
        self.next += 1
        self.given = False
        return self.current


@dataclass
class LoaderContext:
    """What the Accelerator that prepared a loader gives it (one per Accelerator)."""

    window: Window
    device: torch.device
    on_epoch_start: Callable[[PreparedDataLoader], None]
    count_items: ItemCounter | None = None
    #: The pass that yielded most recently, of any loader of this Accelerator (a weak reference).
    last_pass: weakref.ref[LoaderIteration] | None = None
    #: The passes begun and not known to have ended, in the order they began (weak references).
    begun: list[weakref.ref[LoaderIteration]] = field(default_factory=list)

    def iterating(self) -> LoaderIteration | None:
        """The pass of a prepared loader being iterated now (Accelerate's active dataloader):
        the pass that yielded last while it has not ended, else the latest begun pass that
        has not ended (an outer loop around an inner one that ended); None between passes,
        so nothing prepared is being iterated (a loader never prepared, say).

        A pass ends when its loop asks for the batch after the last one; during the last
        batch's own iteration it is still being iterated.
        """
        last = self.last_pass() if self.last_pass is not None else None
        if last is not None and not last.done:
            return last
        self._forget_ended()
        return self.begun[-1]() if self.begun else None

    def began(self, it: LoaderIteration) -> None:
        """A pass begins."""
        self._forget_ended()
        self.begun.append(weakref.ref(it))

    def _forget_ended(self) -> None:
        self.begun = [ref for ref in self.begun if (it := ref()) is not None and not it.done]


class Pieces:
    """A loader's batches as micro-batches ``split`` times smaller (``split`` a power of 2,
    each batch halved that many times over; see ``batches.pieces``)."""

    def __init__(self, source: Iterator[Any], split: int) -> None:
        self.source = source
        self.split = split
        self.pending: collections.deque[Any] = collections.deque()

    def __iter__(self) -> Pieces:
        return self

    def __next__(self) -> Any:
        while not self.pending:
            self.pending.extend(pieces(next(self.source), self.split))
        return self.pending.popleft()

    def split_further(self) -> None:
        """From now on every micro-batch is half as large (those already cut are halved)."""
        self.pending = collections.deque(h for piece in self.pending for h in halves(piece))
        self.split *= 2


class LoaderIteration:
    """One pass over a prepared loader: reads one batch ahead (a window ahead on request),
    knows where the pass stands, and re-raises a loading error at the batch that caused it."""

    def __init__(
        self,
        owner: PreparedDataLoader,
        source: Iterator[Any],
        total: int | None,
        rng_at_start: RngState | None = None,
    ) -> None:
        self.owner = owner
        self.rng_at_start = rng_at_start  # the RNG the iterator was created under
        self.epoch = owner.epochs.current
        self.source = source
        self.total = total
        self.buffer: collections.deque[Any] = collections.deque()
        self.exhausted = False
        self.error: BaseException | None = None
        self.done = False
        self.yielded = 0
        self.remaining: int | None = None  # batches left, the last yielded one included
        self.last = False
        self._context = owner._context
        self._window = owner._context.window
        self._ticket = self._window.track(self)
        self._weak = weakref.ref(self)
        self._context.began(self)
        self._last_batch: Any = None  # the last yielded batch as loaded (kept to count its items)
        self._move = owner._context.device.type != "cpu"
        #: The micro-batches yielded in the window in progress, kept (as loaded) when a
        #: window may be re-run in smaller micro-batches (``on_oom="split"``).
        self._window_batches: list[Any] | None = [] if owner.replannable else None

    def __iter__(self) -> LoaderIteration:
        return self

    def _fill(self, n: int) -> None:
        while not self.exhausted and self.error is None and len(self.buffer) < n:
            try:
                self.buffer.append(next(self.source))
            except StopIteration:
                self.exhausted = True
            except Exception as err:  # raised when its batch's turn comes, not earlier
                self.error = err

    def peek(self, n: int) -> int | None:
        """Batches left from the last yielded one on, if the data ends within ``n``; else None."""
        self._fill(n)
        left = len(self.buffer) + 1
        return left if self.error is None and self.exhausted and left <= n else None

    def lengths_ahead(self, n: int) -> tuple[list[int], bool]:
        """First-dimension lengths of up to ``n`` batches after the last yielded one, and
        whether the pass ends after them (read ahead)."""
        self._fill(n)
        ahead = list(self.buffer)[:n]
        ends = self.error is None and self.exhausted and len(self.buffer) <= n
        return [batch_length(b) for b in ahead], ends

    def count_items(self, n: int, count: ItemCounter) -> int:
        """Items in the last yielded batch and the ``n - 1`` batches after it (read ahead)."""
        self._fill(n - 1)
        batches = [self._last_batch, *list(self.buffer)[: n - 1]]
        first = self.yielded - 1
        return sum(
            checked_count(count(b), f"batch {first + i} of epoch {self.epoch}")
            for i, b in enumerate(batches)
        )

    @property
    def read(self) -> int:
        """Batches taken from the source so far (yielded, plus those read ahead)."""
        return self.yielded + len(self.buffer)

    @property
    def finished(self) -> bool:
        """Every batch of the pass was yielded (the pass may not have noticed yet)."""
        return self.done or (self.exhausted and self.error is None and not self.buffer)

    def split_further(self) -> int:
        """Re-run the open window in micro-batches half as large: the batches it consumed
        come again, each as two halves, and every later batch is halved too (the same
        samples in the same order). Returns the micro-batches the window had consumed."""
        kept = self._window_batches
        assert kept is not None and isinstance(self.source, Pieces), "not replannable"
        again = [half for batch in kept for half in halves(batch)]
        ahead = [half for batch in self.buffer for half in halves(batch)]
        self.source.split_further()
        self.buffer = collections.deque(again + ahead)
        self.yielded = 2 * (self.yielded - len(kept))
        consumed = len(kept)
        kept.clear()
        self.total = None  # a count in smaller micro-batches: read ahead instead
        self.remaining, self.last = None, False
        self.owner.split = self.source.split
        return consumed

    def skip(self, consumed: int, read: int) -> None:
        """Resume mid-pass: read ``read`` batches, of which the first ``consumed`` were
        consumed before (dropped), the others were read ahead (kept), as when saved."""
        self._fill(max(read, consumed))
        kept = self._window_batches
        # A window left open by the save re-runs from its first sample if it is re-planned.
        keep_from = consumed - (self._window.index if kept is not None else 0)
        for n in range(min(consumed, len(self.buffer))):
            batch = self.buffer.popleft()
            if kept is not None and n >= keep_from:
                kept.append(batch)
        self.yielded = consumed

    def __next__(self) -> Any:
        if len(self.buffer) < 2 and not self.exhausted:
            self._fill(2)  # the batch to hand out and one more, to see the end coming
        if not self.buffer:
            self.done = True
            if self.error is not None:
                error, self.error = self.error, None
                raise error
            raise StopIteration
        batch = self.buffer.popleft()
        left = len(self.buffer) + 1
        if self.error is None and self.exhausted:
            self.remaining = left
        elif self.total is not None and self.total - self.yielded >= left:
            self.remaining = self.total - self.yielded  # len() agrees with what was read
        else:
            self.remaining = None
        self.last = self.error is None and self.exhausted and not self.buffer
        self.yielded += 1
        kept = self._window_batches
        if kept is not None:
            if not self._window.is_open:  # this batch starts a window
                kept.clear()
            kept.append(batch)
        self._window.fed(self._ticket)
        self._context.last_pass = self._weak
        if self._context.count_items is not None:
            self._last_batch = batch
        # Training on the CPU, a loader's tensors are where they must be: no tree walk.
        return to_device(batch, self._context.device) if self._move else batch


class PreparedDataLoader:
    """Iterates the (sharded) loader and tells the window where the epoch stands.

    Each pass reads one batch ahead, so it knows the epoch's last batch even when ``len()``
    is wrong or absent; with a sized loader it knows how many batches remain, and an unsized
    one can be asked to read up to one window ahead when a window starts. The window
    follows the pass that fed the micro-step (see ``Window.begin``).
    """

    def __init__(self, loader: Any, context: LoaderContext) -> None:
        self.loader = loader
        self._context = context
        self.epochs = Epochs()
        self._current: LoaderIteration | None = None
        self._resume: dict[str, Any] | None = None  # the pass to resume (from load_state)
        #: Each loader batch is cut into ``split`` micro-batches (``on_oom="split"`` halved
        #: them ``log2(split)`` times); ``replannable``: passes keep their window's batches.
        self.split = 1
        self.replannable = False
        self._restored: int | None = None  # batches of its pass load_state skipped, until it starts
        #: Accelerate's rule book: the saved (consumed, read) held back until skip_first_batches.
        self._rewound: tuple[int, int] | None = None

    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress or, between passes, of the next pass; so
        ``for epoch in range(loader.epoch, EPOCHS): for batch in loader:`` resumes."""
        it = self._current
        if it is not None and not it.done:
            return self.epochs.current
        return self.epochs.next

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next pass (it reshuffles the shards); counted up by itself."""
        self.epochs.next = epoch
        self.epochs.given = True

    def state_dict(self) -> dict[str, Any]:
        """The epoch in progress (or the next one between passes) and the batches it yielded."""
        it = self._current
        if it is not None and not it.done:
            return {"epoch": self.epochs.current, "batches_yielded": it.yielded}
        return {"epoch": self.epochs.next, "batches_yielded": 0}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the epoch's order (skip ``batches_yielded`` batches yourself to go on mid-epoch)."""
        self.set_epoch(int(state_dict["epoch"]))

    def position(self, unconsumed: int = 0) -> dict[str, Any]:
        """Where the loader stands, for a checkpoint: the epoch of the first batch not yet
        consumed, the batches of that pass consumed and read, and the RNG the pass's
        iterator was created under (None when the next pass starts afresh). ``unconsumed``:
        that many of the batches the pass yielded are not trained on yet."""
        it = self._current
        if it is None or (it.finished and not unconsumed):
            # Between passes only a generator that carries over to the next pass is kept.
            return {
                "epoch": self.epochs.next,
                "consumed": 0,
                "read": 0,
                "rng": dealing_rng(self.loader),
                "split": self.split,
            }
        return {
            "epoch": self.epochs.current,
            "consumed": it.yielded - unconsumed,
            "read": it.read,
            "rng": it.rng_at_start,
            "split": self.split,
        }

    @property
    def pass_in_progress(self) -> LoaderIteration | None:
        return self._current

    def resume(self, position: dict[str, Any], rng_now: Callable[[], None]) -> None:
        """The next pass resumes ``position``: its iterator is created under the saved RNG,
        the consumed batches are skipped, and then ``rng_now()`` puts back the RNG of the
        moment of the save (creating an iterator draws from it)."""
        self.set_epoch(int(position["epoch"]))
        self._current = None
        self.split = int(position.get("split", 1))  # counts are in micro-batches of this split
        rng = position.get("rng")
        started = position["consumed"] or rng is not None
        # The RNG of the moment of the save is put back only for a pass begun before it.
        now = rng_now if rng is not None and "torch" in rng else (lambda: None)
        self._resume = dict(position, rng_now=now) if started else None
        self._restored = int(position["consumed"])

    def rewind_to_pass_start(self) -> None:
        """After ``resume`` (Accelerate's rule book): the pass starts at its first batch, in
        the saved order, unless ``skip_first_batches`` asks for the saved position. A
        script that skips the consumed batches in its own loop (``continue``) or not at all
        reads the pass as under Accelerate."""
        if self._resume is not None:
            self._rewound = (int(self._resume["consumed"]), int(self._resume["read"]))
            self._resume.update(consumed=0, read=0)

    def skip_next(self, batches: int) -> None:
        """The next pass starts after its first ``batches`` batches. After ``load_state``,
        which already put the pass where the checkpoint was saved, nothing more is skipped:
        the restored count is a no-op (a debug line), and another count is said in one
        warning line and left out (the checkpoint knows where the run stood)."""
        restored, self._restored = self._restored, None
        rewound, self._rewound = self._rewound, None
        if rewound is not None and self._resume is not None:  # the saved position, after all
            self._resume.update(consumed=rewound[0], read=rewound[1])
        if restored is not None:
            if batches == restored:
                log.debug(
                    "gradsync: skip_first_batches(%d) after load_state: the loader already "
                    "resumes at batch %d of epoch %d; nothing more skipped",
                    batches,
                    restored,
                    self.epochs.next,
                )
            elif dist.rank() == 0:  # one line for the run, not one per rank
                log.warning(
                    "gradsync: skip_first_batches(%d) after load_state: the checkpoint was saved "
                    "after batch %d of epoch %d, and the loader resumes there (skipping %d would "
                    "%s); nothing more skipped",
                    batches,
                    restored,
                    self.epochs.next,
                    batches,
                    "leave out batches never trained on"
                    if batches > restored
                    else "train again on batches already trained on",
                )
            return
        if not batches:
            return
        resume = self._resume or {"consumed": 0, "read": 0, "rng": None, "rng_now": lambda: None}
        resume["consumed"] = int(resume["consumed"]) + batches
        resume["read"] = max(int(resume["read"]), int(resume["consumed"]))
        self._resume = resume

    @property
    def sampler(self) -> Any:
        return getattr(self.loader, "sampler", None)

    def sample_layout(self, world_size: int) -> tuple[int, int] | None:
        """(batch size, dataset size) when the ranks' batches come from one
        ``DistributedSampler`` order dealt out sample by sample over ``world_size`` ranks
        (padded at the end to even them out); None for any other layout."""
        sampler = self.sampler
        batch_size = getattr(self.loader, "batch_size", None)
        if not isinstance(sampler, DistributedSampler) or batch_size is None:
            return None
        if sampler.num_replicas != world_size:
            return None
        return int(batch_size), len(sampler.dataset)  # type: ignore[arg-type]

    def dealt_remainder(self) -> int | None:
        """With whole batches dealt and the last round padded (Accelerate's rule): the real
        samples in a pass's last global batch, when it is short; None otherwise."""
        deal = getattr(self.loader, "batch_sampler", None)
        dataset = getattr(self.loader, "dataset", None)
        if isinstance(deal, BatchDeal) and deal.even and not deal.drop_last and deal.batch_size:
            per_round = deal.batch_size * (1 if deal.split else deal.world_size)
            source: Any = dataset
        elif isinstance(dataset, IterableDeal) and not dataset.drop_last:
            per_round, source = dataset.per_round, dataset.dataset
        else:
            return None
        try:
            return len(source) % per_round or None
        except TypeError:
            return None

    def __len__(self) -> int:
        """Micro-batches per pass: the loader's batches, each cut into ``split`` after
        ``on_oom="split"`` halved them (so ``len(loader) / k`` stays the optimizer steps)."""
        return len(self.loader) * self.split

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)  # dataset, batch_size, num_workers, ...

    def __iter__(self) -> LoaderIteration:
        epoch = self.epochs.start_pass(self.sampler)
        batches = getattr(self.loader, "batch_sampler", None)
        if isinstance(batches, BatchShard | BatchDeal):
            batches.set_epoch(epoch)
        self._context.on_epoch_start(self)
        resume, self._resume = self._resume, None
        self._restored = self._rewound = None
        if resume is not None and resume["rng"] is not None:
            set_rng(resume["rng"], self.loader)
        rng = get_rng(self.loader)
        source: Iterator[Any] = iter(self.loader)
        if self.replannable or self.split > 1:
            source = Pieces(source, self.split)
        total = self._sized_len() if self.split == 1 else None  # read ahead instead
        it = LoaderIteration(self, source, total, rng)
        if resume is not None:
            it.skip(int(resume["consumed"]), int(resume["read"]))
            resume["rng_now"]()
        self._current = it
        return it

    def _sized_len(self) -> int | None:
        try:
            return len(self.loader)
        except TypeError:
            return None


def skip_first_batches(dataloader: Any, num_batches: int) -> PreparedDataLoader:
    """``accel.skip_first_batches``: the prepared ``dataloader``, its next pass starting
    after ``num_batches`` batches (nothing more after ``load_state``: see ``skip_next``)."""
    if not isinstance(dataloader, PreparedDataLoader):
        raise ConfigError(
            f"skip_first_batches() got a {type(dataloader).__name__}; pass the loader "
            "returned by accel.prepare(loader), which knows where its epoch stands"
        )
    dataloader.skip_next(check_non_negative_int("num_batches", num_batches))
    return dataloader


def split_for_window(window: Window, batch: Any, micro_batch_size: int) -> list[Any]:
    """``accel.split_batch``: ``batch`` cut into micro-batches of ``micro_batch_size`` rows,
    each of which the window counts as a micro-step."""
    size = check_positive_int("micro_batch_size", micro_batch_size)
    pieces = split_batch(batch, size)
    window.split(len(pieces), size)
    return pieces
