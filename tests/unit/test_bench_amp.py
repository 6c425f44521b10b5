"""The fp16 / compile / checkpointing benchmark's report, from rank results of known shape
(the 2-rank run itself is `python benchmarks/amp_compile.py --quick`, see docs/amp.md).
No timing is asserted."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "amp_compile.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("amp_compile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_pairs_repetitions_and_takes_the_slower_rank(bench):
    spec = {**bench.QUICK, "steps_per_rep": 2}
    fast, slow = [0.010, 0.010, 0.020, 0.020], [0.011, 0.011, 0.022, 0.022]
    rank = {
        "spec": spec,
        "device": "cpu",
        "torch": "x",
        "fp16": {"gradsync": slow, "by_hand": fast},
        "compile": {"gradsync": fast, "by_hand": fast},
    }
    other = {**rank, "fp16": {"gradsync": slow, "by_hand": [0.012, 0.012, 0.020, 0.020]}}
    memory = {"plain": {"saved_bytes": 1000}, "checkpointed": {"saved_bytes": 250}}
    summary, table = bench.report(
        [{**rank, "memory": memory}, other], "python benchmarks/amp_compile.py"
    )
    fp16 = summary["rows"]["fp16"]
    # per step, the slower rank: by hand 12, 12, 20, 20 ms; gradsync 11, 11, 22, 22 ms
    assert fp16["ratio_range"] == pytest.approx([11 / 12, 1.1])
    assert fp16["ratio"] == pytest.approx((11 / 12 + 1.1) / 2)
    assert summary["rows"]["compile"]["ratio"] == 1.0 and summary["rows"]["compile"]["met"]
    assert "| bytes saved for backward | 1000 | 250 | 0.250 |" in table
    assert summary["command"] == "python benchmarks/amp_compile.py"


def test_the_benchmark_model_is_the_one_checkpointed(bench):
    model = bench._model(bench.QUICK)
    assert [type(m).__name__ for m in model.blocks] == ["Block"] * bench.QUICK["depth"]
