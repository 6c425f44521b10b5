"""The supported torch range, declared once (``gradsync._support.torch_range``), and what gradsync does
outside it: a torch below it refuses at ``Accelerator(...)``; a torch above it warns once at
prepare and, for FSDP2, checks the private state gradsync relies on (the canary) and refuses
what does not hold."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from gradsync._support import torch_range as _torch_range
from gradsync.backends import _fsdp_canary, _fsdp_compat

ROOT = Path(__file__).resolve().parents[2]


def test_versions_parse_to_their_minor():
    assert _torch_range.minor("2.15.0+cu132") == (2, 15)
    assert _torch_range.minor("2.16.0.dev20261201") == (2, 16)
    assert _torch_range.below("2.4.1") and not _torch_range.below(_torch_range.OLDEST_PIN)
    assert _torch_range.above("3.0.0") and not _torch_range.above(_torch_range.NEWEST_PIN)
    assert _torch_range.minor(_torch_range.OLDEST_PIN) == _torch_range.minor(_torch_range.OLDEST)
    assert _torch_range.minor(_torch_range.NEWEST_PIN) == _torch_range.minor(_torch_range.NEWEST)
    with pytest.raises(ValueError, match="not a torch version"):
        _torch_range.minor("nightly")


def test_pyproject_requires_the_oldest_supported_torch():
    """pyproject.toml's requirement is written from the one declaration
    (``python scripts/torch_range.py --write``); the script's check fails while they differ."""
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={_torch_range.OLDEST}"' in text
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "torch_range.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_installed_torch_is_in_the_range():
    assert not _torch_range.below(torch.__version__)


def test_a_torch_below_the_range_refuses_the_accelerator_in_one_line(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.4.1")
    monkeypatch.delitem(vars(gradsync), "Accelerator", raising=False)
    with pytest.raises(gradsync.UsageError) as err:
        gradsync.Accelerator(backend="single")
    message = str(err.value)
    assert "\n" not in message
    assert "torch 2.4.1 is installed" in message
    assert f"supports {_torch_range.supported()}" in message


def test_a_torch_above_the_range_warns_once_at_prepare(monkeypatch, clean_env):
    monkeypatch.setattr(_torch_range, "NEWEST", "2.0")
    accel = gradsync.Accelerator(backend="single")
    with pytest.warns(UserWarning, match=rf"torch {re.escape(torch.__version__)} is newer"):
        accel.prepare(torch.nn.Linear(2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accel.prepare(torch.nn.Linear(2, 2))


def _mesh(tmp_path, shape):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    names = ("replicate", "shard") if len(shape) == 2 else None
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


@pytest.mark.parametrize("shape", [(1,), (1, 1)])
def test_the_canary_holds_on_this_torch_and_draws_no_random_numbers(tmp_path, shape):
    mesh = _mesh(tmp_path, shape)
    state = torch.get_rng_state()
    assert _fsdp_canary.check(mesh, torch.device("cpu")) == []
    assert torch.equal(torch.get_rng_state(), state)


def test_the_canary_names_what_does_not_hold(tmp_path, monkeypatch):
    mesh = _mesh(tmp_path, (1, 1))
    monkeypatch.setattr(_fsdp_compat, "put_window_grads", lambda *args: None)
    assert _fsdp_canary.check(mesh, torch.device("cpu")) == [_fsdp_canary.WINDOW_GRADS]
    monkeypatch.undo()
    monkeypatch.setattr(_fsdp_compat, "put_partial_buffers", lambda *args: None)
    assert _fsdp_canary.check(mesh, torch.device("cpu")) == [_fsdp_canary.PARTIAL_BUFFERS]


def test_the_canary_runs_only_above_the_tested_range(tmp_path, monkeypatch):
    mesh = _mesh(tmp_path, (1,))
    canary = _fsdp_canary.Canary()
    canary.run(mesh, torch.device("cpu"))
    assert canary.failed is None
    monkeypatch.setattr(_torch_range, "NEWEST", "2.0")
    canary.run(mesh, torch.device("cpu"))
    assert canary.failed == []
    canary.refuse("a mid-window save", partial=True)  # nothing failed: nothing refused


def _one_rank_fsdp(tmp_path: Path) -> tuple[Any, Any, Any, Any]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    accel = gradsync.Accelerator(backend="fsdp", sync_policy="defer", gradient_accumulation_steps=2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    with pytest.warns(UserWarning, match="newer than the releases gradsync was tested on"):
        model, opt, loader = accel.prepare(model, opt, DataLoader(data, batch_size=2))
    return accel, model, opt, loader


def test_a_failed_canary_refuses_mid_window_saves_and_dropped_windows_on_fsdp(
    tmp_path, monkeypatch, clean_env
):
    """End to end on a one-rank FSDP2 Accelerator: the untested torch warns at prepare, which
    runs no check; the first save inside a window runs it, finds the broken field, and that
    save and a later dropped window are refused in one line; a save at a boundary still works."""
    monkeypatch.setattr(_torch_range, "NEWEST", "2.0")
    monkeypatch.setattr(_fsdp_compat, "put_window_grads", lambda *args: None)
    accel, model, _opt, loader = _one_rank_fsdp(tmp_path)
    assert accel._backend._canary.failed is None  # nothing checked at prepare
    batches = iter(loader)
    x, y = next(batches)
    with accel.accumulate(model):
        accel.backward(torch.nn.functional.mse_loss(model(x), y))
    with (
        pytest.warns(UserWarning, match="unsharded gradients of a deferred window"),
        pytest.raises(RuntimeError, match=r"a mid-window save is not available on torch") as err,
    ):
        accel.save_state(str(tmp_path / "ckpt"))
    assert "\n" not in str(err.value)
    with pytest.raises(RuntimeError, match=r"^dropping a window is not available on torch"):
        with accel.accumulate(model):
            raise ValueError("the user's block failed")
    for x, y in batches:  # a window that closes saves as usual
        with accel.accumulate(model):
            accel.backward(torch.nn.functional.mse_loss(model(x), y))
        if accel.sync_gradients:
            accel.save_state(str(tmp_path / "boundary"))
            break
    assert (tmp_path / "boundary" / "gradsync_checkpoint.json").exists()


def test_a_drop_before_any_check_is_refused_when_it_leaves_gradients(
    tmp_path, monkeypatch, clean_env
):
    """A window dropped before any check ran (a drop need not be on every rank at once, so it
    runs no collective): what gradsync cleared must read as empty on the untested torch."""
    monkeypatch.setattr(_torch_range, "NEWEST", "2.0")
    accel, model, _opt, loader = _one_rank_fsdp(tmp_path)
    x, y = next(iter(loader))
    with pytest.raises(ValueError, match="the block failed"):  # clearing works: dropped
        with accel.accumulate(model):
            accel.backward(torch.nn.functional.mse_loss(model(x), y))
            raise ValueError("the block failed")
    for clearing in ("reset_iter_state", "clear_unsharded_grads", "reshard"):  # none clears
        monkeypatch.setattr(_fsdp_compat, clearing, lambda model: None)
    with pytest.raises(RuntimeError, match=r"^dropping a window is not available on torch"):
        with accel.accumulate(model):
            accel.backward(torch.nn.functional.mse_loss(model(x), y))
            raise ValueError("the block failed")
    assert accel._backend._canary.failed is None
