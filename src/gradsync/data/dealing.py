"""Dealing whole batches to the ranks, as Accelerate does (its rule book: ``gradsync.rules``).

Every rank runs the loader's batch sequence identically (one generator, equal on every
rank) and takes its share of it:

* batches dealt (``split_batches=False``): batches come in rounds of N; rank r takes batch r
  of each round. A last round that is incomplete, or whose last batch is short, is padded
  with the samples of the pass's first batches, so every rank gets the same number of
  full batches (``even_batches``); without ``even_batches`` each rank takes what is left.
* batches split (``split_batches=True``): each batch is the global batch; rank r takes its
  r-th slice of ``batch_size / N`` samples; a short last batch is padded the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler

from gradsync.errors import ConfigError


def split_size(batch_size: int | None, world_size: int) -> int | None:
    """Each rank's slice of a global batch of ``batch_size`` (Accelerate's error when the
    ranks do not divide it)."""
    if batch_size is None or world_size == 1:
        return batch_size
    if batch_size > 1 and batch_size % world_size:
        raise ConfigError(
            f"To use a `DataLoader` in `split_batches` mode, the batch size ({batch_size}) needs "
            f"to be a round multiple of the number of processes ({world_size})."
        )
    return max(batch_size // world_size, 1)


class BatchDeal(Sampler[list[int]]):
    """This rank's batches (or slices of them) of a batch sequence every rank runs alike."""

    def __init__(
        self, batches: Any, *, rank: int, world_size: int, split: bool, even: bool
    ) -> None:
        self.batches = batches
        self.rank = rank
        self.world_size = world_size
        self.split = split
        self.even = even
        self.batch_size: int | None = getattr(batches, "batch_size", None)
        self.drop_last: bool = bool(getattr(batches, "drop_last", False))
        if split:
            split_size(self.batch_size, world_size)
            if self.batch_size is None:
                raise ConfigError(
                    "split_batches=True needs a batch sampler with a batch_size; give the "
                    "DataLoader a batch_size, or use split_batches=False"
                )

    @property
    def generator(self) -> torch.Generator | None:
        """The generator of the sampler inside (a checkpoint saves it)."""
        generator = getattr(getattr(self.batches, "sampler", None), "generator", None)
        return generator if isinstance(generator, torch.Generator) else None

    def set_epoch(self, epoch: int) -> None:
        """Passed on to the batch sampler and to the sampler inside it."""
        for inner in (self.batches, getattr(self.batches, "sampler", None)):
            setter = getattr(inner, "set_epoch", None)
            if callable(setter):
                setter(epoch)

    def __len__(self) -> int:
        total = len(self.batches)
        if self.split:
            return total
        rounds, rest = divmod(total, self.world_size)
        if rest == 0 or self.drop_last:
            return rounds
        if self.even:
            return rounds + 1
        return rounds + (1 if self.rank < rest else 0)

    def __iter__(self) -> Iterator[list[int]]:
        return self._split() if self.split else self._dealt()

    def _full(self, batch: list[int]) -> bool:
        return self.batch_size is None or len(batch) == self.batch_size

    def _dealt(self) -> Iterator[list[int]]:
        world, rank = self.world_size, self.rank
        first: list[Any] = []  # the samples (or whole batches) of the first round, for padding
        mine: list[int] | None = None
        batch: list[int] = []
        index = -1
        for index, batch in enumerate(self.batches):
            if not self.drop_last and index < world:
                first.extend([batch] if self.batch_size is None else batch)
            if index % world == rank:
                mine = batch
            if index % world == world - 1 and self._full(batch):
                assert mine is not None
                yield mine
                mine = None
        if self.drop_last or not first:
            return
        if not self.even:
            if mine:
                yield mine
            return
        if mine and self._full(mine):
            yield mine
        need = world if self.batch_size is None else world * self.batch_size
        while len(first) < need:
            first = first + first
        position = index
        if self._full(batch):
            batch, position = [], index + 1  # the last batch was full: its rank yielded it
        cursor = 0
        while position % world or batch:
            if self.batch_size is None:
                batch = first[cursor]
                cursor += 1
            else:
                end = cursor + self.batch_size - len(batch)
                batch = batch + first[cursor:end]
                cursor = end
            if position % world == rank:
                yield batch
            batch, position = [], position + 1

    def _split(self) -> Iterator[list[int]]:
        assert self.batch_size is not None
        size = split_size(self.batch_size, self.world_size) or 1
        start, stop = size * self.rank, size * (self.rank + 1)
        first: list[int] = []
        batch: list[int] = []
        for index, batch in enumerate(self.batches):
            if index == 0:
                first = list(batch)
            if len(batch) == self.batch_size:
                yield batch[start:stop]
        if self.drop_last or not first or len(batch) >= self.batch_size:
            return
        if not self.even:
            if len(batch) > start:
                yield batch[start:stop]
            return
        while len(first) < self.batch_size:
            first = first + first
        yield (list(batch) + first)[start:stop]


