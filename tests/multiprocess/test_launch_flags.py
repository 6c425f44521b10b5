"""`gradsync launch` takes torchrun's flags (both spellings) and hands them on; bad values
stop before any process starts, in one line. No process is started here."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync.launch import LaunchConfig, Launcher

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "report_rank.py"


def gradsync(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    return subprocess.run(
        [sys.executable, "-m", "gradsync", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def argv_of(*flags: str) -> list[str]:
    """The torchrun argv that `gradsync launch --dry-run FLAGS script a` prints."""
    proc = gradsync("launch", "--dry-run", *flags, str(SCRIPT), "a")
    assert proc.returncode == 0, proc.stderr
    command = next(line for line in proc.stdout.splitlines() if line.startswith("command: "))
    words = shlex.split(command)
    return words[words.index("torch.distributed.run") + 1 :]


def test_every_torchrun_flag_reaches_torchrun():
    argv = argv_of(
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:29400",
        "--rdzv-id",
        "job7",
        "--rdzv-conf",
        "timeout=30",
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.5",
        "--log-dir",
        "logs",
        "--tee",
        "3",
        "--redirects",
        "0:1,1:2",
        "--local-ranks-filter",
        "0,1",
    )
    assert argv == [
        "--nproc-per-node=2",
        "--nnodes=1:2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29400",
        "--rdzv-id=job7",
        "--max-restarts=3",
        "--rdzv-conf=timeout=30",
        "--monitor-interval=0.5",
        "--log-dir=logs",
        "--tee=3",
        "--redirects=0:1,1:2",
        "--local-ranks-filter=0,1",
        "-m",
        "gradsync.launch.worker",
        str(SCRIPT),
        "a",
    ]


def test_underscore_spellings_mean_the_same():
    dashed = argv_of(
        "--nproc-per-node",
        "2",
        "--standalone",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "2",
        "--log-dir",
        "d",
        "--local-ranks-filter",
        "0",
    )
    underscored = argv_of(
        "--nproc_per_node",
        "2",
        "--standalone",
        "--max_restarts",
        "1",
        "--monitor_interval",
        "2",
        "--log_dir",
        "d",
        "--local_ranks_filter",
        "0",
    )
    assert dashed == underscored
    assert "--standalone" in dashed and "--max-restarts=1" in dashed


@pytest.mark.parametrize("value", ["auto", "cpu"])
def test_nproc_per_node_by_name(value):
    launcher = Launcher(LaunchConfig(script=str(SCRIPT), nproc_per_node=value))
    assert launcher.torchrun_argv()[0] == f"--nproc-per-node={value}"
    assert launcher.config.world_size == (os.cpu_count() or 1)  # no GPU here


def test_no_python_runs_the_program_itself():
    argv = Launcher(
        LaunchConfig(script="bash", script_args=["-c", "true"], no_python=True)
    ).torchrun_argv()
    assert argv[-4:] == ["--no-python", "bash", "-c", "true"]
    module = Launcher(LaunchConfig(script="pkg.train", module=True)).torchrun_argv()
    assert module[-4:] == ["-m", "gradsync.launch.worker", "-m", "pkg.train"]


def test_restarts_opt_out_of_the_shared_rendezvous_store():
    assert (
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
        not in Launcher(LaunchConfig(script=str(SCRIPT))).run_env()
    )
    launcher = Launcher(LaunchConfig(script=str(SCRIPT), max_restarts=2))
    assert launcher.run_env()["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert (
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in launcher.worker_env()
    )  # not a gradsync setting
    out = gradsync("launch", "--dry-run", "--max_restarts", "1", str(SCRIPT)).stdout
    assert "  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-restarts", "-1"], "--max-restarts=-1 must be a whole number >= 0"),
        (
            ["--standalone", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1234"],
            "--standalone runs one node with a local rendezvous; it contradicts --nnodes=2",
        ),
        (["--tee", "7"], "--tee='7' must be 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"),
        (["--redirects", "x"], "--redirects='x' must be 0 (none)"),
        (
            ["--local-ranks-filter", "a,b"],
            "--local-ranks-filter='a,b' must be local ranks separated by commas",
        ),
        (["--monitor-interval", "0"], "--monitor-interval=0.0 must be > 0 (seconds)"),
        (["--nproc-per-node", "gpu"], "--nproc-per-node=gpu, but no CUDA GPU is visible here"),
        (
            [
                "--nnodes",
                "1:3",
                "--rdzv-endpoint",
                "127.0.0.1:1234",
                "--global-batch-size",
                "8",
                "--micro-batch-size",
                "2",
            ],
            "global_batch_size=8 is not divisible",
        ),
        (["--no-python", "-m"], "--no-python and -m cannot be used together"),
    ],
)
def test_bad_torchrun_flags_are_one_line(flags, message):
    proc = gradsync("launch", *flags, str(SCRIPT))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradsync: error: "), proc.stderr
    assert message in lines[0]


@pytest.mark.parametrize("value", ["1:x", "3:1", "1:2:3"])
def test_bad_nnodes_is_rejected_by_the_parser(value):
    proc = gradsync("launch", "--nnodes", value, str(SCRIPT))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "argument --nnodes:" in proc.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--sync-polcy", "defer"],
            "unknown flag --sync-polcy for gradsync launch (did you mean --sync-policy?)",
        ),
        (
            ["--micro_batch_sise", "2"],
            "unknown flag --micro_batch_sise for gradsync launch (did you mean --micro-batch-size?)",
        ),
        (
            ["--timeout", "5"],
            "unknown flag --timeout for gradsync launch: the setting timeout has no flag; "
            "set it in the config file (--config) or as GRADSYNC_TIMEOUT",
        ),
    ],
)
def test_an_unknown_flag_is_one_line_with_a_suggestion(flags, message):
    proc = gradsync("launch", *flags, str(SCRIPT))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == f"gradsync: error: {message}"


def test_setting_flags_take_both_spellings():
    dashed = gradsync(
        "launch",
        "--dry-run",
        "--gradient-accumulation-steps",
        "0:2 10:4",
        "--micro-batch-size",
        "2",
        "--sync-policy",
        "defer",
        "--mixed-precision",
        "bf16",
        str(SCRIPT),
    ).stdout
    underscored = gradsync(
        "launch",
        "--dry-run",
        "--gradient_accumulation_steps",
        "0:2 10:4",
        "--micro_batch_size",
        "2",
        "--sync_policy",
        "defer",
        "--mixed_precision",
        "bf16",
        str(SCRIPT),
    ).stdout
    assert dashed == underscored
    assert "  GRADSYNC_GRADIENT_ACCUMULATION_STEPS=0:2 10:4" in dashed
    assert "  GRADSYNC_SYNC_POLICY=defer" in dashed and "  GRADSYNC_MIXED_PRECISION=bf16" in dashed
