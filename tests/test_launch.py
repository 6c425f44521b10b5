"""`gradsync launch` and `gradsync plan`: real processes, real rendezvous on 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync.launch import LaunchConfig, Launcher

SCRIPT = Path(__file__).resolve().parent / "scripts" / "report_rank.py"


def gradsync(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    full.update({"OMP_NUM_THREADS": "1", **(env or {})})
    return subprocess.run([sys.executable, "-m", "gradsync", *args], capture_output=True, text=True,
                          timeout=timeout, env=full)


def reports(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]


@pytest.mark.multiprocess
def test_launch_two_processes_both_report(tmp_path):
    proc = gradsync("launch", "--nproc-per-node", "2", "--gradient-accumulation-steps", "3",
                    str(SCRIPT), str(tmp_path), "--flag", "value")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = reports(tmp_path)
    assert [r["rank"] for r in got] == [0, 1]
    for r in got:
        assert r["world_size"] == 2 and r["backend"] == "ddp" and r["accumulation"] == 3
        assert r["rank_sum"] == 1.0 and r["args"] == ["--flag", "value"]


@pytest.mark.multiprocess
def test_launch_returns_the_workers_exit_status(tmp_path):
    proc = gradsync("launch", "--nproc-per-node", "2", str(SCRIPT), str(tmp_path),
                    env={"REPORT_EXIT_CODE": "3"})
    assert proc.returncode == 3, proc.stdout + proc.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.multiprocess
def test_two_nodes_on_one_machine_form_one_job(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    full = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    full["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "gradsync", "launch", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-endpoint", endpoint, "--global-batch-size", "8", "--micro-batch-size", "2",
           str(SCRIPT), str(tmp_path)]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full)
             for _ in range(2)]
    outs = [n.communicate(timeout=180)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    got = reports(tmp_path)
    assert sorted(r["rank"] for r in got) == [0, 1]
    for r in got:
        # 8 = 2 per micro-batch x 2 processes x 2 accumulation steps
        assert r["world_size"] == 2 and r["accumulation"] == 2 and r["micro_batch_size"] == 2
        assert r["rank_sum"] == 1.0


def test_dry_run_prints_the_command_and_settings(tmp_path):
    proc = gradsync("launch", "--nproc-per-node", "2", "--gradient-accumulation-steps", "4",
                    "--backend", "ddp", "--dry-run", str(SCRIPT), "x")
    assert proc.returncode == 0, proc.stderr
    assert "torch.distributed.run --nproc-per-node=2 --nnodes=1 --standalone" in proc.stdout
    assert "GRADSYNC_GRADIENT_ACCUMULATION_STEPS=4" in proc.stdout
    assert "GRADSYNC_BACKEND=ddp" in proc.stdout
    assert f"{SCRIPT} x" in proc.stdout


def test_plan_prints_the_sizes():
    proc = gradsync("plan", "--global-batch-size", "64", "--micro-batch-size", "4", "--nproc-per-node", "2")
    assert proc.returncode == 0, proc.stderr
    assert "accumulation steps:      8" in proc.stdout
    assert "global batch size:       64" in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["plan", "--global-batch-size", "60", "--micro-batch-size", "4", "--nproc-per-node", "2"],
         "global_batch_size=60 is not divisible by micro_batch_size x world size = 4 x 2 = 8"),
        (["launch", "--nproc-per-node", "2", "--global-batch-size", "60", "--micro-batch-size", "4", str(SCRIPT)],
         "global_batch_size=60 is not divisible"),
        (["launch", "--nproc-per-node", "2", "no_such_script.py"], "script 'no_such_script.py' does not exist"),
        (["launch", "--backend", "horovod", str(SCRIPT)], "backend='horovod' is unknown; available: auto, "),
        (["launch", "--gradient-accumulation-steps", "0", str(SCRIPT)], "gradient_accumulation_steps=0 must be >= 1"),
        (["launch", "--gradient-accumulation-steps", "-2", str(SCRIPT)], "gradient_accumulation_steps=-2 must be >= 1"),
        (["launch", "--sync-policy", "sometimes", str(SCRIPT)], "--sync-policy='sometimes' is unknown"),
        (["launch", "--nnodes", "2", str(SCRIPT)], "--nnodes=2 needs --rdzv-endpoint"),
    ],
)
def test_bad_input_is_one_line_without_traceback(args, message):
    proc = gradsync(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradsync: error: ")
    assert message in lines[0]


def test_non_integer_accumulation_is_rejected_by_the_parser():
    proc = gradsync("launch", "--gradient-accumulation-steps", "four", str(SCRIPT))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--gradient-accumulation-steps: invalid int value: 'four'" in proc.stderr


def test_launcher_is_usable_from_python(tmp_path):
    launcher = Launcher(LaunchConfig(script=str(SCRIPT), nproc_per_node=2, gradient_accumulation_steps=4))
    assert launcher.plan.gradient_accumulation_steps == 4
    assert launcher.worker_env()["GRADSYNC_GRADIENT_ACCUMULATION_STEPS"] == "4"
    assert "--standalone" in launcher.torchrun_argv()
