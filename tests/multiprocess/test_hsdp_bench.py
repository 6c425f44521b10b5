"""Smoke check of benchmarks/hsdp_bytes.py: `--quick` runs 4 ranks on a (2, 2) mesh, on the
1-D mesh of the same ranks and on the tensor-parallel mesh (dp_shard 2, tp 2); its per-group
bytes agree with what each policy promises, the TP traffic runs on every micro-step under every
policy, and its memory column has every rank's peak and the adapter's prediction, which the
estimate repeats."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync._plan.estimate import MeshCluster, estimate_mesh

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> Path:
    """One `--quick` run of the three meshes (its folder), shared by the tests below."""
    out = tmp_path_factory.mktemp("hsdp_bench")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "hsdp_bytes.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_hsdp_bytes_quick(quick_run):
    tmp_path = quick_run
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
        per_step = (
            4 if policy == "every_step" else 1
        )  # k = 4: every micro-step, or the boundary only
        assert replicate["reduction_bytes"] == pytest.approx(per_step * shard), policy
        assert window["replicate_allreduces_off_boundary"] == (
            0 if policy != "every_step" else 3 * replicate["ops"]["allreduce"] // 4
        )
        assert "by group: shard [" in cell["summary"] and ", replicate [" in cell["summary"]
    for cell in cells:
        memory = cell["memory"]
        r, s, *rest = cell["mesh"]
        t = rest[0] if rest else 1
        assert len(memory["peak_bytes"]) == 4 and min(memory["peak_bytes"]) > 0, cell["asked"]
        # The adapter's prediction for the policy it ran, as the estimate computes it: 0, the
        # partial buffer G/S, G - G/S, or (G + P) - (G + P)/S with the parameters kept; on the
        # TP mesh G and P are what a rank of a TP group holds (the plan's tp_share split by T).
        est = {
            row.policy: row
            for row in estimate_mesh(
                MeshCluster(
                    cell["grad_bytes"],
                    cell["grad_bytes"],
                    dp_replicate=r,
                    dp_shard=s,
                    tp=t,
                    k=cell["k"],
                    tp_share=cell["tp_share"] if t > 1 else 1.0,
                )
            )
        }
        assert memory["predicted_extra_bytes"] == pytest.approx(
            est[cell["policy"]].deferral_bytes, abs=4
        ), (cell["mesh"], cell["asked"])
    assert hybrid["every_step"]["memory"]["predicted_extra_bytes"] == 0
    assert hybrid["defer"]["memory"]["predicted_extra_bytes"] > 0
    assert hybrid["auto"]["policy"] == "defer + params"  # the quick model fits any budget


def test_hsdp_bytes_quick_tensor_parallel(quick_run):
    """The TP cells of the quick run: dp_shard reductions wait for the boundary where the
    policy defers; the TP all-reduces run on every micro-step, the same bytes under every
    policy, and equal k x one micro-step's (the estimate's TP row)."""
    table = (quick_run / "hsdp_bytes.md").read_text()
    assert "| (1, 2, 2) | 4 | auto -> defer + params |" in table
    cells = json.loads((quick_run / "hsdp_bytes.json").read_text())["cells"]
    tp = {c["asked"]: c for c in cells if c["mesh"] == [1, 2, 2]}
    assert set(tp) == {"every_step", "defer", "defer + params", "auto"}
    g_t = tp["every_step"]["held_grad_bytes"]  # what a rank of a TP group holds: about G / 2
    assert 0.5 * tp["every_step"]["grad_bytes"] <= g_t < 0.6 * tp["every_step"]["grad_bytes"]
    tp_bytes = {policy: cell["windows"][0]["groups"]["tp"]["bytes"] for policy, cell in tp.items()}
    assert len(set(tp_bytes.values())) == 1 and tp_bytes["defer"] > 0, tp_bytes
    for policy, cell in tp.items():
        (window,) = cell["windows"]
        shard = window["groups"]["shard"]
        # k = 4: the unsharded G_T reduce-scattered on every micro-step, or at the boundary only
        assert shard["reduction_bytes"] == (4 if policy == "every_step" else 1) * g_t, policy
        assert window["shard_reduce_scatters_off_boundary"] == (
            0 if policy != "every_step" else 3 * shard["ops"]["reduce_scatter"] // 4
        )
        assert window["groups"]["tp"]["ops"]["allreduce"] % 4 == 0, (
            policy
        )  # the same count per micro-step
        assert 4 * cell["micro_tp"]["allreduce"] == window["groups"]["tp"]["bytes"], policy
        assert ", tp [" in cell["summary"], cell["summary"]
    assert tp["every_step"]["memory"]["predicted_extra_bytes"] == 0
    assert tp["defer"]["memory"]["predicted_extra_bytes"] == g_t - g_t // 2
