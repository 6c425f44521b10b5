"""gradsync verify's pieces without a process: the replay order, the forced settings, the
difference measure, the refusals before anything starts."""

from __future__ import annotations

import json

import pytest
import torch

from gradsync.config import load_config
from gradsync.errors import ConfigError
from gradsync.verify.recorder import ReplayExhausted, ReplayLoader
from gradsync.verify.runner import verify
from gradsync.verify.verdict import compare, param_difference


def _pass(rank, n, exhausted=True):
    return {"batches": [f"r{rank}b{i}" for i in range(n)], "exhausted": exhausted, "len": n}


def test_the_reference_replays_position_by_position_then_rank_by_rank():
    loader = ReplayLoader(object(), [[_pass(0, 3), _pass(1, 3)], [_pass(0, 2), _pass(1, 2)]], 0)
    assert len(loader) == 6
    assert list(loader) == ["r0b0", "r1b0", "r0b1", "r1b1", "r0b2", "r1b2"]
    assert list(loader) == ["r0b0", "r1b0", "r0b1", "r1b1"]
    with pytest.raises(ReplayExhausted, match="never started"):
        list(loader)


def test_a_pass_the_launched_run_broke_off_fails_only_where_it_was_not_read():
    it = iter(ReplayLoader(object(), [[_pass(0, 1, False), _pass(1, 1, False)]], 0))
    assert [next(it), next(it)] == ["r0b0", "r1b0"]
    with pytest.raises(ReplayExhausted, match="never read"):
        next(it)


def test_verification_settings_win_over_keywords(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"world": 4, "k": [2, 3]}))
    # gradsync verify names its recorder as the run's extension (GRADSYNC_EXTENSIONS)
    ext = {"GRADSYNC_EXTENSIONS": "gradsync.verify.recorder"}
    env = {"GRADSYNC_VERIFY": str(tmp_path / "ref"), "GRADSYNC_VERIFY_REPLAY": str(tmp_path), **ext}
    config = load_config(environ=env, backend="ddp", gradient_accumulation_steps=5, audit=True)
    assert config.backend == "single" and config.audit is False
    k = config.gradient_accumulation_steps
    assert [k(0), k(1), k(7)] == [8, 12, 12]
    launched = load_config(
        environ={"GRADSYNC_VERIFY": str(tmp_path), **ext}, track_window_loss=False
    )
    assert launched.audit is True and launched.track_window_loss is True


def test_the_relative_difference_is_norm_wise_over_the_model():
    a = {"w": torch.ones(100), "b": torch.zeros(4)}
    b = {"w": torch.ones(100), "b": torch.full((4,), 1e-6)}  # a bias moved by roundoff noise
    max_abs, rel, worst = param_difference([a], [b], [["w", "b"]])
    assert max_abs == pytest.approx(1e-6) and rel == pytest.approx(2e-7, rel=1e-3)
    assert worst == "b"
    _, rel, _ = param_difference([{"w": 2 * torch.ones(100)}], [{"w": torch.ones(100)}], [["w"]])
    assert rel == pytest.approx(1.0)


def test_verify_refuses_before_starting_anything(tmp_path):
    with pytest.raises(ConfigError, match="--steps"):
        verify("examples/train.py", steps=0)
    with pytest.raises(ConfigError, match="no-python"):
        verify("examples/train.py", launch={"no_python": True})
    with pytest.raises(ConfigError, match="does not exist"):
        verify(str(tmp_path / "missing.py"))


def _record(folder, rows, rules=None, world=2):
    folder.mkdir()
    meta = {"world": world, "rules": rules, "param_names": [["w"]], "rows": []}
    for step, (w, lr) in enumerate(rows):
        torch.save([{"w": torch.tensor([w])}], folder / f"params-{step}.pt")
        if step:
            meta["rows"].append({"step": step, "loss": 1.0, "lr": [lr]})
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.mark.parametrize("name", ["accelerate", "gradsync"])
def test_a_learning_rate_that_parts_first_is_named_as_the_schedule_rule(tmp_path, name):
    rules = {"name": name, "scheduler_steps": 2 if name == "accelerate" else 1}
    launched = _record(tmp_path / "run", [(1.0, 0), (0.9, 0.1), (0.8, 0.1)], rules)
    reference = _record(tmp_path / "ref", [(1.0, 0), (0.9, 0.05), (0.85, 0.05)])
    report = compare(launched, reference)
    assert report.exit_code == 1
    assert "from step 2 on because the learning rate differs after step 1" in report.verdict
    assert "(0.1 launched, 0.05 in one process)" in report.verdict
    said = "steps 2 times per optimizer step" if name == "accelerate" else "once per optimizer"
    assert said in report.verdict and "depends on the rank" not in report.verdict


def test_parameters_that_part_under_one_learning_rate_point_at_the_synchronisation(tmp_path):
    launched = _record(tmp_path / "run", [(1.0, 0), (0.9, 0.1), (0.8, 0.1)])
    reference = _record(tmp_path / "ref", [(1.0, 0), (0.9, 0.1), (0.85, 0.1)])
    report = compare(launched, reference)
    assert report.exit_code == 1 and "depends on the rank" in report.verdict
