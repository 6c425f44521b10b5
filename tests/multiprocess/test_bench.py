"""Smoke check of the sync-overhead benchmark: `--quick` runs and writes what it promises.

No timing is asserted (the machine is shared); the structure, the audit counts and the
parameter cross-check between modes are.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gradsync.launch import bench

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "sync_overhead.py"


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "sync_overhead.json").read_text()), proc.stdout


pytestmark = pytest.mark.multiprocess


def test_output_files_exist(quick: tuple[Path, dict[str, Any], str]) -> None:
    out, _, _ = quick
    for name in ("sync_overhead.json", "sync_overhead.md", "sync_overhead.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "sync_overhead.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_keys(quick: tuple[Path, dict[str, Any], str]) -> None:
    _, result, _ = quick
    assert set(result) >= {"meta", "micro", "cells", "ratios", "checks", "notes"}
    assert result["meta"]["quick"] is True and result["meta"]["ks"] == [1, 4]
    cell = next(c for c in result["cells"] if c["backend"] == "ddp" and c["mode"] == "gradsync")
    assert set(cell) >= {
        "step_ms",
        "reductions_per_step",
        "reduction_bytes_per_step",
        "allgathers_per_step",
        "peak_mib_per_rank",
        "predicted_extra_mib",
        "policy_reason",
        "policy",
        "param_diff_vs_gradsync",
    }
    assert set(cell["step_ms"]) >= {"median", "q1", "q3", "min", "max", "n"}
    assert len(cell["peak_mib_per_rank"]) == 2
    row = next(r for r in result["ratios"] if r["backend"] == "ddp" and r["k"] == 4)
    assert set(row) >= {
        "allreduce_ms",
        "compute_ms",
        "speedup",
        "speedup_expected",
        "gradsync_over_manual",
    }
    assert set(result["micro"]) >= {"bare_us", "gradsync_us", "overhead_us"}


def test_every_backend_is_measured_or_noted(quick: tuple[Path, dict[str, Any], str]) -> None:
    _, result, _ = quick
    measured = {c["backend"] for c in result["cells"]}
    for label in ("ddp", "fsdp", "deepspeed-0", "deepspeed-2"):
        assert label in measured or any(n.startswith(label) for n in result["notes"]), label
    assert "ddp" in measured


def test_deferral_shows_in_the_audit(quick: tuple[Path, dict[str, Any], str]) -> None:
    _, result, _ = quick
    cells = {(c["backend"], c["k"], c["mode"]): c for c in result["cells"]}
    for label in ("ddp", "fsdp"):
        if (label, 4, "gradsync") not in cells:
            continue
        naive, gs = cells[(label, 4, "naive")], cells[(label, 4, "gradsync")]
        assert gs["reduction_bytes_per_step"] * 4 == pytest.approx(
            naive["reduction_bytes_per_step"], rel=0.05
        )
        assert gs["reductions_per_micro_step"][:-1] == [0, 0, 0], gs["reductions_per_micro_step"]


def test_the_memory_column_has_a_peak_per_rank_and_the_adapters_prediction(
    quick: tuple[Path, dict[str, Any], str],
) -> None:
    """Every measured cell of ddp and fsdp has each rank's peak above the window start (the
    step's activations at least: above zero); fsdp's gradsync modes carry what the adapter
    predicted for the policy they ran, which for the kept parameters is the unsharded
    gradients minus this rank's half, plus the whole gathered parameters."""
    _, result, _ = quick
    cells = {(c["backend"], c["k"], c["mode"]): c for c in result["cells"]}
    for (label, _, _), cell in cells.items():
        if label in ("ddp", "fsdp"):
            assert cell["peak_mib_per_rank"] is not None and len(cell["peak_mib_per_rank"]) == 2, (
                cell
            )
            assert min(cell["peak_mib_per_rank"]) > 0, cell
    if ("fsdp", 4, "gradsync") in cells:
        numel = next(r["grad_bytes"] for r in result["ratios"] if r["backend"] == "fsdp") // 4
        grads = params = numel * 4  # fp32 gradients and parameters
        gs, naive = cells[("fsdp", 4, "gradsync")], cells[("fsdp", 4, "naive")]
        assert gs["policy"] == "defer + params"
        assert gs["predicted_extra_mib"] * 2**20 == pytest.approx(grads - grads // 2 + params)
        assert naive["predicted_extra_mib"] == 0
        assert "auto -> defer" in cells[("fsdp", 4, "default")]["policy_reason"]


def test_modes_train_alike(quick: tuple[Path, dict[str, Any], str]) -> None:
    # Same batches in the same order: a mode that skipped steps or synced wrongly shows here.
    _, result, _ = quick
    for c in result["cells"]:
        if c["param_diff_vs_gradsync"] is not None:
            assert c["param_diff_vs_gradsync"] < 1e-3, c


def test_progress_and_table_on_stdout(quick: tuple[Path, dict[str, Any], str]) -> None:
    _, _, stdout = quick
    assert "[bench] ddp" in stdout and "| backend | k | mode |" in stdout


def test_gradsync_bench_reports_a_missing_benchmark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(bench.ENV_VAR, str(tmp_path / "nowhere.py"))
    assert bench.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert bench.ENV_VAR in err and "nowhere.py" in err


def test_gradsync_bench_finds_the_checkout_from_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(bench.ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    assert bench.locate() == SCRIPT
