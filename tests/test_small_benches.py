"""Smoke checks of the small benchmarks: `--quick` runs and writes what each promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.multiprocess


def quick(name: str, out: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| ddp | 8 |" in (out / f"{name}.md").read_text()
    result: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    assert result["backend"] == "ddp" and result["k"] == 8
    return result


def test_token_weighting(tmp_path):
    result = quick("token_weighting", tmp_path)
    assert result["mean_step_ms"] > 0 and result["sum_step_ms"] > 0
    assert 0 < result["count_allreduce_share"] < 1


def test_selfcheck_overhead(tmp_path):
    result = quick("selfcheck_overhead", tmp_path)
    assert result["collectives_per_step"] >= 1, "the wrapper must see the step's all-reduce"
    assert result["allreduce_us_wrapped"] > 0 and result["allreduce_us_plain"] > 0
    assert result["estimated_share"] >= 0 and result["step_ms"] > 0
