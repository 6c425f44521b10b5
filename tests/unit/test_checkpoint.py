"""Checkpoints in this process: atomic writes, the latest checkpoint, keep_last, bad input,
SIGTERM, background commits, save_model, loader epochs (the ones that resume, or die, in a
fresh process: multiprocess/test_checkpoint_processes.py)."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import gradsync
from gradsync import Accelerator, CheckpointError, ConfigError
from gradsync.checkpoint import MANIFEST

from scenarios.checkpoints import fresh, trained
from scenarios.common import Indexed, make_model, make_optimizer


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def saved(tmp_path, clean_env):
    accel, _model, *_ = trained()
    path = accel.save_state(tmp_path / "ckpts" / "a")
    return Path(path)


def test_load_restores_the_weights_optimizer_scheduler_and_window(saved, clean_env):
    _accel, model, opt, _sched, _loader = trained()
    a2, m2, o2, s2, l2 = fresh()
    a2.load_state(saved)
    assert all(torch.equal(v, m2.state_dict()[k]) for k, v in model.state_dict().items())
    assert a2.optimizer_steps == 1 and s2.last_epoch == 1
    assert a2._window.index == 2  # 6 micro-steps, k=4: the 2nd window is half done
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(torch.equal(p.grad, grads[n]) for n, p in m2.named_parameters())
    assert l2.epoch == 0 and l2.state_dict()["epoch"] == 0
    assert torch.equal(
        o2.state_dict()["state"][0]["momentum_buffer"],
        opt.state_dict()["state"][0]["momentum_buffer"],
    )


def test_the_scheduler_does_not_step_again_after_a_load(saved, clean_env):
    a2, _m2, _o2, s2, _l2 = fresh()
    a2.load_state(saved)
    s2.step()  # no optimizer step since the load: nothing to do
    assert s2.last_epoch == 1


def corrupt(folder: Path, name: str, how: str) -> Path:
    file = folder / name
    data = bytearray(file.read_bytes())
    if how == "truncate":
        file.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 2] ^= 0xFF
        file.write_bytes(bytes(data))
    return file


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p.parent / "nope", "checkpoint '{p}/../nope' does not exist"),
        (
            lambda p: (p / MANIFEST).unlink() or p,
            "'{p}' is not a gradsync checkpoint (no gradsync_checkpoint.json",
        ),
        (
            lambda p: corrupt(p, "model_0.pt", "truncate") and p,
            "checkpoint '{p}' is corrupted: model_0.pt has",
        ),
        (
            lambda p: corrupt(p, "optimizer_0.pt", "flip") and p,
            "checkpoint '{p}' is corrupted: optimizer_0.pt fails its checksum",
        ),
        (
            lambda p: (p / "rng_rank0.pt").unlink() or p,
            "checkpoint '{p}' is incomplete: rng_rank0.pt is missing",
        ),
        (
            lambda p: (p / "x.txt").write_text("x") and p / "x.txt",
            "checkpoint '{p}/x.txt' is a file",
        ),
    ],
    ids=["missing", "not-a-checkpoint", "truncated", "corrupted", "incomplete", "a-file"],
)
def test_a_bad_checkpoint_is_one_line_and_loads_nothing(saved, clean_env, damage, message):
    target = damage(saved)
    a2, m2, o2, _s2, _l2 = fresh()
    before, opt_before = params(m2), o2.state_dict()
    with pytest.raises(CheckpointError) as err:
        a2.load_state(target)
    text = str(err.value)
    expected = message.format(p=saved).replace(f"{saved}/../nope", str(saved.parent / "nope"))
    assert expected in text and "\n" not in text, text
    assert all(torch.equal(v, m2.state_dict()[k]) for k, v in before.items())
    assert o2.state_dict() == opt_before and a2.optimizer_steps == 0 and a2._window.index == 0


def edit_manifest(folder: Path, **changes: object) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    for key, value in changes.items():
        if key == "index":
            manifest["window"]["index"] = value
        else:
            manifest[key] = value
    (folder / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"backend": "deepspeed", "format": "deepspeed"},
            "was saved with backend='deepspeed', whose format backend='single' cannot read; load it with backend='deepspeed'",
        ),
        (
            {"world_size": 2},
            "was saved mid-window on 2 rank(s); its per-rank window gradients cannot be resumed on 1",
        ),
        ({"models": 2}, "does not fit this training: models 2 saved vs 1 here"),
    ],
    ids=["other-backend", "other-world-mid-window", "other-objects"],
)
def test_an_incompatible_checkpoint_is_refused_before_loading(saved, clean_env, changes, message):
    edit_manifest(saved, **changes)
    a2, m2, *_ = fresh()
    before = params(m2)
    with pytest.raises(CheckpointError, match="checkpoint '.*'") as err:
        a2.load_state(saved)
    assert message in str(err.value) and str(saved) in str(err.value)
    assert all(torch.equal(v, m2.state_dict()[k]) for k, v in before.items())


def test_a_checkpoint_of_another_model_is_refused_before_loading(saved, clean_env):
    accel = Accelerator(backend="single", gradient_accumulation_steps=4)
    other = torch.nn.Linear(8, 1)
    model, _opt = accel.prepare(other, torch.optim.SGD(other.parameters(), lr=0.1))
    before = params(model)
    edit_manifest(saved, schedulers=0, loaders=[])
    with pytest.raises(CheckpointError, match="model_0.pt' does not fit the model: missing"):
        accel.load_state(saved)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("keep_last", [0, -1, True, 1.5])
def test_keep_last_below_one_is_a_config_error(tmp_path, clean_env, keep_last):
    accel, *_ = trained(micro=1)
    with pytest.raises(
        ConfigError, match=rf"save_state\(keep_last={keep_last!r}\) must be a whole number >= 1"
    ):
        accel.save_state(tmp_path / "c", keep_last=keep_last)
    assert not list(tmp_path.iterdir())


def test_a_path_that_is_a_file_or_a_foreign_folder_is_a_config_error(tmp_path, clean_env):
    accel, *_ = trained(micro=1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(
        ConfigError, match="that path is an existing file; a checkpoint is a folder"
    ):
        accel.save_state(tmp_path / "file")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="holds files that are not a gradsync checkpoint"):
        accel.save_state(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "x"


def test_keep_last_deletes_only_older_complete_gradsync_checkpoints(tmp_path, clean_env):
    accel, model, opt, _sched, loader = trained(micro=0)
    (tmp_path / "notes").mkdir()  # not a checkpoint
    (tmp_path / ".old.gradsync-tmp").mkdir()  # an interrupted save: left alone
    it = iter(loader)
    for step in range(4):
        for _ in range(4):
            x, y, _ = next(it)
            with accel.accumulate(model):
                accel.backward(F.mse_loss(model(x), y))
                opt.step()
        accel.save_state(tmp_path / f"s{step}", keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".old.gradsync-tmp", "notes", "s2", "s3"]


def test_latest_is_the_most_optimizer_steps_and_skips_incomplete_ones(tmp_path, clean_env):
    assert gradsync.latest_checkpoint(tmp_path / "none") is None
    assert gradsync.latest_checkpoint(tmp_path) is None
    accel, _model, _opt, *_ = trained(micro=8)  # 2 steps
    accel.save_state(tmp_path / "zz-early")
    accel, *_ = trained(micro=12)  # 3 steps, saved later under a name that sorts first
    accel.save_state(tmp_path / "aa-late")
    assert gradsync.latest_checkpoint(tmp_path) == str(tmp_path / "aa-late")
    accel.save_state(tmp_path / "aa-late")  # saving over a checkpoint replaces it
    (tmp_path / "aa-late" / MANIFEST).unlink()  # as if that save never finished
    assert gradsync.latest_checkpoint(tmp_path) == str(tmp_path / "zz-early")


# -- background commits ------------------------------------------------------------
class Gate:
    """Holds rank 0's background commits (before their marker and rename) until opened;
    blocking saves, committed in the main thread, pass."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def open(self, after: float = 0.0) -> None:
        threading.Timer(after, self.event.set).start()


