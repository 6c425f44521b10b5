"""Checkpoints written by earlier gradsync releases load in this one, or fail in one line
naming the release; and several models with their optimizers, prepared in one call, in one
process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradsync import Accelerator, CheckpointError, ConfigError

from scenarios import releases

RELEASES = releases.RELEASES
release = releases.make()  # the script that wrote the 0.1.0 checkpoints


def test_a_plain_checkpoint_of_gradsync_0_1_0_resumes_where_that_run_went_on(clean_env):
    accel = Accelerator(backend="single", gradient_accumulation_steps=2)
    teacher, student, opt = release.models()
    teacher = accel.prepare(teacher)
    student, opt = accel.prepare(student, opt)
    accel.load_state(RELEASES / "single")
    assert accel.optimizer_steps == 3
    release.train_step(accel, teacher, student, opt, 3)
    got = accel.get_state_dict(student)
    accel.end()
    # Bitwise: the same step, computed here with plain torch from the checkpoint's own files.
    want = releases.continuation("single", world=1)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    # And where the 0.1.0 run went on, on the machine that wrote it (releases.STORED_TOLERANCE
    # says why not bitwise).
    stored = releases.stored("single")
    worst = max(float((got[k] - stored[k]).abs().max()) for k in stored)
    assert worst <= releases.STORED_TOLERANCE, worst


def test_a_0_1_0_checkpoint_into_an_optimizer_over_two_models_is_one_line(clean_env):
    accel = Accelerator(backend="single", gradient_accumulation_steps=2)
    teacher, student, _ = release.models()
    teacher.requires_grad_(True)
    both = torch.optim.Adam([*teacher.parameters(), *student.parameters()])
    accel.prepare(teacher, student, both)
    with pytest.raises(CheckpointError, match=r"written by gradsync 0\.1 .*holds models \[0, 1\]"):
        accel.load_state(RELEASES / "single")
    accel.end()


def test_a_checkpoint_of_a_newer_layout_names_the_release_that_wrote_it(tmp_path, clean_env):
    folder = tmp_path / "ckpt"
    shutil.copytree(RELEASES / "single", folder)
    manifest = json.loads((folder / "gradsync_checkpoint.json").read_text())
    manifest.update(gradsync_checkpoint=9, gradsync_version="gradsync 7.0")
    (folder / "gradsync_checkpoint.json").write_text(json.dumps(manifest))
    accel = Accelerator(backend="single")
    teacher, student, opt = release.models()
    accel.prepare(teacher)
    accel.prepare(student, opt)
    with pytest.raises(
        CheckpointError, match=r"layout 9, written by gradsync 7\.0; .*reads layouts 1, 2"
    ):
        accel.load_state(folder)


def test_the_manifest_says_which_models_each_optimizer_holds(tmp_path, clean_env):
    accel = Accelerator(backend="single")
    a, b, c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 1)
    both = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    head1, head2 = torch.optim.SGD([c.weight], lr=0.1), torch.optim.SGD([c.bias], lr=0.2)
    accel.prepare(a, b, c, both, head1, head2)
    path = accel.save_state(tmp_path / "ckpt")
    manifest = json.loads((Path(path) / "gradsync_checkpoint.json").read_text())
    assert manifest["gradsync_checkpoint"] == 2 and manifest["gradsync_version"].startswith(
        "gradsync 0.2"
    )
    assert manifest["optimizer_models"] == [[0, 1], [2], [2]]
    assert sorted(p.name for p in Path(path).glob("optimizer_*.pt")) == [
        "optimizer_0.pt",
        "optimizer_1.pt",
        "optimizer_2.pt",
    ]


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh()), nn.Linear(4, 1)


def test_prepare_takes_any_mix_and_returns_it_in_order(clean_env):
    accel = Accelerator(backend="single", gradient_accumulation_steps=2)
    g, d = _models()
    opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.Adam(d.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt_d, 1)
    loader = torch.utils.data.DataLoader(torch.randn(8, 3), batch_size=2)
    out = accel.prepare(loader, opt_d, g, sched, d, opt_g)
    assert out[2] is g and out[4] is d
    assert out[1].optimizer is opt_d and out[5].optimizer is opt_g
    assert out[3].scheduler is sched
    for x in out[0]:
        with accel.accumulate(out[2], out[4]):
            accel.backward(out[4](out[2](x)).pow(2).mean())
            out[1].step()
            out[5].step()
            out[3].step()
    assert out[1].steps_applied == out[5].steps_applied == 2
    assert sched.last_epoch == 2  # once per applied step of its optimizer


def test_bad_optimizers_are_one_line_each(clean_env):
    accel = Accelerator(backend="single")
    g, d = _models()
    frozen = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ConfigError, match="belong to no model prepared"):
        accel.prepare(g, torch.optim.SGD([*g.parameters(), *d.parameters()], lr=0.1))
    with pytest.raises(ConfigError, match="frozen Linear"):
        accel.prepare(frozen, torch.optim.SGD(frozen.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="the same Linear twice"):
        accel.prepare(d, d)


def test_an_optimizer_prepared_after_its_model_is_linked_to_it(clean_env):
    accel = Accelerator(backend="single", gradient_accumulation_steps=1)
    g, d = _models()
    g, d = accel.prepare(g, d)
    opt = accel.prepare(torch.optim.SGD([*g.parameters(), *d.parameters()], lr=0.1))
    before = d.weight.detach().clone()
    with accel.accumulate(g, d):
        accel.backward(F.mse_loss(d(g(torch.randn(2, 3))), torch.zeros(2, 1)))
        opt.step()
    assert not torch.equal(before, d.weight) and opt.steps_applied == 1
