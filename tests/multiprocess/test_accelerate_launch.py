"""`gradsync launch` with `accelerate launch`'s flags and with Accelerate's config file, for
real: two processes start, form one group, and each one's Accelerator has the settings the
flags and the file gave (backend, mixed precision, accumulation steps, the CPU device)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data" / "accelerate"

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "report_rank.py"  # reports each rank

_OUTSIDE = ("GRADSYNC_", "PET_", "SLURM_", "PMI_", "OMPI_", "MV2_")
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def gradsync_launch(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_OUTSIDE) and k not in _TORCHRUN}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "gradsync", "launch", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=cwd,
    )


def reports(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]


@pytest.mark.multiprocess
def test_accelerate_flags_and_file_start_two_ranks_with_their_settings(tmp_path):
    script = SCRIPT
    shutil.copy(DATA / "multi_cpu.yaml", tmp_path / "accelerate.yaml")  # as Accelerate wrote it

    # accelerate launch's flags: the total of processes, mixed precision, accumulation steps
    flags = tmp_path / "flags"
    flags.mkdir()
    proc = gradsync_launch(
        "--num_processes",
        "2",
        "--mixed_precision",
        "bf16",
        "--gradient_accumulation_steps",
        "3",
        str(script),
        str(flags),
        "--lr",
        "1",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = reports(flags)
    assert [r["rank"] for r in got] == [0, 1], proc.stdout + proc.stderr
    for r in got:
        assert (r["world_size"], r["backend"], r["mixed_precision"], r["accumulation"]) == (
            2,
            "ddp",
            "bf16",
            3,
        )
        assert r["rank_sum"] == 1.0 and r["args"] == ["--lr", "1"]

    # Accelerate's file (MULTI_CPU, num_processes: 2, mixed_precision: bf16, use_cpu: true),
    # with a flag beside it
    from_file = tmp_path / "file"
    from_file.mkdir()
    proc = gradsync_launch(
        "--config_file",
        "accelerate.yaml",
        "--gradient-accumulation-steps",
        "2",
        str(script),
        str(from_file),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gradsync: warning" not in proc.stderr, proc.stderr  # Accelerate's defaults stay silent
    got = reports(from_file)
    assert [r["rank"] for r in got] == [0, 1], proc.stdout + proc.stderr
    for r in got:
        assert (r["world_size"], r["backend"], r["mixed_precision"], r["accumulation"]) == (
            2,
            "ddp",
            "bf16",
            2,
        )
        assert r["device"] == "cpu" and r["config"] is None  # translated once, by the launcher
        assert r["rank_sum"] == 1.0