@pytest.fixture
def gate(monkeypatch):
    import gradsync.storage.commit as ck

    real, held = ck.mark_and_rename, Gate()

    def gated(*args: object) -> None:
        if threading.current_thread() is not threading.main_thread():
            assert held.event.wait(300), "the gate was never opened"
        real(*args)

    monkeypatch.setattr(ck, "mark_and_rename", gated)
    yield held
    held.event.set()


def test_a_background_save_commits_while_training_goes_on(tmp_path, clean_env, gate):
    accel, model, opt, _sched, loader = trained(micro=6)
    before = params(model)
    path = accel.save_state(tmp_path / "bg", background=True)
    assert not (tmp_path / "bg").exists()  # not committed: the thread waits at the gate
    assert gradsync.latest_checkpoint(tmp_path) is None
    for x, y, _ in loader:  # training goes on meanwhile; the checkpoint keeps what was saved
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    gate.open()
    assert accel.wait_for_checkpoint() == path
    assert accel.wait_for_checkpoint() is None  # nothing outstanding any more
    assert gradsync.latest_checkpoint(tmp_path) == path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bg"]  # no temporary folder left
    a2, m2, *_ = fresh()
    a2.load_state(path)
    assert all(torch.equal(v, m2.state_dict()[k]) for k, v in before.items())
    assert a2._window.index == 2


