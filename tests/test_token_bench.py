"""Smoke check of benchmarks/token_weighting.py: `--quick` runs and writes what it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_quick_run_writes_json_and_table(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "token_weighting.py"), "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "token_weighting.json").read_text())
    assert result["k"] == 8 and result["backend"] == "ddp"
    assert result["mean_step_ms"] > 0 and result["sum_step_ms"] > 0
    assert 0 < result["count_allreduce_share"] < 1
    assert "| ddp | 8 |" in (tmp_path / "token_weighting.md").read_text()
