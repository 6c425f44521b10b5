"""Smoke check of benchmarks/pp_bench.py: `--quick` runs pp 2 on 2 gloo ranks with GPipe and
1F1B under `every_step` and `defer`; the pipeline's bytes are the same under both policies
and equal the estimate's, and the saved activations each stage holds at its peak are what
the estimate's schedule says (M parts under GPipe, P - stage under 1F1B) times one part's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multiprocess


def test_pp_bench_quick(tmp_path):
    script = str(ROOT / "benchmarks" / "pp_bench.py")
    proc = subprocess.run(
        [sys.executable, script, "--quick", "--steps", "1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "pp_bench.json").read_text())
    assert "Checks: " in (tmp_path / "pp_bench.md").read_text()
    assert result["checks"] and all(c["pass"] for c in result["checks"])
    part = result["part_saved_bytes"]
    by = {(c["schedule"], c["policy"]): c for c in result["cells"]}
    # M = 4 parts, 2 stages: GPipe holds 4 parts on each stage, 1F1B 2 on stage 0, 1 on stage 1.
    held = {"GPipe": {0: 4, 1: 4}, "1F1B": {0: 2, 1: 1}}
    for schedule, parts in held.items():
        peaks = dict(map(tuple, by[(schedule, "every_step")]["saved_peak"]))
        assert peaks == {stage: n * part[stage] for stage, n in parts.items()}, schedule
        assert by[(schedule, "defer")]["pp_bytes"] == by[(schedule, "every_step")]["pp_bytes"]
        assert by[(schedule, "every_step")]["dp_bytes"] == 0, "no data-parallel dim on 2 ranks"
