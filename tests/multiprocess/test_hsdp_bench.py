"""Smoke check of benchmarks/hsdp_bytes.py: `--quick` runs 4 ranks on a (2, 2) mesh and its
per-group bytes agree with what each policy promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multiprocess


def test_hsdp_bytes_quick(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hsdp_bytes.py"), "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| 4 | defer_replicate |" in (tmp_path / "hsdp_bytes.md").read_text()
    cells = {c["policy"]: c for c in json.loads((tmp_path / "hsdp_bytes.json").read_text())["cells"]}
    assert set(cells) == {"every_step", "defer_replicate", "defer"}
    shard = cells["defer_replicate"]["grad_bytes"] / 2  # a replica's shard: G / S
    for policy, cell in cells.items():
        (window,) = cell["windows"]
        replicate = window["groups"]["replicate"]
        per_step = 4 if policy == "every_step" else 1  # k = 4: every micro-step, or the boundary only
        assert replicate["reduction_bytes"] == pytest.approx(per_step * shard), policy
        assert window["replicate_allreduces_off_boundary"] == (0 if policy != "every_step" else
                                                               3 * replicate["ops"]["allreduce"] // 4)
        assert "by group: shard [" in cell["summary"] and ", replicate [" in cell["summary"]
