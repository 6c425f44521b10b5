"""Accumulation schedules, planned optimizer steps, windows across epochs and split batches,
in one process (backend "single"); the 2-rank schedule tests are in test_ddp / test_fsdp /
test_deepspeed."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from gradsync import Accelerator, ConfigError
from gradsync._plan.accumulation_schedule import RampUp, StepKeyed, parse
from gradsync._plan.window import Window

from harness.checks import max_diff, reference
from scenarios.common import Indexed, Loop, make_model, to_lists, train


def sizes_of(window: Window, micro_steps: int) -> list[int]:
    sizes = []
    for _ in range(micro_steps):
        step = window.begin()
        window.end()
        if step.boundary:
            sizes.append(step.size)
    return sizes


def test_step_keyed_schedule_by_completed_windows():
    assert sizes_of(Window(parse("0:2 3:4 5:1")), 2 * 3 + 4 * 2 + 3) == [2, 2, 2, 4, 4, 1, 1, 1]
    assert parse({0: 2, 3: 4}) == StepKeyed(((0, 2), (3, 4)))


def test_a_callable_schedule():
    assert sizes_of(Window(parse(lambda step: 1 + step)), 1 + 2 + 3) == [1, 2, 3]


def test_ramp_up_of_the_global_batch():
    """Megatron-style: from 16 by 16 over 96 samples up to 64, micro 4 x 2 ranks = 8 per k."""
    ramp = parse(
        {"start": 16, "increment": 16, "samples": 96},
        micro_batch_size=4,
        data_parallel_size=2,
        global_batch_size=64,
    )
    assert isinstance(ramp, RampUp)
    # 3 increments over 96 samples: one every 32 samples consumed
    ks = [ramp.steps_at(w) for w in range(7)]
    assert ks == [2, 2, 4, 6, 8, 8, 8]  # consumed 0, 16, 32, 64, 112 (past the ramp)


@pytest.mark.parametrize(
    "value, message",
    [
        ("0:2 x:4", r"'x:4' is not STEP:K"),
        ("5:2 9:4", "must say k from optimizer step 0"),
        ("0:2 3:0", r"\(at step 3\)=0 must be >= 1"),
        (
            {"start": 10, "increment": 16, "samples": 96},
            "ramp-up start=10 is not a multiple of micro_batch_size x world size = 4 x 2 = 8",
        ),
        ({"start": 16, "increment": 16}, "neither a ramp-up"),
    ],
)
def test_bad_schedules_name_the_problem(value, message):
    with pytest.raises(ConfigError, match=message):
        parse(value, micro_batch_size=4, data_parallel_size=2, global_batch_size=64)


def test_schedule_from_keywords_yaml_and_environment(clean_env, tmp_path):
    a = Accelerator(backend="single", gradient_accumulation_steps="0:2 1:3")
    assert a.gradient_accumulation_steps == 2
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gradient_accumulation_steps:\n  0: 3\n  2: 5\n")
    assert Accelerator(backend="single", config_file=str(cfg)).gradient_accumulation_steps == 3
    clean_env.setenv("GRADSYNC_GRADIENT_ACCUMULATION_STEPS", "0:4 10:8")
    assert Accelerator(backend="single").gradient_accumulation_steps == 4
    clean_env.setenv("GRADSYNC_GRADIENT_ACCUMULATION_STEPS", "0:4 ten:8")
    with pytest.raises(ConfigError, match="'ten:8' is not STEP:K"):
        Accelerator(backend="single")


def test_a_schedule_contradicts_a_fixed_global_batch(clean_env):
    with pytest.raises(ConfigError, match="global_batch_size=64 fixes k"):
        Accelerator(
            backend="single",
            gradient_accumulation_steps="0:2 4:4",
            global_batch_size=64,
            micro_batch_size=4,
        )


def test_accelerator_reports_the_current_k_and_trains_like_one_process(clean_env):
    a = Accelerator(backend="single", seed=0, gradient_accumulation_steps="0:2 2:4")
    seen = []

    class Watch(torch.nn.Module):  # records k at every forward
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(a.gradient_accumulation_steps)
            return self.net(x)

    r = train(a, Loop(samples=22, micro_batch=2), model=Watch())
    assert r["sizes"] == [2, 2, 4, 3, 4, 4, 3]
    assert seen[:4] == [2, 2, 2, 2] and seen[4] == 4
    r["state"] = {k.removeprefix("net."): v for k, v in r["state"].items()}
    assert max_diff(r["state"], reference([r], samples=22)["state"]) < 1e-6


def test_planned_optimizer_steps_match_the_run(clean_env):
    a = Accelerator(backend="single", gradient_accumulation_steps="0:2 2:4")
    a.prepare(DataLoader(Indexed(22), batch_size=2))
    assert a.planned_optimizer_steps(2) == 7  # 11 batches per epoch: 2, 2, 4, 3 | 4, 4, 3
    assert a.planned_optimizer_steps(3) == 10
    r = train(
        Accelerator(backend="single", seed=0, gradient_accumulation_steps="0:2 2:4"),
        Loop(samples=22, micro_batch=2, epochs=3),
    )
    assert r["optimizer_steps"] == len(r["windows"]) == 10
    with pytest.raises(RuntimeError, match="needs a prepared dataloader"):
        Accelerator(backend="single").planned_optimizer_steps(1)


def test_a_scheduler_built_for_another_length_warns_once_with_both_numbers(clean_env, caplog):
    a = Accelerator(backend="single", gradient_accumulation_steps=4)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _loader = a.prepare(model, opt, DataLoader(Indexed(22), batch_size=2))
    planned = a.planned_optimizer_steps(2)
    assert planned == 6
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        a.prepare(torch.optim.lr_scheduler.OneCycleLR(opt.optimizer, max_lr=0.1, total_steps=22))
        a.planned_optimizer_steps(2)
    assert (
        caplog.text.count("built for 22 steps (OneCycleLR total_steps), but the run will take 6")
        == 1
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        a.prepare(torch.optim.lr_scheduler.OneCycleLR(opt.optimizer, max_lr=0.1, total_steps=6))
    assert "built for" not in caplog.text


def test_windows_run_across_epochs_without_sync_with_dataloader(clean_env, caplog):
    a = Accelerator(
        backend="single", seed=0, gradient_accumulation_steps=4, sync_with_dataloader=False
    )
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        r = train(a, Loop(samples=22, micro_batch=2, epochs=2))
    assert r["sizes"] == [4] * 5  # 22 batches: five full windows, two left in an open window
    assert "dropping" not in caplog.text
    assert max_diff(r["state"], reference([r], samples=22)["state"]) < 1e-6
    b = Accelerator(backend="single", gradient_accumulation_steps=4, sync_with_dataloader=False)
    b.prepare(DataLoader(Indexed(22), batch_size=2))
    assert b.planned_optimizer_steps(2) == 5
    with pytest.raises(ConfigError, match="count_items needs sync_with_dataloader=True"):
        Accelerator(backend="single", sync_with_dataloader=False, count_items=len)


def test_split_batches_make_windows_of_micro_batches(clean_env):
    """Loader batches of 8 samples split into micro-batches of 2 (the last loader batch of 5
    gives 2, 2, 1): windows of 3 micro-batches, the partial last one sized right."""
    a = Accelerator(backend="single", seed=0, gradient_accumulation_steps=3)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(Indexed(21), batch_size=8)
    model, opt, loader = a.prepare(model, opt, loader)
    windows, current, sizes = [], [], []
    for x, y, idx in loader:
        for mx, my, mi in a.split_batch((x, y, idx), 2):
            with a.accumulate(model):
                a.backward(F.mse_loss(model(mx), my))
                current.append(mi.tolist())
                sizes.append((a.micro_step.size, a.sync_gradients))
                opt.step()
                opt.zero_grad()
            if a.sync_gradients:
                windows.append(current)
                current = []
    # 8 + 8 + 5 samples -> 4 + 4 + 3 = 11 micro-batches: windows 3, 3, 3, 2
    assert [len(w) for w in windows] == [3, 3, 3, 2]
    assert sizes[-2:] == [(2, False), (2, True)]
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    data = Indexed(21)
    for w in windows:
        ref_opt.zero_grad()
        (sum(F.mse_loss(ref(data.x[mb]), data.y[mb]) for mb in w) / len(w)).backward()
        ref_opt.step()
    assert max_diff(to_lists(model.state_dict()), to_lists(ref.state_dict())) < 1e-6


def test_split_batch_misuse(clean_env):
    a = Accelerator(backend="single", gradient_accumulation_steps=2)
    model = a.prepare(make_model())
    with pytest.raises(ConfigError, match="micro_batch_size=0 must be >= 1"):
        a.split_batch(torch.ones(4, 8), 0)
    a.split_batch(torch.ones(4, 8), 2)
    with pytest.raises(RuntimeError, match="no prepared dataloader fed the batch"):
        with a.accumulate(model):
            pass