def test_the_next_save_load_and_end_wait_for_a_background_save(tmp_path, clean_env, gate):
    """The gate opens 0.3 s after each background save: whatever follows must wait for it."""
    accel, model, *_ = trained(micro=8)
    accel.save_state(tmp_path / "s1", background=True)
    gate.open(after=0.3)
    accel.save_state(tmp_path / "s2", keep_last=1)  # waits for s1, then prunes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s2"]
    gate.event.clear()
    accel.save_state(tmp_path / "s3", background=True)
    gate.open(after=0.3)
    a2, m2, *_ = fresh()
    accel.load_state(tmp_path / "s3")  # waits for s3's commit before reading it
    gate.event.clear()
    accel.save_state(tmp_path / "s4", background=True, keep_last=2)
    gate.open(after=0.3)
    accel.end()  # waits too (prunes s2 after committing s4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s3", "s4"]
    a2.load_state(tmp_path / "s4")
    assert all(torch.equal(v, m2.state_dict()[k]) for k, v in model.state_dict().items())


@pytest.fixture
def disk_full_for_bad(monkeypatch):
    """Commits of folders named bad* fail as on a full disk."""
    import gradsync.storage.commit as ck

    real = ck.mark_and_rename

    def full(tmp: Path, target: Path, manifest: dict) -> None:
        if target.name.startswith("bad"):
            raise OSError(28, "No space left on device")
        real(tmp, target, manifest)

    monkeypatch.setattr(ck, "mark_and_rename", full)


def test_a_failed_background_commit_is_reported_and_keeps_the_previous(
    tmp_path, clean_env, disk_full_for_bad, capsys
):
    accel, *_ = trained(micro=4)
    accel.save_state(tmp_path / "good")
    accel.save_state(tmp_path / "bad", background=True)
    with pytest.raises(
        CheckpointError,
        match=r"^the background save of '.*bad' failed: No space left on device \(ENOSPC\); "
        r"nothing was saved there, the checkpoint kept is '.*good'; free space",
    ):
        accel.wait_for_checkpoint()
    assert "background save" in capsys.readouterr().err  # also said when it happened
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good"]  # its temporary folder removed
    assert gradsync.latest_checkpoint(tmp_path) == str(tmp_path / "good")
    # The next save warns about it and goes on (a failure is reported once).
    accel.save_state(tmp_path / "bad2", background=True)
    with pytest.warns(RuntimeWarning, match="bad2' failed: No space left on device"):
        accel.save_state(tmp_path / "next")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good", "next"]
    assert accel.wait_for_checkpoint() is None
    accel.save_state(tmp_path / "bad3", background=True)  # end() raises it
    with pytest.raises(CheckpointError, match="bad3' failed"):
        accel.end()
    assert gradsync.latest_checkpoint(tmp_path) == str(tmp_path / "next")


def test_sigterm_saves_even_after_a_failed_background_commit(
    tmp_path, clean_env, disk_full_for_bad
):
    accel = Accelerator(
        backend="single",
        gradient_accumulation_steps=2,
        seed=0,
        save_on_sigterm=str(tmp_path / "preempted"),
    )
    model = make_model()
    opt = make_optimizer(model.parameters(), "sgd", 0.05)
    loader = DataLoader(Indexed(40), batch_size=2)
    model, opt, loader = accel.prepare(model, opt, loader)
    with pytest.raises(SystemExit) as stop, pytest.warns(RuntimeWarning, match="bad' failed"):
        for i, (x, y, _) in enumerate(loader):
            with accel.accumulate(model):
                accel.backward(F.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
            if i == 1:
                accel.save_state(tmp_path / "bad", background=True)
                os.kill(os.getpid(), signal.SIGTERM)  # saved when the next window starts
    assert stop.value.code == 0
    assert gradsync.latest_checkpoint(tmp_path / "preempted") == str(
        tmp_path / "preempted" / "step-1"
    )


def test_register_for_checkpointing(tmp_path, clean_env):
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict[str, int]:
            return {"n": self.n}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.n = state["n"]

    accel, *_ = trained(micro=1)
    counter = Counter()
    accel.register_for_checkpointing(counter)
    counter.n = 7
    accel.save_state(tmp_path / "c")
    a2, *_ = fresh()
    other = Counter()
    a2.register_for_checkpointing(other)
    a2.load_state(tmp_path / "c")
    assert other.n == 7
    with pytest.raises(
        ConfigError, match="register_for_checkpointing\\(\\) got a int, which has no state_dict"
    ):
        a2.register_for_checkpointing(3)


def test_save_state_inside_the_accumulate_block_is_refused(tmp_path, clean_env):
    accel, model, *_ = trained(micro=0)
    with pytest.raises(RuntimeError, match="call it after the block"), accel.accumulate(model):
        accel.save_state(tmp_path / "c")


def test_loader_epoch_is_the_pass_in_progress_or_the_next(tmp_path, clean_env):
    accel = Accelerator(backend="single")
    loader = accel.prepare(DataLoader(Indexed(6), batch_size=2))
    assert loader.epoch == 0
    seen = []
    for epoch in range(loader.epoch, 2):
        for _ in loader:
            seen.append((epoch, loader.epoch))
    assert seen == [(0, 0)] * 3 + [(1, 1)] * 3
    assert loader.epoch == 2


def test_save_model_writes_tied_weights_once(tmp_path, clean_env):
    from safetensors import safe_open
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    assert model.lm_head.weight is model.transformer.wte.weight  # GPT-2 ties them
    accel = Accelerator(backend="single")
    model = accel.prepare(model)
    folder = accel.save_model(model, tmp_path / "export")
    assert folder == str(tmp_path / "export")
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        tied = json.loads(f.metadata()["tied"])
        wte = f.get_tensor("transformer.wte.weight")
    assert tied == {"lm_head.weight": "transformer.wte.weight"}
    assert "lm_head.weight" not in keys and torch.equal(wte, model.transformer.wte.weight)
    assert keys | {"lm_head.weight"} == set(model.state_dict())
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="that path is an existing file; give a folder"):
        accel.save_model(model, tmp_path / "file")


