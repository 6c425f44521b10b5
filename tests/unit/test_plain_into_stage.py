"""A plain-file optimizer state (``optimizer.state_dict()``: integer indices in the
optimizer's order) turned into a pipeline stage's flattened form, keyed by names
(``_plain_into_stage.stage_state``). Dictionaries only: no file, no process group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradsync.backends import _plain_into_stage
from gradsync.errors import CheckpointError

FILE = Path("ckpt/x/optimizer_0.pt")
#: The optimizer as given to prepare: two groups, the second listing "4.weight" first.
ORDER = [["0.weight", "0.bias"], ["4.weight", "4.bias"]]
SAVED = {
    "state": {i: {"momentum_buffer": torch.full((2,), float(i))} for i in (0, 1, 2)},
    "param_groups": [
        {"lr": 0.1, "momentum": 0.9, "params": [0, 1]},
        {"lr": 0.01, "momentum": 0.5, "params": [2, 3]},
    ],
}
#: Stage 1's flattened state dict as it is (its parameters "4.weight" and "4.bias").
STAGE = {
    "state.4.weight.momentum_buffer": torch.zeros(2),
    "state.4.bias.momentum_buffer": torch.zeros(2),
    "param_groups.4.weight.lr": 0.05,
    "param_groups.4.weight.momentum": 0.0,
    "param_groups.4.weight.nesterov": True,
    "param_groups.4.bias.lr": 0.05,
}


def test_a_stage_takes_its_parameters_state_by_the_given_order_and_their_groups_settings():
    out = _plain_into_stage.stage_state(SAVED, ORDER, STAGE, FILE)
    assert out["state.4.weight.momentum_buffer"].tolist() == [2.0, 2.0]  # index 2
    # no saved state (never stepped): as fresh
    assert out["state.4.bias.momentum_buffer"].tolist() == [0.0, 0.0]
    assert out["param_groups.4.weight.lr"] == 0.01 and out["param_groups.4.bias.lr"] == 0.01
    assert out["param_groups.4.weight.momentum"] == 0.5
    assert out["param_groups.4.weight.nesterov"] is True  # a setting newer than the file
    assert sorted(out) == sorted(STAGE)


def test_groups_of_other_sizes_are_one_line():
    saved = {**SAVED, "param_groups": [{"lr": 0.1, "params": [0, 1, 2, 3]}]}
    with pytest.raises(CheckpointError) as err:
        _plain_into_stage.stage_state(saved, ORDER, STAGE, FILE)
    assert str(err.value) == (
        "checkpoint file 'ckpt/x/optimizer_0.pt' does not fit the optimizer: parameter groups "
        "of sizes [4], the optimizer's are [2, 2] (another model or optimizer?)"
    )
    with pytest.raises(CheckpointError, match="sizes None"):
        _plain_into_stage.stage_state([1, 2], ORDER, STAGE, FILE)


def test_a_state_of_another_shape_is_one_line():
    saved = {**SAVED, "state": {2: {"momentum_buffer": torch.zeros(3)}}}
    with pytest.raises(
        CheckpointError, match=r"4.weight's momentum_buffer has shape \(3,\), here \(2,\)"
    ):
        _plain_into_stage.stage_state(saved, ORDER, STAGE, FILE)


def test_a_stage_parameter_the_optimizer_was_not_given_is_one_line():
    order = [["0.weight", "0.bias"], ["4.weight", None]]  # another model's parameter
    with pytest.raises(CheckpointError, match="no optimizer state for parameter '4.bias'"):
        _plain_into_stage.stage_state(SAVED, order, STAGE, FILE)
