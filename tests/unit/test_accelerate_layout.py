"""Accelerate's checkpoint layout in one process: ``gradsync.accelerate``'s ``save_state``
writes it beside gradsync's own files, its ``load_state`` resumes a folder that has only
Accelerate's files, and refuses, in one line and before anything is loaded, a tampered
pickle and a folder it cannot resume (another world size, another backend's layout, files
of a newer layout). Across processes and against Accelerate itself:
multiprocess/test_accelerate_checkpoints.py."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from gradsync import CheckpointError
from gradsync.accelerate import Accelerator

ACCELERATE_FILES = {
    "model.safetensors",
    "optimizer.bin",
    "scheduler.bin",
    "custom_checkpoint_0.pkl",
    "random_states_0.pkl",
}


class Counter:
    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = int(state["seen"])


def build(seed: int) -> tuple[Any, ...]:
    torch.manual_seed(seed)
    accel = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = DataLoader(torch.randn(8, 3), batch_size=2)
    counter = Counter()
    model, opt, loader, sched = accel.prepare(model, opt, loader, sched)
    accel.register_for_checkpointing(counter)
    return accel, model, opt, sched, loader, counter


def train(accel: Any, model: Any, opt: Any, sched: Any, loader: Any, counter: Any) -> None:
    for batch in loader:
        with accel.accumulate(model):
            accel.backward(model(batch).square().mean())
            opt.step()
            sched.step()
            opt.zero_grad()
        counter.seen += len(batch)


@pytest.fixture
def accelerate_folder(tmp_path: Path, clean_env: Any) -> tuple[Path, dict[str, Any]]:
    """A folder with only Accelerate's files, and what training had when it was saved."""
    accel, model, opt, sched, loader, counter = build(0)
    train(accel, model, opt, sched, loader, counter)
    path = Path(accel.save_state(tmp_path / "both"))
    assert ACCELERATE_FILES <= {p.name for p in path.iterdir()}
    only = tmp_path / "accelerate"
    only.mkdir()
    for name in ACCELERATE_FILES:
        shutil.copy(path / name, only / name)
    expected = {
        "weights": {k: v.clone() for k, v in accel.unwrap_model(model).state_dict().items()},
        "adam": opt.state_dict()["state"][0]["exp_avg"].clone(),
        "lr": sched.get_last_lr(),
        "seen": counter.seen,
        "rng": (torch.rand(3), random.random(), np.random.rand()),
    }
    return only, expected


def test_a_folder_with_only_accelerates_files_resumes(accelerate_folder, clean_env):
    folder, expected = accelerate_folder
    accel, model, opt, sched, _loader, counter = build(1)
    torch.manual_seed(123)  # another RNG than the saved one: the load puts it back
    accel.load_state(folder)
    weights = accel.unwrap_model(model).state_dict()
    assert all(torch.equal(v, weights[k]) for k, v in expected["weights"].items())
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], expected["adam"])
    assert sched.get_last_lr() == expected["lr"]
    assert counter.seen == expected["seen"] == 8
    rng = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(rng[0], expected["rng"][0]) and rng[1:] == expected["rng"][1:]


