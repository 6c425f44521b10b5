"""Killed workers, restarts and resumes under `gradsync launch`, on DDP, FSDP2 and ZeRO 2.

Each launch runs tests/scripts/resume_train.py on 2 gloo ranks: k=4, SGD with momentum,
an LR schedule, dropout, shuffled data ending in partial windows. Its first attempt trains
the uninterrupted reference, then the checkpointed run, in which a rank SIGKILLs itself
mid-window; torchrun restarts every worker, the script resumes from latest_checkpoint,
and the final parameters must equal the reference bit for bit.

The workers start as copies of the launcher (``--start-method fork``, ``FORK``): what is
tested here is the training that resumes, not how a worker starts. fairscale's restarts and
the two failure reports start fresh interpreters (the default), as does tests/multiprocess/
test_launch.py, which also checks that a copy starts as a fresh interpreter would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scenarios.common import reference_on

#: Each test starts its own processes and shares nothing with the others: xdist may run
#: them on either worker (tests/conftest.py).
INDEPENDENT_TESTS = True

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve().parents[1]  # tests/
SCRIPT = HERE / "scripts" / "resume_train.py"
FAIL = HERE / "scripts" / "fail_rank.py"
FORK = ("--start-method", "fork")


def launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GRADSYNC_", "TORCH_DISABLE_SHARE"))
    }
    env.update({"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    return subprocess.run(
        [sys.executable, "-m", "gradsync", "launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def results(out: Path, name: str) -> list[dict]:
    return [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in (0, 1)]


def assert_bitwise(out: Path) -> None:
    ref, final = load(out / "reference.pt"), load(out / "final.pt")
    assert ref.keys() == final.keys()
    unequal = [k for k in ref if not torch.equal(ref[k], final[k])]
    assert not unequal, {k: float((ref[k] - final[k]).abs().max()) for k in unequal}
    # The run really trained as long as the reference, and the last step moved the weights.
    assert [r["optimizer_steps"] for r in results(out, "final")] == [
        r["optimizer_steps"] for r in results(out, "reference")
    ]


# (backend, extra flags, kills per attempt, the checkpoint each restart must resume from).
# "save:M": rank 0 is SIGKILLed in the middle of the save at micro-step M, once the backend
# has written the models and optimizers (DDP's plain files, DCP's shards, DeepSpeed's engine
# checkpoint); the next attempt must skip that broken folder and resume from the one before.
RUNS = {
    # Three restarts; the checkpoints the restarts resume from were saved mid-window
    # (micro-steps 5 and 20: windows are 4, 4, 3 micro-steps per epoch), the first of them
    # committed in the background (the script saves every other checkpoint that way); the
    # save at 25 dies, and the last attempt resumes from micro-step 20 again.
    "ddp": (["--max_restarts", "3", *FORK], ["--kill", "1:6,0:21,save:25"], "micro-0020"),
    "fsdp": (
        ["--max_restarts", "2", *FORK],
        ["--kill", "1:7,save:20", "--policy", "defer"],
        "micro-0015",
    ),
    # DeepSpeed saves at boundaries only (micro-steps 15, in the background, and 30); the
    # first kill is mid-window, the second in the save at 30.
    "deepspeed": (
        ["--max_restarts", "2", *FORK],
        ["--kill", "1:21,save:30", "--boundary-only"],
        "micro-0015",
    ),
    # fairscale (legacy): boundary checkpoints too, its OSS optimizer state gathered on save;
    # its workers start as fresh interpreters (the default), restarts included.
    "fairscale": (
        ["--max_restarts", "2"],
        ["--kill", "0:17,save:30", "--boundary-only"],
        "micro-0015",
    ),
}


@pytest.mark.parametrize("backend", list(RUNS))
def test_a_killed_rank_restarts_and_ends_bitwise_equal(tmp_path, backend):
    if backend in ("deepspeed", "fairscale"):
        pytest.importorskip(backend)
    flags, script_flags, resumed = RUNS[backend]
    proc = launch(
        "--nproc_per_node",
        "2",
        "--standalone",
        *flags,
        str(SCRIPT),
        str(tmp_path),
        "--backend",
        backend,
        "--with-reference",
        *script_flags,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    final = results(tmp_path, "final")
    kills = script_flags[1].count(":")
    for r in final:
        assert r["restarts"] == kills, r  # every kill was followed by a restart
        assert Path(r["resumed_from"]).name == resumed, r
        assert r["share_store"] == "1"  # the launcher opted out of the shared rendezvous store
    if backend == "fsdp":
        assert final[0]["policy"] == "defer"  # the window's gradients lived inside FSDP2
    assert proc.stderr.count("gradsync: a worker failed; restarting every worker") == kills
    assert_bitwise(tmp_path)


def test_power_sgd_resumes_bitwise_after_a_killed_rank(tmp_path):
    """``--comm-hook power_sgd`` (compressing from the third optimizer step): each rank's
    error feedback and warm-start matrices are in the checkpoint and follow the parameters
    into the restarted workers' first DDP bucket layout. Killed after micro-steps 7 and 21;
    both restarts resume mid-window (micro-steps 5 and 20)."""
    proc = launch(
        "--nproc_per_node",
        "2",
        "--standalone",
        "--max_restarts",
        "2",
        *FORK,
        "--comm-hook",
        "power_sgd",
        "--comm-state-option",
        '{"start_powerSGD_iter": 2, "matrix_approximation_rank": 1}',
        str(SCRIPT),
        str(tmp_path),
        "--backend",
        "ddp",
        "--with-reference",
        "--kill",
        "1:7,0:21",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    final = results(tmp_path, "final")
    for r in final:
        assert r["restarts"] == 2, r
        assert Path(r["resumed_from"]).name == "micro-0020", r
    kept = sorted((tmp_path / "ckpt").iterdir())  # the last two (keep_last=2)
    assert kept and all(
        {"comm_rank0.pt", "comm_rank1.pt"} <= {p.name for p in k.iterdir()} for k in kept
    )
    assert_bitwise(tmp_path)


def test_sigterm_on_one_rank_saves_on_every_rank_and_the_job_resumes(tmp_path):
    """Only rank 1 gets SIGTERM (mid-window 2); both ranks agree, save step-2 when window 3
    starts and exit cleanly; a new launch resumes bitwise."""
    first = launch(
        "--nproc-per-node",
        "2",
        *FORK,
        str(SCRIPT),
        str(tmp_path),
        "--backend",
        "ddp",
        "--with-reference",
        "--save-every",
        "1000",
        "--sigterm-at",
        "6",
        "--sigterm-rank",
        "1",
    )
    assert first.returncode == 0, first.stdout + first.stderr[-6000:]
    assert "gradsync: SIGTERM received; saved" in first.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-2"]
    assert not (tmp_path / "final.pt").exists()
    second = launch(
        "--nproc-per-node",
        "2",
        *FORK,
        str(SCRIPT),
        str(tmp_path),
        "--backend",
        "ddp",
        "--save-every",
        "1000",
        "--sigterm-rank",
        "1",
    )
    assert second.returncode == 0, second.stdout + second.stderr[-6000:]
    assert results(tmp_path, "final")[0]["resumed_from"] == str(tmp_path / "ckpt" / "step-2")
    assert_bitwise(tmp_path)


def test_fsdp_saved_on_two_ranks_resumes_on_one(tmp_path):
    """FSDP2 shards of 2 ranks resharded by torch.distributed.checkpoint onto 1 rank; the
    epoch resumes after as many samples as were consumed (no dropout: the reference replays
    the windows each run really trained on)."""
    first = launch(
        "--nproc-per-node",
        "2",
        *FORK,
        str(SCRIPT),
        str(tmp_path),
        "--backend",
        "fsdp",
        "--dropout",
        "0",
        "--reshard-at",
        "15",
    )
    assert first.returncode == 0, first.stdout + first.stderr[-6000:]
    second = launch(
        "--nproc-per-node",
        "1",
        *FORK,
        str(SCRIPT),
        str(tmp_path),
        "--backend",
        "fsdp",
        "--dropout",
        "0",
        "--resume-from",
        str(tmp_path / "reshard"),
    )
    assert second.returncode == 0, second.stdout + second.stderr[-6000:]
    before = [json.loads((tmp_path / f"reshard_rank{r}.json").read_text()) for r in (0, 1)]
    after = json.loads((tmp_path / "final_rank0.json").read_text())
    assert after["world_size"] == 1 and after["resumed_from"] == str(tmp_path / "reshard")
    windows = [
        before[0]["windows"][i] + before[1]["windows"][i] for i in range(len(before[0]["windows"]))
    ]
    # The restored recorder holds rank 0's windows before the save; then one rank's.
    resumed = after["windows"][len(before[0]["windows"]) :]
    # The rest of the epoch: as many samples as were not consumed (16 of 44 were, on 2 ranks).
    assert sum(len(mb) for w in resumed[:4] for mb in w) == 44 - 16
    assert [len(w) for w in resumed[:4]] == [4, 4, 4, 2]
    ref = reference_on(windows + resumed)
    final = load(tmp_path / "final.pt")
    diff = max(float((ref[k] - final[k]).abs().max()) for k in ref)
    assert diff < 1e-5, diff
    assert len(resumed) > 5  # it went on training, over whole 1-rank epochs


def test_a_raising_worker_fails_the_launch_with_its_error(tmp_path):
    proc = launch("--nproc-per-node", "2", str(FAIL), "raise", timeout=300)
    assert proc.returncode == 1, proc.stderr
    block = proc.stderr[proc.stderr.index("gradsync: rank 1 (local rank 1) failed (exit code 1)") :]
    assert "Traceback (most recent call last)" in block
    assert block.count("Traceback (most recent call last)") == 1  # one block: rank 1's
    assert 'raise ValueError("boom from rank 1: the data file is missing")' in block
    assert "ValueError: boom from rank 1: the data file is missing" in block
    assert "gradsync: also stopped: rank 0" in block
    assert "runpy" not in block and "ChildFailedError" not in proc.stderr


def test_a_hung_collective_times_out_naming_the_operation(tmp_path):
    # The collective timeout (10 s) is what is tested. Every collective of the script has it,
    # so the ranks first wait for each other with no limit (however late one starts on a
    # loaded machine), then train their few steps together before rank 1 stops answering.
    proc = launch("--nproc-per-node", "2", str(FAIL), "hang", str(tmp_path), timeout=300)
    assert proc.returncode == 1, proc.stderr
    block = proc.stderr[proc.stderr.index("gradsync: rank 0 (local rank 0) failed (exit code 1)") :]
    assert (
        "CollectiveError: wait_for_everyone() (a barrier) failed: timed out waiting for another "
        "rank (timeout 10 s; set it with Accelerator(timeout=...) or GRADSYNC_TIMEOUT)"
    ) in block
    assert "gradsync: also stopped: rank 1 (SIGTERM)" in block


def _global_windows(per_rank: list[list[list[list[int]]]]) -> list[list[list[int]]]:
    """Each window's micro-batches over the ranks (rank order)."""
    return [[mb for rank in per_rank for mb in rank[i]] for i in range(len(per_rank[0]))]


