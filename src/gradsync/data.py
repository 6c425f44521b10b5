"""Prepared dataloaders: sharding over ranks, one-batch read-ahead, passes, device moves.

Each pass over a prepared loader tells the accumulation window where the epoch stands
(how many batches remain, whether this batch is the last), so the window can close at the
end of the data and size the partial last window.
"""

from __future__ import annotations

import collections
import logging
import numbers
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import (
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    get_worker_info,
)
from torch.utils.data.distributed import DistributedSampler

from gradsync._torch_compat import sampler_num_samples
from gradsync.errors import ConfigError

if TYPE_CHECKING:
    from gradsync.accumulation import Window

log = logging.getLogger("gradsync")


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        moved = {k: _to_device(v, device) for k, v in batch.items()}
        try:
            return type(batch)(moved)  # type: ignore[call-arg]
        except TypeError:
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_to_device(v, device) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(_to_device(v, device) for v in batch)
    if hasattr(batch, "to") and callable(batch.to):
        return batch.to(device)
    return batch


def shard_dataloader(
    loader: DataLoader[Any], *, rank: int, world_size: int, seed: int,
    dataset_shards_itself: bool = False,
) -> DataLoader[Any]:
    """A DataLoader over this rank's shard, with the same number of batches on every rank.

    * The default samplers (sequential, random): a DistributedSampler, seeded and reshuffled
      per epoch (samples dealt one by one; the last ones padded by repeats).
    * A DistributedSampler the user built: kept as it is.
    * Any other sampler or batch sampler: sharded at the batch level (``BatchShard``): every
      rank runs the same seeded batch sequence and takes every ``world_size``-th batch.
    * An IterableDataset: dealt sample by sample over the ranks (``IterableShard``), unless
      ``dataset_shards_itself``.
    """
    if world_size == 1:
        return loader
    if isinstance(loader.dataset, IterableDataset):
        if dataset_shards_itself:
            return loader
        shard = IterableShard(loader.dataset, rank=rank, world_size=world_size,
                              batch_size=loader.batch_size or 1, drop_last=loader.drop_last)
        return _rebuild(loader, shard, batch_size=loader.batch_size, drop_last=loader.drop_last)
    if isinstance(loader.sampler, DistributedSampler):
        return loader
    plain_random = (
        type(loader.sampler) is RandomSampler
        and not loader.sampler.replacement
        and sampler_num_samples(loader.sampler) is None
    )
    if loader.batch_size is not None and (plain_random or type(loader.sampler) is SequentialSampler):
        sampler: DistributedSampler[Any] = DistributedSampler(
            loader.dataset, num_replicas=world_size, rank=rank,
            shuffle=plain_random, seed=seed, drop_last=loader.drop_last,
        )
        return _rebuild(loader, loader.dataset, batch_size=loader.batch_size, sampler=sampler,
                        drop_last=loader.drop_last)
    if loader.batch_sampler is None:  # batch_size=None with a sampler: each index is a batch
        raise ConfigError(
            f"the dataloader has batch_size=None and a {type(loader.sampler).__name__} (no "
            "automatic batching), which gradsync cannot shard over ranks; give it a batch_size "
            "or a batch_sampler, or shard it yourself (e.g. a DistributedSampler)"
        )
    shard_sampler = BatchShard(loader.batch_sampler, rank=rank, world_size=world_size, seed=seed)
    return _rebuild(loader, loader.dataset, batch_sampler=shard_sampler)


def _rebuild(loader: DataLoader[Any], dataset: Any, **batching: Any) -> DataLoader[Any]:
    """``loader`` over ``dataset`` with other batching, everything else kept."""
    kwargs: dict[str, Any] = {
        **batching,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(dataset, **kwargs)


def _generator_owners(obj: Any, depth: int = 3) -> list[Any]:
    """``obj`` and the samplers it wraps (``.sampler``, ``.batch_sampler``) that have a
    ``generator`` attribute set to None: gradsync seeds those."""
    found: list[Any] = []
    seen: set[int] = set()
    todo = [(obj, 0)]
    while todo:
        cur, level = todo.pop()
        if cur is None or id(cur) in seen or level > depth:
            continue
        seen.add(id(cur))
        if hasattr(cur, "generator") and cur.generator is None:
            found.append(cur)
        todo.extend((getattr(cur, attr, None), level + 1) for attr in ("sampler", "batch_sampler"))
    return found


class BatchShard(Sampler[list[int]]):
    """This rank's batches of a batch sequence that every rank runs identically: batches
    ``rank, rank + world_size, ...``; a last round of fewer than ``world_size`` batches is
    dropped (logged once), so every rank gets the same number of batches.

    Samplers in it whose ``generator`` is None get a ``torch.Generator`` seeded from
    ``seed`` and the epoch, so every rank draws the same sequence; ``set_epoch`` is passed on
    to a batch sampler that has one.
    """

    def __init__(self, batches: Any, *, rank: int, world_size: int, seed: int) -> None:
        self.batches = batches
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = 0
        self._seeded = _generator_owners(batches)
        self._warned = False

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if callable(getattr(self.batches, "set_epoch", None)):
            self.batches.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batches) // self.world_size

    def __iter__(self) -> Iterator[list[int]]:
        for i, owner in enumerate(self._seeded):
            owner.generator = torch.Generator().manual_seed(self.seed + 1_000_003 * self.epoch + i)
        round_: list[list[int]] = []
        for batch in self.batches:
            round_.append(batch)
            if len(round_) == self.world_size:
                yield round_[self.rank]
                round_ = []
        if round_ and not self._warned:
            self._warned = True
            log.warning(
                "gradsync: the batch sampler's last %d batch(es) of the epoch are left out: every "
                "rank takes every %d-th batch, and a last round of fewer than %d batches would "
                "give the ranks unequal batch counts (logged once)",
                len(round_), self.world_size, self.world_size,
            )


