"""``on_oom="split"`` with a real allocation failure on one rank (its address space capped):
every rank drops the window, halves the micro-batch and doubles k, no rank hangs, every
sample of every epoch is trained on exactly once, and the result is one process's on the
same global windows; on DDP (either rank failing), FSDP2 on a 1-D and a 2-D (HSDP) mesh,
and fairscale."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import Scenario, run_scenarios
from scenarios import oom
from scenarios.common import reference_on

SCRIPT = Path(__file__).parents[1] / "scripts" / "resume_train.py"

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


#: One malloc arena per rank. glibc reserves 64 MiB of address space for a thread's own arena
#: at its first allocation, and which collective first wakes each of gloo's two worker threads
#: depends on timing: a reservation inside the cap took more than the third of headroom that a
#: micro-batch of 4 leaves (49 MiB here), and the window split down to micro-batches of 1.
ONE_ARENA = {"MALLOC_ARENA_MAX": "1"}


@pytest.fixture(scope="module")
def results():
    return run_scenarios(CASES, timeout=900, env=ONE_ARENA)


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


def test_an_oom_inside_the_synchronising_backward_restarts_split(tmp_path):
    """Out of memory inside a backward that already synchronises (after its agreement
    point): the attempt ends, ``gradsync launch`` restarts it, and the restart resumes from
    the last checkpoint with its first window split: k = 4 then 8, micro-batches of 2 then
    1, every sample once per epoch, one process's result on the same global windows."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])})
    cmd = [sys.executable, "-m", "gradsync", "launch", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "1", str(SCRIPT), str(tmp_path), "--backend", "ddp"]
    cmd += ["--dropout", "0", "--save-every", "4", "--boundary-only", "--epochs", "2"]
    cmd += ["--on-oom", "split", "--oom-in-sync", "1:11", "--log-windows"]  # 11: epoch 0's end
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-6000:]
    assert "rank 1 failed: OutOfMemoryError" in said, said[-6000:]
    assert "this one runs its first window again with micro_batch_size 1" in said, said[-6000:]
    assert "out of memory on rank(s) [1] in window 3: micro_batch_size 2 -> 1" in said, said[-6000:]
    runs = [json.loads((tmp_path / f"final_rank{r}.json").read_text()) for r in (0, 1)]
    assert runs[0]["restarts"] == 1 and runs[0]["resumed_from"], runs[0]
    logged = [
        [
            json.loads(line)
            for line in (tmp_path / f"windows_rank{r}.jsonl").read_text().splitlines()
        ]
        for r in (0, 1)
    ]
    resumed_at = min(x["step"] for x in logged[0] if x["attempt"] == 1) - 1
    windows = [  # each global window: the first attempt's up to the checkpoint, then the restart's
        a["window"] + b["window"]
        for a, b in zip(*logged)
        if (a["attempt"] == 0 and a["step"] <= resumed_at) or a["attempt"] == 1
    ]
    assert len(windows) == 6 and runs[0]["optimizer_steps"] == 6, len(windows)
    rows = [sum(len(mb) for mb in w) for w in windows]
    widths = [max(len(mb) for mb in w) for w in windows]
    assert widths[:2] == [2, 2] and set(widths[2:]) == {1}, widths  # split from window 3 on
    assert rows == [16, 16, 12] * 2, rows  # the global batch kept (12: the epoch's last)
    for epoch in (windows[:3], windows[3:]):
        assert sorted(i for w in epoch for mb in w for i in mb) == list(range(44))
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    ref = reference_on(windows)
    gap = max(float((ref[k] - final[k]).abs().max()) for k in ref)
    assert gap < 1e-5, gap
