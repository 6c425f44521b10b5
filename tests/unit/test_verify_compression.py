"""`gradsync verify`'s verdict for a run with ``comm_hook``, on recorded runs written here:
the tolerance the compression implies, the steps PowerSGD approximates (shown, not judged),
and the verdict's words. tests/multiprocess/test_verify.py runs the same on 2 gloo ranks."""

from __future__ import annotations

import json

import pytest
import torch

from gradsync.verify import compression as comm
from gradsync.verify.verdict import TOLERANCE, compare


def _record(folder, weights, losses=None, comm_meta=None, policy="defer", k=4):
    folder.mkdir()
    meta = {"world": 2, "param_names": [["w"]], "rows": [], "k": [k] * len(weights)}
    meta |= {"comm": comm_meta or {"hook": "no"}, "sync_policy": policy}
    for step, w in enumerate(weights):
        torch.save([{"w": torch.tensor([w])}], folder / f"params-{step}.pt")
        if step:
            loss = 1.0 if losses is None else losses[step - 1]
            meta["rows"].append({"step": step, "loss": loss, "lr": [0.1]})
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


REF = [1.0, 0.9, 0.8, 0.7]
#: 1e-3 relative at each step: beyond fp32's 1e-5, inside fp16's 2e-3, outside it at 5e-3
NEAR = [1.0, 0.9 * (1 + 1e-3), 0.8 * (1 + 1e-3), 0.7 * (1 + 1e-3)]
FAR = [1.0, 0.9 * (1 + 5e-3), 0.8 * (1 + 5e-3), 0.7 * (1 + 5e-3)]


def test_fp16_is_compared_at_its_rounding_and_says_so(tmp_path):
    ref = _record(tmp_path / "ref", REF)
    run = _record(tmp_path / "fp16", NEAR, comm_meta={"hook": "fp16"})
    report = compare(run, ref)
    assert report.exit_code == 0, report.render()
    assert report.tolerance == TOLERANCE["fp16"] and "comm_hook=fp16" in report.precision
    assert "with comm_hook='fp16'" in report.verdict and "--comm-hook no" in report.verdict
    (note,) = [n for n in report.notes if "comm_hook='fp16'" in n]
    assert "4.9e-04 per reduction" in note and "at 0.002 relative" in note
    plain = compare(_record(tmp_path / "no", NEAR), ref)  # the same run, uncompressed
    assert plain.exit_code == 1 and plain.tolerance == TOLERANCE["fp32"]
    far = compare(_record(tmp_path / "far", FAR, comm_meta={"hook": "fp16"}), ref)
    assert far.exit_code == 1 and "the compression's tolerance" in far.verdict
    assert "--comm-hook no for an exact check" in far.verdict


def test_bf16_and_a_bf16_wrapper_take_bf16s_tolerance():
    assert comm.precision({"comm": {"hook": "bf16"}}, "fp32") == "bf16"
    assert comm.precision({"comm": {"hook": "power_sgd", "wrapper": "bf16"}}, "fp32") == "bf16"
    assert comm.precision({"comm": {"hook": "fp16"}}, "bf16") == "bf16"  # the lower one
    assert comm.precision({"comm": {"hook": "no"}}, "fp32") == "fp32"


@pytest.mark.parametrize(("policy", "k", "first"), [("defer", 4, 3), ("every_step", 4, 1)])
def test_power_sgd_approximates_from_its_start_counted_per_reduction(policy, k, first):
    meta = {"comm": {"hook": "power_sgd", "options": {"start_powerSGD_iter": 2}}}
    assert comm.first_approximated({**meta, "sync_policy": policy, "k": [k]}) == first
    assert comm.first_approximated({"comm": {"hook": "power_sgd"}, "k": [4]}) == 1001


def test_power_sgd_steps_are_shown_not_judged(tmp_path):
    ref = _record(tmp_path / "ref", REF)
    options = {"start_powerSGD_iter": 2, "matrix_approximation_rank": 1}
    psgd = {"hook": "power_sgd", "options": options}
    apart = [1.0, 0.9, 0.8, 0.75]  # step 3 is PowerSGD's: far from one process
    report = compare(_record(tmp_path / "psgd", apart, comm_meta=psgd), ref)
    assert report.exit_code == 0, report.render()
    assert [s.judged for s in report.steps] == [True, True, False]
    rows = [line.split() for line in report.render().splitlines() if line[:4].strip().isdigit()]
    assert [row[-1] for row in rows] == ["ok", "ok", "approx."]
    assert "for 2 optimizer step(s)" in report.verdict and "step 3 is PowerSGD's" in report.verdict
    assert any(
        "from step 3 on each reduction is a low-rank approximation" in n for n in report.notes
    )
    nan = compare(_record(tmp_path / "nan", apart, [1.0, 1.0, float("nan")], psgd), ref)
    assert nan.exit_code == 1 and "not finite at step 3" in nan.verdict
    early = compare(_record(tmp_path / "early", FAR, comm_meta=psgd), ref)
    assert early.exit_code == 1 and "from step 1 on" in early.verdict
    every = {"hook": "power_sgd", "options": {"start_powerSGD_iter": 0}}
    none = compare(_record(tmp_path / "none", apart, comm_meta=every), ref)
    assert none.exit_code == 2 and "every compared step" in none.verdict
