"""``on_oom="split"`` with a real allocation failure on one rank (its address space capped):
every rank drops the window, halves the micro-batch and doubles k, no rank hangs, every
sample of every epoch is trained on exactly once, and the result is one process's on the
same global windows; on DDP (either rank failing), FSDP2 on a 1-D and a 2-D (HSDP) mesh,
and fairscale."""

from __future__ import annotations

import pytest

from harness import Scenario, run_scenarios
from scenarios import oom

CASES = {
    "ddp": Scenario(oom.split_on_oom, backend="ddp", capped_rank=0),
    "ddp_rank1": Scenario(oom.split_on_oom, backend="ddp", capped_rank=1),
    "fsdp": Scenario(
        oom.split_on_oom,
        backend="fsdp",
        capped_rank=1,
        sync_policy="defer",
        fsdp_keep_params_in_window=True,
    ),
    "hsdp": Scenario(
        oom.split_on_oom,
        backend="fsdp",
        capped_rank=0,
        sync_policy="defer",
        fsdp_mesh=(2, 1),
        fsdp_keep_params_in_window=True,
    ),
    "fairscale": Scenario(oom.split_on_oom, backend="fairscale", capped_rank=1),
}


@pytest.fixture(scope="module")
def results():
    return run_scenarios(CASES, timeout=900)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_window_is_replanned_on_every_rank(results, case):
    for rank in (0, 1):
        assert results[case][rank]["plan"] == [4, 4], results[case][rank]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_sample_is_trained_once_per_epoch(results, case):
    windows = results[case][0]["windows"]
    assert windows == results[case][1]["windows"]
    assert all(len(w) == 32 for w in windows), [len(w) for w in windows]
    for epoch in (windows[:2], windows[2:]):
        assert sorted(i for w in epoch for i in w) == list(range(64))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_result_is_one_process_on_the_same_windows(results, case):
    capped = CASES[case].params["capped_rank"]
    gap = results[case][1 - capped]["gap"]
    assert gap is not None and gap < 1e-5, gap


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_main_process_says_it_once(results, case):
    said = results[case][0]["said"]
    assert len(said) == 1, said
    capped = CASES[case].params["capped_rank"]
    assert f"rank(s) [{capped}]" in said[0] and "micro_batch_size 8 -> 4" in said[0], said
    assert results[case][1]["said"] == []
