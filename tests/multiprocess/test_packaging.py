"""What the package promises before any training starts: the command line, the settings and
``import gradsync`` need no torch (each checked in a fresh interpreter), the command line's
errors are one line, and the installed package carries its type information."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train.py"

# Run the CLI in a fresh interpreter where `import torch` fails, as on a machine without it.
NO_TORCH = """
import sys
sys.modules["torch"] = None  # any import of torch now raises ImportError
from gradsync.cli import main
sys.exit(main(sys.argv[1:]))
"""


def without_torch(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_plan_runs_without_torch():
    proc = without_torch(
        "plan", "--global-batch-size", "64", "--micro-batch-size", "4", "--nproc-per-node", "2"
    )
    assert proc.returncode == 0, proc.stderr
    assert "accumulation steps:      8" in proc.stdout


def test_plan_estimate_runs_without_torch():
    proc = without_torch(
        "plan",
        "--gradient-accumulation-steps",
        "8",
        "--nproc-per-node",
        "8",
        "--estimate",
        "--params",
        "1e9",
        "--bandwidth",
        "400",
        "--latency-us",
        "20",
        "--compute-ms",
        "100",
    )
    assert proc.returncode == 0, proc.stderr
    assert "ddp      defer" in proc.stdout and "speed-up" in proc.stdout


def test_launch_help_and_dry_run_run_without_torch():
    help_ = without_torch("launch", "--help")
    assert help_.returncode == 0, help_.stderr
    assert "usage: gradsync launch" in help_.stdout
    dry = without_torch(
        "launch",
        "--dry-run",
        "--nproc-per-node",
        "2",
        "--gradient-accumulation-steps",
        "4",
        str(EXAMPLE),
    )
    assert dry.returncode == 0, dry.stderr
    assert "torch.distributed.run --nproc-per-node=2" in dry.stdout
    assert "GRADSYNC_GRADIENT_ACCUMULATION_STEPS=4" in dry.stdout


def test_launch_without_torch_says_so_in_one_line():
    proc = without_torch("launch", "--nproc-per-node", "2", str(EXAMPLE))
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gradsync: error: starting the workers needs torch")
    assert "pip install torch" in lines[0]


def test_import_gradsync_does_not_import_torch_until_the_accelerator_is_touched_nor_dynamo_until_torch_does():
    code = (
        "import sys, gradsync\n"
        "from gradsync import BatchPlan, Config, ConfigError\n"
        "assert 'torch' not in sys.modules, 'import gradsync imported torch'\n"
        "BatchPlan.solve(data_parallel_size=2, global_batch_size=16, micro_batch_size=2)\n"
        "assert 'torch' not in sys.modules\n"
        "gradsync.Accelerator\n"
        "assert 'torch' in sys.modules\n"
        "assert gradsync.audit.REDUCTIONS\n"
        # torch.compile's dynamo costs seconds of start-up: imported by the first optimizer
        # (torch's own doing), and only then does the audit keep compiled code out of its group
        "assert 'torch._dynamo' not in sys.modules, 'gradsync imported torch._dynamo'\n"
        "assert not hasattr(gradsync.audit.AuditProcessGroup.allreduce, '_torchdynamo_disable')\n"
        "import torch\n"
        "torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)\n"
        "assert gradsync.audit.AuditProcessGroup.allreduce._torchdynamo_disable\n"
        "assert type(sys.modules['torch._dynamo'].__loader__).__name__ == 'SourceFileLoader'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_unknown_attribute_is_an_attribute_error():
    import gradsync

    with pytest.raises(AttributeError, match="no attribute 'Accelerater'"):
        gradsync.Accelerater  # noqa: B018


def test_the_built_wheel_ships_py_typed(tmp_path):
    """Build the wheel as pip would (from this checkout, no network) and look inside."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheel = next(tmp_path.glob("gradsync-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "gradsync/py.typed" in names
    assert "gradsync/backends/_fsdp_compat.py" in names


def test_plan_prints_one_row_per_world_size_without_torch():
    proc = without_torch(
        "plan", "--global-batch-size", "256", "--micro-batch-size", "8", "--nproc-per-node", "1,2,8"
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 1 |")]
    assert [row.split("|")[5].strip() for row in rows] == ["32", "16", "4"]


def test_plan_shows_a_schedule_and_flags_rows_that_do_not_fit(tmp_path):
    proc = without_torch(
        "plan",
        "--micro-batch-size",
        "4",
        "--gradient-accumulation-steps",
        "0:2 100:4",
        "--nproc-per-node",
        "1,8",
    )
    assert proc.returncode == 0, proc.stderr
    assert "| 1 | 8 | 8 | 4 | 2 (from step 0) -> 4 (from step 100) | 64 -> 128 |" in proc.stdout
    config = tmp_path / "ramp.yaml"
    config.write_text(
        "micro_batch_size: 4\nglobal_batch_size: 512\n"
        "gradient_accumulation_steps: {start: 64, increment: 64, samples: 10000}\n"
    )
    proc = without_torch("plan", "--config", str(config), "--nproc-per-node", "2,32")
    assert proc.returncode == 2
    assert "| 1 | 2 | 2 | 4 | 8 -> 64 (ramp-up over 10000 samples) | 64 -> 512 |" in proc.stdout
    assert "error: ramp-up start=64 is not a multiple of" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--bandwidth", "46", "--latency-us", "25", "--compute-ms", "1"],
            "needs the model size: give --params",
        ),
        (["--params", "1e9"], "needs --bandwidth, --latency-us, --compute-ms"),
    ],
)
def test_plan_estimate_errors_are_one_line(args, message):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradsync",
            "plan",
            "--gradient-accumulation-steps",
            "4",
            "--estimate",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("gradsync: error: --estimate") and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_settings_and_the_launcher_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import gradsync.settings, gradsync.config, gradsync.cli, gradsync.launch.torchrun\n"
        "print(gradsync.settings.reference_markdown()[:10])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")},
    )
    assert proc.returncode == 0, proc.stderr
