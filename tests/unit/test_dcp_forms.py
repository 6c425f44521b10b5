"""What an FSDP2 checkpoint holds, told from its DCP metadata's keys (``_dcp_forms``): the
optimizer state's two forms, a stage's part of a nested one, and another model's names as
one CheckpointError line. Keys only: no file, no process group."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradsync.backends import _dcp_forms
from gradsync.errors import CheckpointError

FOLDER = Path("ckpt/x/dcp_0")
NESTED = [
    "optim.state.0.weight.momentum_buffer",
    "optim.state.4.weight.momentum_buffer",
    "optim.param_groups.0.lr",
    "optim.param_groups.0.params",
    "optim.param_groups.1.lr",
    "optim.param_groups.1.params",
]
FLAT = ["optim.state.0.weight.momentum_buffer", "optim.param_groups.0.weight.lr"]


def test_the_form_is_told_by_the_groups_params_list():
    assert not _dcp_forms.is_flat(NESTED)
    assert _dcp_forms.is_flat(FLAT)
    assert not _dcp_forms.is_flat([])  # no folder


def test_a_stage_takes_its_own_state_and_its_groups_settings():
    """Stage 1 holds "4.weight", listed in the checkpoint's second group."""
    flat = {"state.4.weight.momentum_buffer": "mine", "param_groups.4.weight.lr": 0.5}
    request = _dcp_forms.nested_request(flat, NESTED)
    assert request == {
        "state.4.weight.momentum_buffer": "mine",
        "param_groups": [{"lr": None, "params": None}, {"lr": None, "params": None}],
    }
    read = {  # as the read fills it
        "state.4.weight.momentum_buffer": "saved",
        "param_groups": [{"lr": 0.1, "params": ["0.weight"]}, {"lr": 0.2, "params": ["4.weight"]}],
    }
    assert _dcp_forms.flattened(read, flat, FOLDER) == {
        "state.4.weight.momentum_buffer": "saved",
        "param_groups.4.weight.lr": 0.2,
    }
    read["param_groups"][1]["params"] = ["6.weight"]
    with pytest.raises(CheckpointError, match=r"no optimizer state for parameter '4.weight'"):
        _dcp_forms.flattened(read, flat, FOLDER)


@pytest.mark.parametrize(
    ("saved", "words"),
    [
        (["model.0.weight"], "missing ['4.weight'], unexpected [] (1 and 0 names)"),
        (["model.0.weight", "model.4.weight", "model.7.weight"], "unexpected ['7.weight']"),
    ],
)
def test_another_models_names_are_one_line(saved, words):
    """Checked against the whole model's names, so every stage of a pipeline says the same
    (stage 0, holding "0.weight", also sees "4.weight" missing)."""
    with pytest.raises(CheckpointError) as err:
        _dcp_forms.check_names(FOLDER, ["0.weight", "4.weight"], saved)
    text = str(err.value)
    assert "\n" not in text and words in text and repr(str(FOLDER)) in text


def test_the_same_model_and_a_missing_folder_pass():
    keys = ["model.0.weight", "model.4.weight", "optim.state.0.weight.momentum_buffer"]
    _dcp_forms.check_names(FOLDER, ["0.weight", "4.weight"], keys)
    _dcp_forms.check_names(FOLDER, ["0.weight"], [])  # the read says so