def seed_like_rank0(sampler: Any) -> None:
    """Give a sampler without a generator one, seeded from the global RNG (one draw, on every
    rank), then make every rank's generator rank 0's (one broadcast), so every rank runs
    the same batch sequence."""
    import torch.distributed as dist

    if not hasattr(sampler, "generator"):
        return
    if sampler.generator is None:
        generator = torch.Generator()
        generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        sampler.generator = generator
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        state = sampler.generator.get_state()
        dist.broadcast(state, src=0)
        sampler.generator.set_state(state)


class IterableDeal(IterableDataset[Any]):
    """This rank's samples of an IterableDataset every rank reads in full: samples come in
    rounds of ``per_round``; rank r takes the r-th ``per_rank`` of each round. A last short
    round is completed with the pass's first samples (unless ``drop_last``)."""

    def __init__(
        self,
        dataset: IterableDataset[Any],
        *,
        rank: int,
        per_rank: int,
        per_round: int,
        drop_last: bool,
    ) -> None:
        self.dataset = dataset
        self.rank = rank
        self.per_rank = per_rank
        self.per_round = per_round
        self.drop_last = drop_last

    def set_epoch(self, epoch: int) -> None:
        setter = getattr(self.dataset, "set_epoch", None)
        if callable(setter):
            setter(epoch)

    def __iter__(self) -> Iterator[Any]:
        mine = slice(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        first: list[Any] | None = None
        round_: list[Any] = []
        for sample in self.dataset:
            round_.append(sample)
            if len(round_) == self.per_round:
                yield from round_[mine]
                first = round_ if first is None else first
                round_ = []
        if self.drop_last or not round_:
            return
        padding = first if first is not None else list(round_)
        while len(round_) < self.per_round:
            round_ = round_ + padding
        yield from round_[mine]


class EpochSeededSampler(RandomSampler):
    """A random sampler whose order depends only on a seed and the epoch (``seed + epoch``),
    so every rank draws the same order without a broadcast."""

    def __init__(self, sampler: RandomSampler, seed: int) -> None:
        super().__init__(
            sampler.data_source,
            replacement=sampler.replacement,
            num_samples=sampler._num_samples,
            generator=torch.Generator(),
        )
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        assert self.generator is not None
        self.generator.manual_seed(self.seed + self.epoch)
        yield from super().__iter__()
        self.epoch += 1


def deal_batches(
    loader: DataLoader[Any],
    *,
    rank: int,
    world_size: int,
    split: bool,
    even: bool,
    seedable: bool = False,
    data_seed: int | None = None,
) -> DataLoader[Any]:
    """``loader`` with this rank's batches dealt as Accelerate deals them (see the module)."""
    from gradsync.data.sharding import rebuild

    if world_size == 1:
        return loader
    if isinstance(loader.dataset, IterableDataset):
        size = loader.batch_size or 1
        per_rank = (split_size(size, world_size) or 1) if split else size
        shard = IterableDeal(
            loader.dataset,
            rank=rank,
            per_rank=per_rank,
            per_round=size if split else size * world_size,
            drop_last=loader.drop_last,
        )
        return rebuild(loader, shard, batch_size=per_rank, drop_last=loader.drop_last)
    batches: Any = loader.batch_sampler
    if batches is None:
        raise ConfigError(
            f"the dataloader has batch_size=None and a {type(loader.sampler).__name__} (no "
            "automatic batching), which cannot be dealt over ranks; give it a batch_size"
        )
    inner = getattr(batches, "sampler", None)
    if seedable and type(inner) is RandomSampler:
        seed = data_seed if data_seed is not None else torch.random.initial_seed()
        batches = BatchSampler(
            EpochSeededSampler(inner, seed), batches.batch_size, batches.drop_last
        )
    else:
        seed_like_rank0(inner if inner is not None else loader.sampler)
    deal = BatchDeal(batches, rank=rank, world_size=world_size, split=split, even=even)
    return rebuild(loader, loader.dataset, batch_sampler=deal)
