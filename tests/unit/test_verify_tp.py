"""gradsync verify on an N-D mesh without a process: which ranks the reference replays, and
the one-line refusal when the ranks of a tensor-parallel group read different batches."""

from __future__ import annotations

import json

import torch

from gradsync.verify.records import batches_file, mismatched_readers, readers


def _record(folder, rank, batches):
    passes = [{"batches": batches, "exhausted": True, "len": len(batches)}]
    torch.save({"loaders": [passes]}, folder / batches_file(rank))


def _batches(seed):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(4, 3, generator=g), "y": [torch.arange(4), "tag"]} for _ in range(3)]


def test_the_ranks_of_a_data_parallel_position_are_its_tensor_parallel_group():
    assert readers([0, 0, 1, 1], 2) == [[0, 1], [2, 3]]  # tp=2 innermost
    assert readers([0, 0, 1, 1, 2, 2, 3, 3], 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert readers([0, 1], 2) == [[0], [1]]


def test_a_tensor_parallel_group_that_read_alike_is_replayed_and_one_that_did_not_is_refused(
    tmp_path,
):
    (tmp_path / "meta.json").write_text(json.dumps({"world": 2, "readers": [[0, 1], [2, 3]]}))
    for rank in range(4):
        _record(tmp_path, rank, _batches(seed=rank // 2))  # one data set per data-parallel position
    assert mismatched_readers(tmp_path) is None

    changed = _batches(seed=1)
    changed[2]["x"] = changed[2]["x"].clone()
    changed[2]["x"][1, 1] += 1.0  # rank 3 read one element differently, in batch 3
    _record(tmp_path, 3, changed)
    why = mismatched_readers(tmp_path)
    assert why is not None and "\n" not in why
    assert "ranks 2 and 3 of one tensor-parallel group" in why
    assert "prepared loader 1, pass 1, batch 3" in why

    _record(tmp_path, 3, _batches(seed=1)[:2])  # one batch fewer
    why = mismatched_readers(tmp_path)
    assert why is not None and "3 and 2 batches" in why

    (tmp_path / batches_file(3)).unlink()
    assert "left no batches-rank3.pt" in (mismatched_readers(tmp_path) or "")


def test_plain_data_parallelism_needs_no_check(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"world": 2, "readers": [[0], [1]]}))
    assert mismatched_readers(tmp_path) is None  # no file is read