class IterableShard(IterableDataset[Any]):
    """This rank's part of an IterableDataset that every rank (and every DataLoader worker)
    reads in full: samples come in rounds of ``world_size x batch_size``; rank ``r`` takes
    positions ``r, r + world_size, ...`` of each round (``batch_size`` samples, one batch),
    and with DataLoader workers, worker ``w`` of ``W`` handles rounds ``w, w + W, ...``. A last
    round shorter than a full one is dealt the same way when it holds at least one sample per
    rank (one smaller batch on every rank), and dropped otherwise (with a warning), or always
    with ``drop_last``. So every rank gets the same number of batches and, where the tail
    allows it, every sample is seen exactly once per pass.
    """

    def __init__(self, dataset: IterableDataset[Any], *, rank: int, world_size: int,
                 batch_size: int, drop_last: bool) -> None:
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        """This rank's samples per pass (a TypeError when the dataset has no length)."""
        total = len(self.dataset)  # type: ignore[arg-type]
        per_round = self.world_size * self.batch_size
        rounds, tail = divmod(total, per_round)
        mine = 0 if self.drop_last or tail < self.world_size else len(range(self.rank, tail, self.world_size))
        return rounds * self.batch_size + mine

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        per_round = self.world_size * self.batch_size
        mine: list[Any] = []  # this rank's samples of the round in progress
        position, number = 0, 0  # position in the round, the round's number
        for sample in self.dataset:
            if number % workers == worker and position % self.world_size == self.rank:
                mine.append(sample)
            position += 1
            if position == per_round:
                yield from mine
                mine, position, number = [], 0, number + 1
        if position == 0 or number % workers != worker or self.drop_last:
            return
        if position >= self.world_size:
            yield from mine
        elif self.rank == 0:
            log.warning(
                "gradsync: the IterableDataset's last %d sample(s) of this pass are left out: "
                "fewer than one per rank (%d ranks), and a rank without them would wait for "
                "the others' extra batch", position, self.world_size,
            )


ItemCounter = Callable[[Any], Any]
#: The torch RNG states a DataLoader iterator draws from when it is created.
RngState = dict[str, torch.Tensor]


def get_rng(loader: Any) -> RngState:
    """The global torch CPU RNG and the loader's own generator, if it has one."""
    state = {"torch": torch.get_rng_state()}
    generator = getattr(loader, "generator", None)
    if isinstance(generator, torch.Generator):
        state["generator"] = generator.get_state()
    return state


def set_rng(state: RngState, loader: Any) -> None:
    torch.set_rng_state(state["torch"])
    generator = getattr(loader, "generator", None)
    if isinstance(generator, torch.Generator) and "generator" in state:
        generator.set_state(state["generator"])


@dataclass
class LoaderContext:
    """What the Accelerator that prepared a loader gives it (one per Accelerator)."""

    window: Window
    device: torch.device
    on_epoch_start: Callable[[PreparedDataLoader], None]
    count_items: ItemCounter | None = None
    #: The pass that yielded most recently, of any loader of this Accelerator (a weak reference).
    last_pass: weakref.ref[LoaderIteration] | None = None


