"""Sharding a DataLoader over the ranks, with the same number of batches on every rank."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

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

from gradsync._support.torch_compat import sampler_num_samples
from gradsync.errors import ConfigError

log = logging.getLogger("gradsync")


def shard_dataloader(
    loader: DataLoader[Any],
    *,
    rank: int,
    world_size: int,
    seed: int,
    dataset_shards_itself: bool = False,
) -> DataLoader[Any]:
    """A DataLoader over this rank's shard, with the same number of batches on every rank.

    * The default samplers (sequential, random): a DistributedSampler, seeded and reshuffled
      per epoch (samples dealt one by one; the last ones padded by repeats). A shuffled
      loader gets it on one process too, so the global order does not depend on the world
      size.
    * A DistributedSampler the user built: kept as it is.
    * Any other sampler or batch sampler: sharded at the batch level (``BatchShard``): every
      rank runs the same seeded batch sequence and takes every ``world_size``-th batch.
    * An IterableDataset: dealt sample by sample over the ranks (``IterableShard``), unless
      ``dataset_shards_itself``.
    """
    plain_random = (
        type(loader.sampler) is RandomSampler
        and not loader.sampler.replacement
        and sampler_num_samples(loader.sampler) is None
    )
    if world_size == 1 and not (plain_random and loader.batch_size is not None):
        return loader  # one process reads the loader's own order (a shuffle: see below)
    if isinstance(loader.dataset, IterableDataset):
        if dataset_shards_itself:
            return loader
        shard = IterableShard(
            loader.dataset,
            rank=rank,
            world_size=world_size,
            batch_size=loader.batch_size or 1,
            drop_last=loader.drop_last,
        )
        return rebuild(loader, shard, batch_size=loader.batch_size, drop_last=loader.drop_last)
    if isinstance(loader.sampler, DistributedSampler):
        return loader
    # A shuffle becomes one seeded order of the whole dataset, dealt over the ranks: the same
    # global order on any number of processes (one included), so a run resumed on another
    # world size goes on from the first sample not yet trained on.
    if loader.batch_size is not None and (
        plain_random or type(loader.sampler) is SequentialSampler
    ):
        sampler: DistributedSampler[Any] = DistributedSampler(
            loader.dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=plain_random,
            seed=seed,
            drop_last=loader.drop_last,
        )
        return rebuild(
            loader,
            loader.dataset,
            batch_size=loader.batch_size,
            sampler=sampler,
            drop_last=loader.drop_last,
        )
    if loader.batch_sampler is None:  # batch_size=None with a sampler: each index is a batch
        raise ConfigError(
            f"the dataloader has batch_size=None and a {type(loader.sampler).__name__} (no "
            "automatic batching), which gradsync cannot shard over ranks; give it a batch_size "
            "or a batch_sampler, or shard it yourself (e.g. a DistributedSampler)"
        )
    shard_sampler = BatchShard(loader.batch_sampler, rank=rank, world_size=world_size, seed=seed)
    return rebuild(loader, loader.dataset, batch_sampler=shard_sampler)


def rebuild(loader: DataLoader[Any], dataset: Any, **batching: Any) -> DataLoader[Any]:
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
                len(round_),
                self.world_size,
                self.world_size,
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

    def __init__(
        self,
        dataset: IterableDataset[Any],
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        drop_last: bool,
    ) -> None:
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
        mine = (
            0
            if self.drop_last or tail < self.world_size
            else len(range(self.rank, tail, self.world_size))
        )
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
                "the others' extra batch",
                position,
                self.world_size,
            )