@pytest.mark.parametrize(
    "value, message",
    [
        ("0", "timeout=0.0 must be a number of seconds > 0"),
        ("soon", "GRADSYNC_TIMEOUT='soon' is not a number"),
    ],
)
def test_timeout_from_the_environment_is_checked(clean_env, value, message):
    clean_env.setenv("GRADSYNC_TIMEOUT", value)
    with pytest.raises(ConfigError, match=message):
        Accelerator(backend="single")


def test_timeout_from_the_environment_reaches_the_config(clean_env):
    clean_env.setenv("GRADSYNC_TIMEOUT", "90")
    assert Accelerator(backend="single").config.timeout == 90.0


def test_only_a_process_group_error_becomes_a_collective_error():
    from gradsync.errors import CollectiveError, naming_collective

    def fail(message: str) -> None:
        with naming_collective("backward()", 5):
            raise RuntimeError(message)

    with pytest.raises(
        CollectiveError,
        match=r"^backward\(\) failed: timed out waiting for another rank \(timeout 5 s",
    ):
        fail("[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms")
    with pytest.raises(CollectiveError, match="lost its connection to another rank"):
        fail("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    with pytest.raises(RuntimeError) as err:
        fail("the HTTP fetch of the next shard hit its timeout")  # the user's own error
    assert type(err.value) is RuntimeError


def test_the_fp16_loss_scaler_is_saved_and_restored(tmp_path, clean_env):
    def fp16(seed: int) -> tuple[Accelerator, torch.nn.Module, object]:
        accel = Accelerator(
            backend="single",
            gradient_accumulation_steps=2,
            mixed_precision="fp16",
            seed=seed,
            grad_scaler={"init_scale": 2.0**10, "growth_interval": 2},
        )
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model, opt = accel.prepare(model, opt)
        return accel, model, opt

    accel, model, opt = fp16(0)
    data = Indexed(16)
    for i in range(8):  # 4 clean steps: the scale grew twice
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(data.x[2 * i : 2 * i + 2]), data.y[2 * i : 2 * i + 2]))
            opt.step()
    assert accel.scaler is not None and accel.scaler.get_scale() == 2.0**12
    accel.save_state(tmp_path / "c")
    a2, _m2, _o2 = fp16(1)
    assert a2.scaler is not None and a2.scaler.get_scale() == 2.0**10
    a2.load_state(tmp_path / "c")
    assert a2.scaler.get_scale() == 2.0**12
    assert a2.scaler.state_dict() == accel.scaler.state_dict()


def test_fsdp2_window_gradients_round_trip(tmp_path):
    """The deferred window's unsharded gradients, read out and put back (as a mid-window
    load does), reduce at the boundary to exactly what the uninterrupted window gives."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsync.backends import _fsdp_compat

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)

    def sharded() -> torch.nn.Module:
        model = make_model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def window(model: torch.nn.Module, interrupt: bool) -> list[torch.Tensor]:
        model.set_requires_gradient_sync(False)
        model(x1).sum().backward()
        if interrupt:
            saved = _fsdp_compat.window_grads(model)
            assert all(g is not None for g in saved)
            _fsdp_compat.clear_unsharded_grads(model)
            _fsdp_compat.put_window_grads(model, saved, torch.device("cpu"))
        model.set_requires_gradient_sync(True)
        model(x2).sum().backward()
        return [p.grad.to_local().clone() for p in model.parameters()]

    plain, resumed = window(sharded(), False), window(sharded(), True)
    assert all(torch.equal(a, b) for a, b in zip(plain, resumed))
