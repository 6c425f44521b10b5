"""Smoke check of benchmarks/selfcheck_overhead.py: `--quick` runs and writes what it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_quick_run_writes_json_and_table(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "selfcheck_overhead.py"), "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "selfcheck_overhead.json").read_text())
    assert result["backend"] == "ddp" and result["k"] == 8
    assert result["collectives_per_step"] >= 1, "the wrapper must see the step's all-reduce"
    assert result["allreduce_us_wrapped"] > 0 and result["allreduce_us_plain"] > 0
    assert result["estimated_share"] >= 0 and result["step_ms"] > 0
    assert "| ddp | 8 |" in (tmp_path / "selfcheck_overhead.md").read_text()
