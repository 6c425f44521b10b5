"""`gradsync verify` end to end: each verify is one launch (2 gloo ranks, or 1 for the bad
inputs) and one single-process reference, from the command line's words (``gradsync.cli``
called in this process, as ``python -m gradsync`` calls it: one interpreter fewer per case;
the multi-node refusal runs the real ``python -m gradsync verify``).

The launched runs start their workers as copies of the launcher (``--start-method fork``,
``FORK``), except the README's DDP example: what is tested here is the verdict, not how a
worker starts (tests/multiprocess/test_launch.py compares the two starts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.verify import ROOT, table

#: Each test starts its own processes and shares nothing with the others: xdist may run
#: them on either worker (tests/conftest.py).
INDEPENDENT_TESTS = True

CASES = ROOT / "tests" / "scripts" / "verify_cases.py"
TRAIN = ROOT / "examples" / "train.py"
CAUSAL = ROOT / "examples" / "causal_lm.py"
#: Transformers' run_clm_no_trainer.py as the corpus has it (tests/accelerate_scripts/)
ACCELERATE_CLM = ROOT / "tests" / "accelerate_scripts" / "causal_lm.py"
FORK = ("--start-method", "fork")


def rel_diffs(out: str) -> list[float]:
    return [float(row[4]) for row in table(out)]


@pytest.mark.parametrize(
    "launch",
    [
        ("--backend", "ddp"),  # as the README runs it: fresh interpreters
        ("--backend", "fsdp", *FORK),
        ("--use-deepspeed", "--zero-stage", "2", *FORK),
    ],
    ids=["ddp", "fsdp2", "zero2"],
)
def test_the_example_is_exact_on_every_backend(run_verify, launch):
    code, out = run_verify(
        "--nproc-per-node",
        "2",
        *launch,
        "--gradient-accumulation-steps",
        "4",
        TRAIN,
        "--epochs",
        "1",
    )
    assert code == 0, out
    rows = table(out)
    assert [r[0] for r in rows] == ["1", "2", "3"], out
    assert all(r[-1] == "ok" for r in rows)
    assert max(rel_diffs(out)) <= 1e-5
    assert "8 micro-batches per window" in out
    if launch[1] == "ddp":
        assert all(r[5] == "0" for r in rows), out  # no gradient bytes off the boundary


def test_the_example_is_exact_on_a_2x2_mesh_deferring_the_replica_all_reduce(run_verify):
    code, out = run_verify(
        "--nproc-per-node",
        "4",
        *FORK,
        "--backend",
        "fsdp",
        "--fsdp-mesh",
        "2,2",
        "--sync-policy",
        "defer_replicate",
        "--gradient-accumulation-steps",
        "4",
        TRAIN,
        "--epochs",
        "1",
    )
    assert code == 0, out
    assert "16 micro-batches per window" in out and "with 4 process(es)" in out
    assert max(rel_diffs(out)) <= 1e-5, out


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_the_token_weighted_example_is_exact(run_verify, backend):
    code, out = run_verify(
        "--nproc-per-node",
        "2",
        *FORK,
        "--backend",
        backend,
        "--gradient-accumulation-steps",
        "4",
        "--steps",
        "2",
        CAUSAL,
    )
    assert code == 0, out
    assert len(table(out)) == 2 and max(rel_diffs(out)) <= 1e-5, out


def accelerate_ruled(tmp_path: Path) -> Path:
    """The corpus's run_clm_no_trainer.py-style script with its import lines respelled to
    ``gradsync.accelerate`` (Accelerate's rule book), as a user switching would."""
    sys.path.insert(0, str(ACCELERATE_CLM.parent))
    try:
        from run_all import respell
    finally:
        sys.path.remove(str(ACCELERATE_CLM.parent))
    script = tmp_path / "clm_no_trainer.py"
    script.write_text(respell(ACCELERATE_CLM.read_text()))
    (tmp_path / "out").mkdir()
    return script


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_an_accelerate_ruled_script_with_its_default_linear_schedule_is_exact(
    run_verify, tmp_path, backend
):
    # Under Accelerate's rules the prepared scheduler steps twice per update on 2 processes:
    # the one-process reference steps it twice too (it stepped it once: step 2 differed).
    script = accelerate_ruled(tmp_path)
    code, out = run_verify(
        "--nproc-per-node", "2", *FORK, "--backend", backend, "--steps", "3", script,
        "--out", tmp_path / "out", "--lr_scheduler_type", "linear", "--num_warmup_steps", "0",
    )  # fmt: skip
    assert code == 0, out
    assert [r[-1] for r in table(out)] == ["ok", "ok", "ok"], out
    assert max(rel_diffs(out)) <= 1e-5, out
    assert "under Accelerate's rules (gradsync.accelerate) the prepared scheduler steps 2 " in out


def test_a_schedule_sized_with_the_process_count_is_named_as_the_rule(run_verify, tmp_path):
    # num_warmup_steps * num_processes: 2 warmup steps of the scheduler on 2 processes, 1 in
    # one process; the synchronisation is right, the schedule differs by Accelerate's rule.
    script = accelerate_ruled(tmp_path)
    code, out = run_verify(
        "--nproc-per-node", "2", *FORK, "--backend", "ddp", "--steps", "3", script,
        "--out", tmp_path / "out", "--num_warmup_steps", "1",
    )  # fmt: skip
    assert code == 1, out
    assert [r[-1] for r in table(out)] == ["ok", "DIFFERS", "DIFFERS"], out
    verdict = [line for line in out.splitlines() if line.startswith("verdict:")]
    assert len(verdict) == 1, out
    assert "because the learning rate differs after step 1" in verdict[0], out
    assert "under Accelerate's rules (gradsync.accelerate)" in verdict[0], out
    assert "num_processes" in verdict[0] and "depends on the rank" not in verdict[0], out


def test_a_loss_scaled_by_the_rank_differs_from_the_first_step(run_verify, tmp_path):
    text = TRAIN.read_text()
    line = "loss = nn.functional.mse_loss(model(x), y)"
    assert line in text
    buggy = tmp_path / "train_rank_bug.py"
    buggy.write_text(text.replace(line, line + " * (1 + accel.rank)"))
    code, out = run_verify(
        "--nproc-per-node", "2", *FORK, "--gradient-accumulation-steps", "4", buggy
    )
    assert code == 1, out
    rows = table(out)
    assert rows and all(r[-1] == "DIFFERS" for r in rows), out
    assert float(rows[0][1]) > 1.3 * float(rows[0][2])  # the window loss says it at step 1
    assert "differs from one process from step 1 on" in out


def test_noise_in_the_step_is_reported_as_non_determinism_and_dataset_noise_is_replayed(run_verify):
    code, out = run_verify("--nproc-per-node", "2", *FORK, CASES, "--case", "forward-noise")
    assert code == 2, out
    assert "not deterministic" in out and "torch" in out, out
    code, out = run_verify("--nproc-per-node", "2", *FORK, CASES, "--case", "dataset-noise")
    assert code == 0, out  # the augmented batches are recorded, and replayed
    assert "dropout set to p=0 in both runs: 2 (p=0.2)" in out


@pytest.mark.parametrize(
    "case, words",
    [
        ("fail", ["the script failed under gradsync launch", "fails on purpose"]),
        ("no-loader", ["prepared no dataloader"]),
        ("no-accumulate", ["completed no optimizer step"]),
        ("shards-itself", ["dataset_shards_itself=True"]),
    ],
)
def test_what_cannot_be_verified_exits_2_with_one_line(run_verify, case, words):
    # No --max-seconds: these runs end by themselves, however long a loaded machine takes.
    code, out = run_verify("--nproc-per-node", "1", *FORK, CASES, "--case", case)
    assert code == 2, out
    verdict = [line for line in out.splitlines() if line.startswith("verdict: cannot verify")]
    assert len(verdict) == 1, out
    for word in words:
        assert word in verdict[0], out


def test_a_script_that_hangs_is_stopped_at_max_seconds_with_one_line(run_verify):
    # The script sleeps 10 minutes before it trains: it runs past the limit however fast or
    # loaded the machine is, so a short limit keeps the test short without making it flaky.
    code, out = run_verify(
        "--nproc-per-node", "1", *FORK, "--max-seconds", "5", CASES, "--case", "hang"
    )
    assert code == 2, out
    verdict = [line for line in out.splitlines() if line.startswith("verdict: cannot verify")]
    assert len(verdict) == 1, out
    assert "ran past --max-seconds=5" in verdict[0], out


def test_a_multi_node_launch_is_refused_before_anything_starts():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradsync",
            "verify",
            "--nnodes",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            "29999",
            str(TRAIN),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert proc.returncode == 2 and "one node" in proc.stderr, proc.stdout + proc.stderr


def test_a_compressed_run_is_verified_at_the_tolerance_its_compression_implies(run_verify):
    """fp16 on 2 DDP ranks: compared with one process at fp16's tolerance, said in the report
    and the verdict, with the exact check to run."""
    code, out = run_verify(
        "--nproc-per-node", "2", "--backend", "ddp", *FORK, "--gradient-accumulation-steps", "4",
        "--comm-hook", "fp16", TRAIN, "--epochs", "1",
    )  # fmt: skip
    assert code == 0, out
    assert [r[-1] for r in table(out)] == ["ok", "ok", "ok"], out
    assert "tolerance: 0.002 relative (fp16, comm_hook=fp16)" in out
    assert "note: comm_hook='fp16': each window's gradients are reduced once" in out
    assert "with comm_hook='fp16', the launched run equals one process" in out
    assert "run with --comm-hook no for an exact check" in out
    # measured 2.7e-5: beyond fp32's 1e-5, so only the compression's tolerance passes it
    assert 1e-5 < max(rel_diffs(out)) < 2e-3, out


def test_power_sgd_is_verified_until_it_compresses_and_shown_after(run_verify):
    """PowerSGD from the third optimizer step: steps 1-2 (plain all-reduces) are compared at
    fp32's tolerance, step 3 is shown as the approximation it is, not judged."""
    options = '{"start_powerSGD_iter": 2, "matrix_approximation_rank": 1}'
    code, out = run_verify(
        "--nproc-per-node", "2", "--backend", "ddp", *FORK, "--gradient-accumulation-steps", "4",
        "--comm-hook", "power_sgd", "--comm-state-option", options, TRAIN, "--epochs", "1",
    )  # fmt: skip
    assert code == 0, out
    rows = table(out)
    assert [r[-1] for r in rows] == ["ok", "ok", "approx."], out
    assert max(rel_diffs(out)[:2]) < 1e-5 < rel_diffs(out)[2], out
    assert "from step 3 on each reduction is a low-rank approximation" in out
    assert "for 2 optimizer step(s) within 1e-05" in out and "step 3 is PowerSGD's" in out
