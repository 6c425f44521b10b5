"""Smoke checks of the small benchmarks: `--quick` runs and writes what each promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multiprocess

#: Each test starts its own processes and shares nothing with the others: xdist may run
#: them on either worker (tests/conftest.py).
INDEPENDENT_TESTS = True


def quick(name: str, out: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
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


def test_checkpoint_io(tmp_path):
    """The checkpoint benchmark runs on 2 ranks and writes its medians, ratios and sizes."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradsync",
            "launch",
            "--nproc-per-node",
            "2",
            "--backend",
            "ddp",
            str(ROOT / "benchmarks" / "checkpoint_io.py"),
            "--out",
            str(tmp_path),
            "--repeats",
            "2",
            "--width",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "checkpoint_io_boundary.json").read_text())
    assert result["world_size"] == 2 and result["repeats"] == 2
    assert set(result["median_s"]) == {
        "torch.save",
        "torch.save+fsync",
        "save_state",
        "save_state(background)",
        "background committed",
    }
    assert all(len(v) == 2 and min(v) > 0 for v in result["times_s"].values())
    assert result["ratio_background_vs_torch_save"] > 0
    # The same tensors: a checkpoint holds the bare file's bytes plus small state.
    assert result["bytes"]["save_state"] >= result["bytes"]["torch.save"] > 0
    assert not (tmp_path / "checkpoint_io").exists()  # what it wrote is removed


def test_window_loss_overhead(tmp_path):
    result = quick("window_loss_overhead", tmp_path)
    assert result["off_step_ms"] > 0 and result["on_step_ms"] > 0 and result["control_step_ms"] > 0
    assert result["add_us"] > 0 and result["allreduce_us"] > 0 and result["read_in_loop_us"] >= 0
    assert 0 < result["estimated_share"] < 1
    assert result["windows_read"] == 6 and 0 < result["window_loss_last"] < float("inf"), (
        "the tracked loop reads one finite window loss per timed step"
    )


@pytest.mark.parametrize("mesh", ["1d", "2d"])
def test_canary_cost(tmp_path, mesh):
    """The FSDP2 canary on 2 real ranks (a 1-D mesh and 1 x 2 HSDP): it holds on this torch on
    every rank (the worker asserts it), ends without a hang, and its cost is written."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "canary_cost.py"),
            "--quick",
            "--mesh",
            mesh,
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "canary_cost.json").read_text())
    assert result["mesh"] == mesh and result["canary_ms_median"] > 0
    assert len(result["canary_ms"]) == len(result["prepare_ms"]) == 2


def test_the_compression_axis_through_gradsync_bench(tmp_path):
    """`gradsync bench --compression --quick`: every cell's bytes per optimizer step from the
    audit, fp16/bf16 half the uncompressed run's, PowerSGD's P and Q far fewer, nothing
    reduced off the boundary under defer, fp16/bf16 ending at the uncompressed loss, and
    DDP's bf16 hook refused in one line on gloo."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradsync",
            "bench",
            "--compression",
            "--quick",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "compression.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((tmp_path / "compression.json").read_text())
    cells = {(c["backend"], c["policy"], c["hook"]): c for c in result["cells"]}
    assert len(cells) == 13
    refused = cells[("ddp", "defer", "bf16")]["refused"]
    assert "needs bf16 collectives" in refused and "\n" not in refused
    for (backend, policy, hook), c in cells.items():
        if "refused" in c:
            continue
        assert c["bytes_per_step"] > 0 and c["step_ms"] > 0, (backend, policy, hook)
        if policy == "defer":
            assert c["off_boundary_bytes"] == 0, (backend, hook)
        if hook in ("fp16", "bf16"):
            assert c["bytes_vs_plain"] == 0.5, (backend, policy, hook)
            assert abs(c["loss_vs_plain"]) < 1e-3, (backend, policy, hook)
        if hook.startswith("power_sgd"):  # 64-wide layers: rank r sends (64 + 64) r per weight
            assert c["bytes_vs_plain"] < 0.2, (policy, hook)
    every = cells[("ddp", "every_step", "no")]["bytes_per_step"]
    assert every == 4 * cells[("ddp", "defer", "no")]["bytes_per_step"]  # quick: k = 4
    assert "| ddp | defer | fp16 |" in (tmp_path / "compression.md").read_text()