def batch_length(batch: Any) -> int:
    """Rows in a batch: the first dimension of its first tensor (nested structures allowed)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        for value in batch.values():
            return batch_length(value)
    if isinstance(batch, list | tuple) and batch:
        return batch_length(batch[0])
    raise ConfigError(
        f"cannot tell how many rows a {type(batch).__name__} batch holds; batches must hold "
        "tensors (or dicts / lists / tuples of them) whose first dimension is the batch"
    )


def split_batch(batch: Any, size: int) -> list[Any]:
    """``batch`` cut along the first dimension into pieces of ``size`` rows (the last may be
    smaller); every tensor of a nested structure is cut alike, other values are repeated."""
    rows = batch_length(batch)
    starts = range(0, rows, size)

    def cut(value: Any, start: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
            return value[start : start + size]
        if isinstance(value, Mapping):
            return type(value)({k: cut(v, start) for k, v in value.items()})  # type: ignore[call-arg]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(cut(v, start) for v in value))
        if isinstance(value, list | tuple):
            plain = len(value) == rows and all(isinstance(v, int | float | str) for v in value)
            if plain:  # one value per row (ids, texts): cut like a tensor
                return type(value)(value[start : start + size])
            return type(value)(cut(v, start) for v in value)
        return value

    return [cut(batch, start) for start in starts]


def checked_count(value: Any, where: str) -> int:
    """An item count as a plain int >= 0, or a ConfigError naming the value and the batch."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.is_complex():
            raise ConfigError(
                f"count_items returned {value!r} for {where}; it must return one whole number "
                "(an int or a one-element integer tensor), the items (e.g. tokens) in the batch"
            )
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(
            f"count_items returned {value!r} ({type(value).__name__}) for {where}; it must "
            "return a whole number >= 0, the items (e.g. tokens) in the batch"
        )
    if value < 0:
        raise ConfigError(f"count_items returned {value} for {where}; a count must be >= 0")
    return int(value)


class LoaderIteration:
    """One pass over a prepared loader: reads one batch ahead (a window ahead on request),
    knows where the pass stands, and re-raises a loading error at the batch that caused it."""

    def __init__(self, owner: PreparedDataLoader, source: Iterator[Any], total: int | None,
                 rng_at_start: RngState | None = None) -> None:
        self.owner = owner
        self.rng_at_start = rng_at_start  # the RNG the iterator was created under
        self.epoch = owner._current_epoch
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
        self._last_batch: Any = None  # the last yielded batch as loaded (kept to count its items)

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

    def skip(self, consumed: int, read: int) -> None:
        """Resume mid-pass: read ``read`` batches, of which the first ``consumed`` were
        consumed before (dropped), the others were read ahead (kept), as when saved."""
        self._fill(max(read, consumed))
        for _ in range(min(consumed, len(self.buffer))):
            self.buffer.popleft()
        self.yielded = consumed

    def __next__(self) -> Any:
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
        self._window.fed(self._ticket)
        self._context.last_pass = self._weak
        if self._context.count_items is not None:
            self._last_batch = batch
        return _to_device(batch, self._context.device)


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
        self._epoch = 0
        self._epoch_set = False
        self._sampler_epoch = 0
        self._user_epochs = False
        self._current: LoaderIteration | None = None
        self._current_epoch = 0
        self._resume: dict[str, Any] | None = None  # the pass to resume (from load_state)

    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress or, between passes, of the next pass; so
        ``for epoch in range(loader.epoch, EPOCHS): for batch in loader:`` resumes."""
        it = self._current
        if it is not None and not it.done:
            return self._current_epoch
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next pass (it reshuffles the shards); counted up by itself."""
        self._epoch = epoch
        self._epoch_set = True

    def state_dict(self) -> dict[str, Any]:
        """The epoch in progress (or the next one between passes) and the batches it yielded."""
        it = self._current
        if it is not None and not it.done:
            return {"epoch": self._current_epoch, "batches_yielded": it.yielded}
        return {"epoch": self._epoch, "batches_yielded": 0}

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
            return {"epoch": self._epoch, "consumed": 0, "read": 0, "rng": None}
        return {"epoch": self._current_epoch, "consumed": it.yielded - unconsumed, "read": it.read,
                "rng": it.rng_at_start}

    @property
    def pass_in_progress(self) -> LoaderIteration | None:
        return self._current

    def resume(self, position: dict[str, Any], rng_now: Callable[[], None]) -> None:
        """The next pass resumes ``position``: its iterator is created under the saved RNG,
        the consumed batches are skipped, and then ``rng_now()`` puts back the RNG of the
        moment of the save (creating an iterator draws from it)."""
        self.set_epoch(int(position["epoch"]))
        self._current = None
        started = position["consumed"] or position.get("rng") is not None
        self._resume = dict(position, rng_now=rng_now) if started else None

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

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)  # dataset, batch_size, num_workers, ...

    def __iter__(self) -> LoaderIteration:
        sampler = self.sampler
        if isinstance(sampler, DistributedSampler):
            if not self._epoch_set and sampler.epoch != self._sampler_epoch:
                self._user_epochs = True  # the user calls sampler.set_epoch(): leave it to them
            if self._epoch_set or not self._user_epochs:
                sampler.set_epoch(self._epoch)
            self._sampler_epoch = sampler.epoch
        batches = getattr(self.loader, "batch_sampler", None)
        if isinstance(batches, BatchShard):
            batches.set_epoch(self._epoch)
        self._current_epoch = self._epoch
        self._epoch += 1
        self._epoch_set = False
        self._context.on_epoch_start(self)
        resume, self._resume = self._resume, None
        if resume is not None and resume["rng"] is not None:
            set_rng(resume["rng"], self.loader)
        rng = get_rng(self.loader)
        it = LoaderIteration(self, iter(self.loader), self._sized_len(), rng)
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