class Payload:
    """What a tampered pickle holds: unpickling it would create ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def test_a_tampered_pickle_is_refused_in_one_line_and_nothing_runs(
    accelerate_folder, tmp_path, clean_env
):
    folder, _expected = accelerate_folder
    ran = tmp_path / "ran"
    torch.save({"seen": Payload(ran)}, folder / "custom_checkpoint_0.pkl")
    accel, model, *_ = build(1)
    before = {k: v.clone() for k, v in accel.unwrap_model(model).state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        accel.load_state(folder)
    message = str(err.value)
    assert "\n" not in message
    assert "custom_checkpoint_0.pkl" in message and "system" in message
    assert "trusted=True" in message
    assert not ran.exists()
    after = accel.unwrap_model(model).state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())  # nothing was loaded


def test_a_plain_pickle_of_a_tampered_rng_file_is_refused(accelerate_folder, clean_env):
    folder, _expected = accelerate_folder
    (folder / "random_states_0.pkl").write_bytes(pickle.dumps(Payload(folder / "ran"), protocol=2))
    accel, *_ = build(1)
    with pytest.raises(CheckpointError, match=r"random_states_0\.pkl .*trusted=True"):
        accel.load_state(folder)
    assert not (folder / "ran").exists()


@pytest.mark.parametrize(
    "change, said",
    [
        ("random_states_1.pkl", r"saved by 2 process\(es\) .* has 1: resume it on 2 process"),
        ("pytorch_model_fsdp_0/", r"Accelerate's sharded FSDP layout \(pytorch_model_fsdp_0\)"),
        ("pytorch_model_fsdp.bin", r"Accelerate's full-state FSDP layout \(pytorch_model_fsdp"),
        ("pytorch_model/", r"Accelerate's DeepSpeed layout \(pytorch_model\) .*backend='single'"),
        ("dl_state_dict.bin", r"holds dl_state_dict\.bin .* newer Accelerate"),
        ("optimizer_3.bin", r"holds optimizer_3\.bin, which is not in the Accelerate 1\.x layout"),
        ("custom_checkpoint_1.pkl", r"objects 2 saved vs 1 here"),
    ],
)
def test_a_folder_gradsync_cannot_resume_is_one_line_saying_what_differs(
    accelerate_folder, change, said, clean_env
):
    folder, _expected = accelerate_folder
    if change.endswith("/"):
        (folder / change).mkdir()
    else:
        shutil.copy(folder / "random_states_0.pkl", folder / change)
    accel, model, *_ = build(1)
    before = {k: v.clone() for k, v in accel.unwrap_model(model).state_dict().items()}
    with pytest.raises(CheckpointError, match=said) as err:
        accel.load_state(folder)
    assert "\n" not in str(err.value)
    if change not in ("random_states_1.pkl", "custom_checkpoint_1.pkl"):  # they say it
        assert "gradsync.accelerate reads Accelerate's one-process and DDP layout" in str(err.value)
    after = accel.unwrap_model(model).state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())


def test_a_trusted_load_skips_the_scan(accelerate_folder, tmp_path, clean_env):
    folder, expected = accelerate_folder
    accel, _model, _opt, _sched, _loader, counter = build(1)
    accel.load_state(folder, trusted=True)
    assert counter.seen == expected["seen"]


def test_gradsyncs_own_files_win_in_a_folder_with_both(tmp_path, clean_env):
    accel, model, opt, sched, loader, _counter = build(0)
    it = iter(loader)
    for _ in range(3):  # mid-window, mid-epoch: only gradsync's files hold that
        with accel.accumulate(model):
            accel.backward(model(next(it)).square().mean())
            opt.step()
            sched.step()
            opt.zero_grad()
    path = accel.save_state(tmp_path / "both")
    again, *_ = build(1)
    again.load_state(path)
    assert again.step == accel.step == 1  # the open window came back


def test_gradsyncs_own_accelerator_loads_a_folder_with_both(tmp_path, clean_env):
    import gradsync

    accel, model, opt, sched, loader, counter = build(0)
    train(accel, model, opt, sched, loader, counter)
    path = accel.save_state(tmp_path / "both")  # holds random_states_0.pkl (numpy arrays)
    torch.manual_seed(0)
    core = gradsync.Accelerator(gradient_accumulation_steps=2)
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
    o2 = torch.optim.Adam(other.parameters(), lr=0.1)
    s2 = torch.optim.lr_scheduler.StepLR(o2, step_size=1, gamma=0.5)
    other, o2, _l2, s2 = core.prepare(other, o2, DataLoader(torch.randn(8, 3), batch_size=2), s2)
    core.register_for_checkpointing(Counter())
    core.load_state(path)
    mine = accel.unwrap_model(model).state_dict()
    assert all(torch.equal(v, mine[k]) for k, v in core.unwrap_model(other).state_dict().items())


def test_to_accelerate_converts_gradsyncs_own_format(accelerate_folder, tmp_path, clean_env):
    from gradsync.accelerate.convert import to_accelerate

    _only, expected = accelerate_folder
    both = tmp_path / "both"  # the fixture's save: gradsync's files are converted alone
    mine = tmp_path / "gradsync-only"
    mine.mkdir()
    for name in json.loads((both / "gradsync_checkpoint.json").read_text())["files"]:
        shutil.copy(both / name, mine / name)
    shutil.copy(both / "gradsync_checkpoint.json", mine / "gradsync_checkpoint.json")
    out = Path(to_accelerate(mine, tmp_path / "converted"))
    assert {p.name for p in out.iterdir()} == ACCELERATE_FILES
    accel, model, opt, sched, _loader, counter = build(1)
    torch.manual_seed(123)
    accel.load_state(out)
    weights = accel.unwrap_model(model).state_dict()
    assert all(torch.equal(v, weights[k]) for k, v in expected["weights"].items())
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], expected["adam"])
    assert sched.get_last_lr() == expected["lr"] and counter.seen == expected["seen"]
    rng = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(rng[0], expected["rng"][0]) and rng[1:] == expected["rng"][1:]
    with pytest.raises(CheckpointError, match="exists; name a new folder"):
        to_accelerate(mine, out)


def test_safe_serialization_false_writes_and_reads_pytorch_model_bin(tmp_path, clean_env):
    accel, model, opt, sched, loader, counter = build(0)
    train(accel, model, opt, sched, loader, counter)
    path = Path(accel.save_state(tmp_path / "both", safe_serialization=False))
    names = {p.name for p in path.iterdir()}
    assert "pytorch_model.bin" in names and "model.safetensors" not in names
    only = tmp_path / "accelerate"
    only.mkdir()
    for name in ACCELERATE_FILES - {"model.safetensors"} | {"pytorch_model.bin"}:
        shutil.copy(path / name, only / name)
    again, other, *_ = build(1)
    again.load_state(only)
    mine = accel.unwrap_model(model).state_dict()
    assert all(torch.equal(v, mine[k]) for k, v in again.unwrap_model(other).state_dict().items())


def test_two_models_and_optimizers_take_accelerates_numbered_names(tmp_path, clean_env):
    def two(seed: int) -> tuple[Any, ...]:
        torch.manual_seed(seed)
        accel = Accelerator(cpu=True)
        a, b = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
        oa = torch.optim.Adam(a.parameters(), lr=0.1)
        ob = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
        return (accel, *accel.prepare(a, b, oa, ob))

    accel, a, b, oa, ob = two(0)
    with accel.accumulate(a, b):
        accel.backward(b(a(torch.randn(4, 3))).square().mean())
        oa.step()
        ob.step()
    path = Path(accel.save_state(tmp_path / "both"))
    names = {"model.safetensors", "model_1.safetensors", "optimizer.bin", "optimizer_1.bin"}
    assert names <= {p.name for p in path.iterdir()}
    only = tmp_path / "accelerate"
    only.mkdir()
    for name in names | {"random_states_0.pkl"}:
        shutil.copy(path / name, only / name)
    again, a2, b2, oa2, ob2 = two(1)
    again.load_state(only)
    for mine, theirs in ((a, a2), (b, b2)):
        assert all(torch.equal(x, y) for x, y in zip(mine.parameters(), theirs.parameters()))
    assert torch.equal(
        ob2.state_dict()["state"][0]["momentum_buffer"],
        ob.state_dict()["state"][0]["momentum_buffer"],
    )
    assert oa2.state_dict()["state"][0]["step"] == oa.state_dict()["state"][0]["step"]


# -- FSDP2's FULL_STATE_DICT layout, in one gloo process ------------------------------------
FULL_FILES = {
    "pytorch_model_fsdp.bin",
    "optimizer.bin",
    "scheduler.bin",
    "custom_checkpoint_0.pkl",
    "random_states_0.pkl",
}


def build_fsdp(seed: int, tmp_path: Path) -> tuple[Any, ...]:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    torch.manual_seed(seed)
    accel = Accelerator(
        gradient_accumulation_steps=2,
        cpu=True,
        backend="fsdp",
        fsdp_state_dict_type="FULL_STATE_DICT",
    )
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = DataLoader(torch.randn(8, 3), batch_size=2)
    counter = Counter()
    model, opt, loader, sched = accel.prepare(model, opt, loader, sched)
    accel.register_for_checkpointing(counter)
    return accel, model, opt, sched, loader, counter


def full_weights(accel: Any, model: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in accel.get_state_dict(model).items()}


@pytest.fixture
def full_state_folder(tmp_path: Path, clean_env: Any) -> tuple[Path, dict[str, torch.Tensor]]:
    """Accelerate's FULL_STATE_DICT files alone, as gradsync.accelerate wrote them on FSDP2."""
    parts = build_fsdp(0, tmp_path)
    train(*parts)
    accel, model = parts[0], parts[1]
    path = Path(accel.save_state(tmp_path / "both"))
    assert FULL_FILES <= {p.name for p in path.iterdir()}
    assert not (path / "pytorch_model_fsdp_0").exists()  # not the sharded layout
    only = tmp_path / "accelerate"
    only.mkdir()
    for name in FULL_FILES:
        shutil.copy(path / name, only / name)
    return only, full_weights(accel, model)


