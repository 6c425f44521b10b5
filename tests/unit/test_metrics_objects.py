"""gradsync.metrics in one process: reduce's reductions, scale and the op alias; gather_object;
gather_for_metrics of objects; and the sampler-order arithmetic for lists and tensors,
checked against real DistributedSampler shards of 2 and 3 ranks. The same functions on 2
real ranks: tests/multiprocess/test_processes.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from gradsync import Accelerator, ConfigError, metrics


@pytest.mark.parametrize("reduction", ["sum", "mean", "max", "min", "none"])
def test_one_process_reduces_to_its_own_values(reduction):
    t = torch.tensor([1.5, -2.0])
    out = metrics.reduce(t, reduction)
    assert out.tolist() == [1.5, -2.0] and out is not t
    assert metrics.reduce(t, reduction, scale=2.0).tolist() == [3.0, -4.0]
    assert metrics.reduce(t, op=reduction).tolist() == [1.5, -2.0]


def test_integers_keep_their_type_unless_averaged_or_scaled():
    t = torch.tensor([3, 4])
    assert metrics.reduce(t, "sum").dtype == torch.int64
    assert metrics.reduce(t, "max").dtype == torch.int64
    assert metrics.reduce(t, "mean").dtype == torch.float64
    scaled = metrics.reduce(t, "sum", scale=0.5)
    assert scaled.dtype == torch.float64 and scaled.tolist() == [1.5, 2.0]


def test_reduce_walks_nested_structures():
    data = {"a": torch.tensor(2.0), "b": [torch.ones(2), (torch.zeros(1),)]}
    out = metrics.reduce(data, reduction="mean", scale=3.0)
    assert float(out["a"]) == 6.0
    assert out["b"][0].tolist() == [3.0, 3.0] and isinstance(out["b"][1], tuple)
    with pytest.raises(TypeError, match="reduce takes tensors.*not a str"):
        metrics.reduce({"a": "text"})


def test_bad_reductions_name_the_value_and_the_choices():
    choices = "'sum', 'mean', 'max', 'min', 'none'"
    with pytest.raises(
        ConfigError, match=rf"reduce\(reduction='median'\) is unknown; use one of {choices}"
    ):
        metrics.reduce(torch.ones(1), "median")
    with pytest.raises(ConfigError, match=r"reduce\(op='avg'\) is unknown"):
        metrics.reduce(torch.ones(1), op="avg")
    with pytest.raises(ConfigError, match=r"reduce\(reduction='mean', op='max'\) disagree"):
        metrics.reduce(torch.ones(1), "mean", op="max")
    assert metrics.reduce(torch.ones(1), "mean", op="mean").tolist() == [1.0]


def test_gather_object_in_one_process():
    assert metrics.gather_object(["a", 1]) == ["a", 1]
    assert metrics.gather_object(("a", 1)) == ["a", 1]
    assert metrics.gather_object("text") == ["text"]
    assert metrics.gather_object({"k": 1}) == [{"k": 1}]


def test_gather_for_metrics_of_objects_in_one_process(clean_env):
    accel = Accelerator(backend="single")
    loader = accel.prepare(DataLoader([{"id": i, "text": f"s{i}"} for i in range(5)], batch_size=2))
    texts, ids = [], []
    for batch in loader:
        last = accel._loaders.last_pass()
        texts += metrics.gather_for_metrics(batch["text"], last, accel.world_size)
        ids += metrics.gather_for_metrics(batch["id"], last, accel.world_size).tolist()
        forced = metrics.gather_for_metrics(
            batch["id"], last, accel.world_size, use_gather_object=True
        )
        assert isinstance(forced, list) and torch.equal(forced[0], batch["id"])
    assert texts == [f"s{i}" for i in ids] and ids == list(range(5))


def rank_batches(n, world, batch_size, shuffle):
    """Each rank's batches of sample ids, as a DistributedSampler deals them, and the
    sampler's own order of the n samples."""
    loaders = [
        DataLoader(
            list(range(n)),
            batch_size=batch_size,
            sampler=DistributedSampler(
                list(range(n)), num_replicas=world, rank=r, shuffle=shuffle, seed=3
            ),
        )
        for r in range(world)
    ]
    batches = [[b.tolist() for b in loader] for loader in loaders]
    order = (
        torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist()
        if shuffle
        else list(range(n))
    )
    return batches, order


@pytest.mark.parametrize(
    ("n", "world", "batch_size"), [(45, 2, 4), (10, 3, 2), (7, 2, 5), (3, 2, 4), (12, 3, 4)]
)
@pytest.mark.parametrize("shuffle", [False, True])
def test_sample_positions_give_the_sampler_order_without_the_padding(n, world, batch_size, shuffle):
    batches, order = rank_batches(n, world, batch_size, shuffle)
    assert sum(len(b) for r in batches for b in r) > n or n % world == 0, "the sampler pads"
    as_lists, as_rows = [], []
    for j in range(len(batches[0])):
        pieces = [batches[r][j] for r in range(world)]
        positions = metrics.sample_positions(
            [len(p) for p in pieces], batch_index=j, batch_size=batch_size, total=n
        )
        as_lists += [pieces[r][t] for r, t in positions]
        rows = metrics.sampler_order(
            [torch.tensor(p) for p in pieces], batch_index=j, batch_size=batch_size, total=n
        )
        as_rows += rows.tolist()
    assert as_lists == order
    assert as_rows == order


def test_only_the_pass_being_iterated_counts_as_accelerates_active_loader(clean_env):
    """gather_for_metrics trims for the pass being iterated (an inner loop, then the outer
    one again), through its last batch, and for none once every pass ended: a loader never
    prepared then gathers whole (tests/multiprocess/test_accelerate_idioms.py, 2 ranks)."""
    from gradsync.accelerate import Accelerator

    accel = Accelerator()
    train, evaluation = accel.prepare(
        DataLoader(list(range(6)), batch_size=2), DataLoader(list(range(4)), batch_size=2)
    )
    state = accel.gradient_state
    assert accel._loaders.iterating() is None
    ends = []
    for i, _ in enumerate(train):
        outer = accel._loaders.iterating()
        assert outer is not None and outer.owner is train
        if i == 1:
            for _ in evaluation:
                assert accel._loaders.iterating().owner is evaluation
            assert accel._loaders.iterating() is outer  # the inner pass ended
        ends.append(state.end_of_dataloader)
    assert ends == [False, False, True]  # still being iterated during its last batch
    assert accel._loaders.iterating() is None
    assert not state.end_of_dataloader and state.remainder == -1
    assert accel._loaders.last_pass() is outer  # what a checkpoint reads is unchanged
