"""Saving the way Accelerate scripts save, on 2 real ranks with a Transformers GPT-2:
``unwrap_model(model).save_pretrained(dir, is_main_process=..., save_function=accel.save)``
with or without a state dict, and ``save_model``, each loaded back with ``from_pretrained``
equal to the full parameters gathered from the run, on FSDP2 (a sharded model) and on DDP.
On rank 0 alone, FSDP2's ``save_pretrained`` fails in one line naming ``accel.save_model``
(the weights live on every rank) instead of hanging."""

from __future__ import annotations

import pytest

from harness import Scenario, Shared
from scenarios import saving

pytest.importorskip("transformers")

BACKENDS = ("fsdp", "ddp")
SPELLINGS = ("plain", "get_state_dict", "own_state_dict", "save_model")


SHARED = Shared("gloo2", {b: Scenario(saving.pretrained_saves, backend=b) for b in BACKENDS})


@pytest.fixture(scope="module")
def results(shared):
    return shared(SHARED)


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_spelling_writes_what_from_pretrained_loads_as_the_trained_parameters(
    results, backend, spelling
):
    main, other = results[backend]
    assert main[spelling]["error"] is None and other[spelling]["error"] is None
    saved = main[spelling]
    assert "model.safetensors" in saved["files"] and "config.json" in saved["files"]
    assert saved["missing"] == [] and saved["differ"] == []
    assert saved["trained"]


def test_fsdp_save_pretrained_on_rank_0_alone_fails_in_one_line_naming_save_model(results):
    main_only = results["fsdp"][0]["main_only"]
    assert main_only["error"] is not None
    assert main_only["error"].startswith("UsageError: ") and "\n" not in main_only["error"]
    assert "accel.save_model" in main_only["error"] and "every rank" in main_only["error"]
    assert main_only["seconds"] < 30  # the arrival timeout, not a hang in the gather


def test_ddp_save_pretrained_on_rank_0_alone_works(results):
    main_only = results["ddp"][0]["main_only"]
    assert main_only["error"] is None and main_only["differ"] == [] and main_only["missing"] == []