def test_fsdp_full_state_files_resume(full_state_folder, tmp_path, clean_env):
    folder, saved = full_state_folder
    accel, model, opt, _sched, _loader, counter = build_fsdp(1, tmp_path)
    assert any(not torch.equal(v, full_weights(accel, model)[k]) for k, v in saved.items())
    accel.load_state(folder)
    now = full_weights(accel, model)
    assert all(torch.equal(v, now[k]) for k, v in saved.items())
    assert counter.seen == 8
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    saved_optim = torch.load(folder / "optimizer.bin", weights_only=True)
    assert sorted(saved_optim["state"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    full = StateDictOptions(full_state_dict=True)
    loaded = get_optimizer_state_dict(accel.unwrap_model(model), opt.optimizer, options=full)
    for name, moments in saved_optim["state"].items():
        for key, value in moments.items():
            assert torch.equal(loaded["state"][name][key], value), (name, key)


@pytest.mark.parametrize("name", ["pytorch_model_fsdp.bin", "optimizer.bin"])
def test_a_tampered_fsdp_full_state_file_is_refused_in_one_line_and_nothing_runs(
    full_state_folder, name, tmp_path, clean_env
):
    folder, _saved = full_state_folder
    ran = tmp_path / "ran"
    state = torch.load(folder / name, weights_only=True)
    state["extra"] = Payload(ran)
    torch.save(state, folder / name)
    accel, model, *_ = build_fsdp(1, tmp_path)
    before = full_weights(accel, model)
    with pytest.raises(CheckpointError) as err:
        accel.load_state(folder)
    message = str(err.value)
    assert "\n" not in message
    assert name in message and "system" in message and "trusted=True" in message
    assert not ran.exists()
    after = full_weights(accel, model)
    assert all(torch.equal(v, after[k]) for k, v in before.items())  # nothing was loaded


def test_a_fsdp_full_state_file_of_another_model_is_one_line(
    full_state_folder, tmp_path, clean_env
):
    folder, _saved = full_state_folder
    state = torch.load(folder / "pytorch_model_fsdp.bin", weights_only=True)
    state["0.weight"] = torch.zeros(5, 3)  # a wider first layer
    torch.save(state, folder / "pytorch_model_fsdp.bin")
    accel, model, *_ = build_fsdp(1, tmp_path)
    before = full_weights(accel, model)
    with pytest.raises(CheckpointError) as err:
        accel.load_state(folder)
    message = str(err.value)
    assert "\n" not in message
    assert "pytorch_model_fsdp.bin' does not fit the model" in message, message
    assert "0.weight (5, 3) vs (4, 3) here" in message
    after = full_weights(accel, model)
    assert all(torch.equal(v, after[k]) for k, v in before.items())  # nothing was loaded
