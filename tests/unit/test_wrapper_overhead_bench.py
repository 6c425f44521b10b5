"""The wrapper micro-benchmark runs and reports every loop (a smoke run: no timing claim)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "wrapper_overhead.py"


def test_the_wrapper_benchmark_reports_every_loop(clean_env):
    spec = importlib.util.spec_from_file_location("wrapper_overhead", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.measure(reps=2, iters=16)
    for key in (
        "bare_us",
        "gradsync_us",
        "seeded_us",
        "overhead_us",
        "over_seeded_us",
        "accelerate_us",
    ):
        assert math.isfinite(result[key]) and result[key] != 0, key
    assert result["reps"] == 2 and result["micro_steps_per_rep"] == 16