@pytest.mark.parametrize(
    ("backend", "before", "after"),
    [("ddp", 2, 1), ("ddp", 1, 2), ("fsdp", 2, 1), ("fsdp", 1, 2)],
)
def test_a_restart_on_another_world_keeps_the_global_batch_and_the_order(
    tmp_path, backend, before, after
):
    """Saved at a boundary on ``before`` processes, resumed by hand on ``after``: k follows
    the world (global batch 16 kept), the epoch goes on from the first sample not trained
    on in the same global order (every sample of every epoch once), and the result is one
    process's on the same global windows."""
    common = [str(SCRIPT), str(tmp_path), "--backend", backend, "--dropout", "0"]
    common += ["--global-batch-size", "16"]
    at = 8 if before == 2 else 16  # the second boundary: 32 of the epoch's 44 samples
    first = launch("--nproc-per-node", str(before), *FORK, *common, "--reshard-at", str(at))
    assert first.returncode == 0, first.stdout + first.stderr[-6000:]
    second = launch(
        "--nproc-per-node", str(after), *FORK, *common, "--resume-from", str(tmp_path / "reshard")
    )
    assert second.returncode == 0, second.stdout + second.stderr[-6000:]
    saved = [json.loads((tmp_path / f"reshard_rank{r}.json").read_text()) for r in range(before)]
    ends = [json.loads((tmp_path / f"final_rank{r}.json").read_text()) for r in range(after)]
    assert all(end["world_size"] == after for end in ends)
    pre = _global_windows([s["windows"] for s in saved])
    post = _global_windows([end["windows"][len(saved[0]["windows"]) :] for end in ends])
    windows = pre + post
    # Full windows hold 16 samples before and after the restart: k = 16 / (2 x world).
    sizes = [sum(len(mb) for mb in w) for w in windows]
    assert sizes[:2] == [16, 16] and 16 in sizes[2:] and max(sizes) == 16, sizes
    epochs, seen = [], []
    for window in windows:
        seen.extend(i for mb in window for i in mb)
        if len(seen) >= 44:
            epochs.append(sorted(seen))
            seen = []
    assert seen == [] and len(epochs) == 3
    assert all(epoch == list(range(44)) for epoch in epochs)
    ref = reference_on(windows)
    final = load(tmp_path / "final.pt")
    diff = max(float((ref[k] - final[k]).abs().max()) for k in ref)
    assert diff < 1e-5, diff
