"""Smoke check of benchmarks/hsdp_bytes.py: `--quick` runs 4 ranks on a (2, 2) mesh and on the
1-D mesh of the same ranks; its per-group bytes agree with what each policy promises, and its
memory column has every rank's peak and the adapter's prediction, which the estimate repeats."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync._estimate import MeshCluster, estimate_mesh

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multiprocess


def test_hsdp_bytes_quick(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hsdp_bytes.py"), "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = (tmp_path / "hsdp_bytes.md").read_text()
    assert (tmp_path / "hsdp_memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 4 | defer_replicate |" in table and "| (1, 4) | 4 | auto -> defer + params |" in table
    cells = json.loads((tmp_path / "hsdp_bytes.json").read_text())["cells"]
    hybrid = {c["asked"]: c for c in cells if c["mesh"] == [2, 2]}
    assert set(hybrid) == {"every_step", "defer_replicate", "defer", "defer + params", "auto"}
    assert {c["asked"] for c in cells if c["mesh"] == [1, 4]} == set(hybrid) - {"defer_replicate"}
    shard = hybrid["defer_replicate"]["grad_bytes"] / 2  # a replica's shard: G / S
    for policy, cell in hybrid.items():
        (window,) = cell["windows"]
        replicate = window["groups"]["replicate"]
        per_step = 4 if policy == "every_step" else 1  # k = 4: every micro-step, or the boundary only
        assert replicate["reduction_bytes"] == pytest.approx(per_step * shard), policy
        assert window["replicate_allreduces_off_boundary"] == (0 if policy != "every_step" else
                                                               3 * replicate["ops"]["allreduce"] // 4)
        assert "by group: shard [" in cell["summary"] and ", replicate [" in cell["summary"]
    for cell in cells:
        (r, s), memory = cell["mesh"], cell["memory"]
        assert len(memory["peak_bytes"]) == 4 and min(memory["peak_bytes"]) > 0, cell["asked"]
        # The adapter's prediction for the policy it ran, as the estimate computes it: 0, the
        # partial buffer G/S, G - G/S, or (G + P) - (G + P)/S with the parameters kept.
        est = {row.policy: row for row in estimate_mesh(MeshCluster(
            cell["grad_bytes"], cell["grad_bytes"], dp_replicate=r, dp_shard=s, tp=1, k=cell["k"]))}
        assert memory["predicted_extra_bytes"] == est[cell["policy"]].deferral_bytes, (cell["mesh"], cell["asked"])
    assert hybrid["every_step"]["memory"]["predicted_extra_bytes"] == 0
    assert hybrid["defer"]["memory"]["predicted_extra_bytes"] > 0
    assert hybrid["auto"]["policy"] == "defer + params"  # the quick model fits any budget
