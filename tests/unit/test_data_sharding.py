"""How gradsync shards what it cannot hand to a DistributedSampler, checked rank by rank in
one process (the 2-rank runs are in test_pipelines.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from gradsync import ConfigError
from gradsync.data import BatchShard, shard_dataloader


class Numbers(IterableDataset):
    def __init__(self, n: int, sized: bool = True) -> None:
        self.n, self.sized = n, sized

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("unsized")
        return self.n


def _ranks(loader, world=2, **kw):
    return [
        [b.tolist() for b in shard_dataloader(loader, rank=r, world_size=world, seed=0, **kw)]
        for r in range(world)
    ]


@pytest.mark.parametrize(
    "n, world, batch, workers",
    [(45, 2, 4, 0), (45, 2, 4, 2), (51, 3, 4, 0), (64, 3, 4, 2), (8, 2, 4, 0)],
)
def test_iterable_each_sample_once_and_equal_batch_counts(n, world, batch, workers):
    ranks = _ranks(DataLoader(Numbers(n), batch_size=batch, num_workers=workers), world)
    assert len({len(r) for r in ranks}) == 1, "every rank the same number of batches"
    seen = sorted(i for r in ranks for b in r for i in b)
    assert seen == list(range(n))
    lens = [
        len(
            shard_dataloader(
                DataLoader(Numbers(n), batch_size=batch), rank=r, world_size=world, seed=0
            )
        )
        for r in range(world)
    ]
    assert lens == [len(r) for r in ranks], "len() says what a pass yields"


def test_iterable_tail_shorter_than_the_ranks_is_dropped_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        ranks = _ranks(DataLoader(Numbers(41), batch_size=4))
    assert [len(r) for r in ranks] == [5, 5]
    assert sorted(i for r in ranks for b in r for i in b) == list(range(40))
    assert "last 1 sample(s) of this pass are left out" in caplog.text


def test_iterable_drop_last_drops_the_partial_round():
    ranks = _ranks(DataLoader(Numbers(47, sized=False), batch_size=4, drop_last=True))
    assert [len(r) for r in ranks] == [5, 5]
    assert all(len(b) == 4 for r in ranks for b in r)


def test_iterable_that_shards_itself_is_left_alone():
    loader = DataLoader(Numbers(10), batch_size=2)
    assert (
        shard_dataloader(loader, rank=1, world_size=2, seed=0, dataset_shards_itself=True) is loader
    )


def test_batch_shard_takes_every_nth_batch_and_drops_the_last_round(caplog):
    batches = BatchSampler(SequentialSampler(range(14)), batch_size=2, drop_last=False)  # 7 batches
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        ranks = [list(BatchShard(batches, rank=r, world_size=3, seed=0)) for r in range(3)]
    assert ranks == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]
    assert len(BatchShard(batches, rank=0, world_size=3, seed=0)) == 2
    assert "last 1 batch(es) of the epoch are left out" in caplog.text


def test_batch_shard_seeds_a_sampler_without_generator_per_epoch():
    from torch.utils.data import RandomSampler

    def order(epoch, rank, global_seed):
        torch.manual_seed(global_seed)
        sampler = RandomSampler(range(12))
        shard = BatchShard(BatchSampler(sampler, 2, False), rank=rank, world_size=2, seed=3)
        shard.set_epoch(epoch)
        return list(shard)

    assert order(0, 0, 1) == order(0, 0, 2), "the global RNG does not matter"
    assert order(0, 0, 1) != order(1, 0, 1), "each epoch reshuffles"
    a, b = order(0, 0, 1), order(0, 1, 5)
    assert sorted(i for batch in a + b for i in batch) == list(range(12))


def test_batch_size_none_without_a_batch_sampler_is_refused():
    from torch.utils.data import WeightedRandomSampler

    loader = DataLoader(
        list(range(8)), batch_size=None, sampler=WeightedRandomSampler([1.0] * 8, 8)
    )
    with pytest.raises(ConfigError, match="batch_size=None and a WeightedRandomSampler"):
        shard_dataloader(loader, rank=0, world_size=2, seed=0)
