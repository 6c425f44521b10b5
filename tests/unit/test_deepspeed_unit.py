"""DeepSpeed in this process, without a process group: its config (batch sizes, files), the
policy decision where it cannot coalesce, a missing install, and the parent-side check of one
gradient reduction (the runs on a 2-rank group: multiprocess/test_deepspeed.py)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from gradsync import Accelerator, ConfigError
from gradsync.backends._deepspeed_config import fill_batch, load_ds_config

from harness.checks import assert_one_gradient_reduction


@pytest.mark.parametrize(
    ("ops", "ok"),
    [
        ([("allreduce", 2820), ("allreduce", 4), ("allgather", 2820)], True),
        ([("allreduce", 2820), ("allreduce", 2820)], False),  # two full reductions
        (
            [("reduce_scatter", 1410), ("reduce_scatter", 1410)],
            False,
        ),  # the gradients in two halves
        ([("allreduce", 4)], False),  # no gradient reduction
    ],
)
def test_one_gradient_reduction_check_rejects_two(ops, ok):
    if ok:
        assert_one_gradient_reduction(ops, 2820)
    else:
        with pytest.raises(AssertionError):
            assert_one_gradient_reduction(ops, 2820)


class BF16_Optimizer:  # named as DeepSpeed's wrapper, which cannot coalesce
    pass


@pytest.mark.parametrize("stage", [2, 3])
def test_auto_stays_native_where_deepspeed_cannot_coalesce(stage):
    """An optimizer wrapper without DeepSpeed's coalescing hook: native, and the reason names
    it (decided before any collective, so no process group is needed)."""
    from gradsync.backends import _deepspeed_policy

    class Engine:
        optimizer = BF16_Optimizer()

        def coalesce_grad_reduction(self):  # pragma: no cover - never entered
            raise NotImplementedError

    policy, reason, _ = _deepspeed_policy.decide(
        Engine(), stage, (None, "sync_memory_budget"), torch.device("cpu"), "0.19.8"
    )
    assert policy == "native"
    assert reason.startswith(f"auto -> native: ZeRO {stage} reduces on every micro-step")
    assert "deepspeed 0.19.8 cannot coalesce the reduction for its BF16_Optimizer" in reason


# -- in-process, no group -----------------------------------------------------------------
def test_fill_batch_fills_absent_and_auto():
    ds = fill_batch({"gradient_accumulation_steps": "auto"}, micro=2, steps=4, world=2)
    assert ds == {
        "gradient_accumulation_steps": 4,
        "train_micro_batch_size_per_gpu": 2,
        "train_batch_size": 16,
    }


@pytest.mark.parametrize(
    ("key", "value", "ours"),
    [
        ("gradient_accumulation_steps", 8, 4),
        ("train_batch_size", 32, 16),
        ("train_micro_batch_size_per_gpu", 4, 2),
    ],
)
def test_fill_batch_names_both_values(key, value, ours):
    with pytest.raises(ConfigError) as err:
        fill_batch({key: value}, micro=2, steps=4, world=2)
    assert f"{key}={value}" in str(err.value) and f"{key}={ours}" in str(err.value)


def test_fill_batch_needs_the_micro_batch():
    with pytest.raises(ConfigError, match="micro_batch_size"):
        fill_batch({}, micro=None, steps=4, world=2)


def test_config_from_dict_path_and_json(tmp_path):
    cfg = {"zero_optimization": {"stage": 2}}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    (tmp_path / "ds.yaml").write_text("zero_optimization:\n  stage: 2\n")
    assert load_ds_config(cfg) == cfg
    assert load_ds_config(str(tmp_path / "ds.json")) == cfg
    assert load_ds_config(tmp_path / "ds.json") == cfg
    assert load_ds_config(str(tmp_path / "ds.yaml")) == cfg
    assert load_ds_config(json.dumps(cfg)) == cfg
    with pytest.raises(ConfigError, match="neither an existing file nor JSON"):
        load_ds_config("nope.json")


def test_missing_deepspeed_says_how_to_install(monkeypatch, clean_env):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    with pytest.raises(ImportError) as err:
        Accelerator(backend="deepspeed")
    message = str(err.value)
    assert "\n" not in message
    assert "pip install 'gradsync[deepspeed]'" in message
