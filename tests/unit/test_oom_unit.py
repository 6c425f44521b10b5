"""``on_oom="split"`` in one process: what counts as an out-of-memory error, the refusals at
prepare, the re-planned window (the same samples in halves, bitwise as a run planned with
the smaller micro-batch), a checkpoint that carries the new plan, and the setting reaching
every spelling. The real allocation failure on one rank of several: tests/multiprocess/test_oom.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from gradsync import Accelerator, cli
from gradsync._core.oom import is_out_of_memory
from gradsync.config import load_config
from gradsync.errors import ConfigError
from gradsync.launch import Launcher


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _train(
    micro: int,
    k: int,
    *,
    fits: int | None = None,
    on_oom: str = "raise",
    epochs: int = 2,
    save_at: int | None = None,
    folder: Path | None = None,
) -> tuple[list[torch.Tensor], Accelerator, list[float]]:
    """Train; a micro-batch of more than ``fits`` rows raises torch.OutOfMemoryError (the
    CUDA allocator's error) in its forward."""
    accel = Accelerator(gradient_accumulation_steps=k, on_oom=on_oom)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = accel.prepare(model, opt, DataLoader(_data(), batch_size=micro))
    losses = []
    for _ in range(epochs):
        for x, y in loader:
            with accel.accumulate(model):
                if fits is not None and len(x) > fits:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
                accel.backward(F.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
            if accel.sync_gradients:
                losses.append(accel.window_loss)
                if save_at is not None and len(losses) == save_at:
                    assert folder is not None
                    accel.save_state(folder)
    return [p.detach().clone() for p in model.parameters()], accel, losses


@pytest.mark.parametrize(
    "err",
    [
        torch.OutOfMemoryError("CUDA out of memory"),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 102400000 bytes. Error code 12 (Cannot allocate memory)"
        ),
        MemoryError(),
    ],
)
def test_allocation_failures_are_out_of_memory(err):
    assert is_out_of_memory(err)


@pytest.mark.parametrize("err", [RuntimeError("shape mismatch"), ValueError("memory"), None])
def test_other_errors_are_not(err):
    assert not is_out_of_memory(err)


def test_a_split_window_equals_the_smaller_plan_bitwise(caplog):
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        split, accel, split_losses = _train(8, 2, fits=4, on_oom="split")
    planned, _, planned_losses = _train(4, 4)
    assert all(torch.equal(a, b) for a, b in zip(split, planned))
    assert split_losses == planned_losses
    assert (accel.plan.micro_batch_size, accel.gradient_accumulation_steps) == (4, 4)
    assert accel.plan.global_batch_size == 16
    said = [r.getMessage() for r in caplog.records if "out of memory" in r.getMessage()]
    assert len(said) == 1 and "micro_batch_size 8 -> 4" in said[0], said


def test_off_the_boundary_a_failure_waits_for_the_boundary_agreement():
    """One agreement per window when nothing fails; a micro-step that runs out of memory
    off the boundary is told at the boundary, and the window's remaining micro-steps run no
    backward in between."""

    def run(fail_at: int | None) -> tuple[int, list[int], Accelerator]:
        accel = Accelerator(gradient_accumulation_steps=4, on_oom="split")
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt, loader = accel.prepare(model, opt, DataLoader(_data(), batch_size=8))
        backwards: list[int] = []  # the micro-step (counted from 0) of each backward run
        for step, (x, y) in enumerate(loader):
            with accel.accumulate(model):
                if step == fail_at:
                    raise torch.OutOfMemoryError("CUDA out of memory")
                loss = F.mse_loss(model(x), y)
                loss.register_hook(lambda g, s=step: backwards.append(s))
                accel.backward(loss)
                opt.step()
                opt.zero_grad()
        assert accel._p.runner.oom is not None
        return accel._p.runner.oom.agreements, backwards, accel

    agreements, backwards, _ = run(None)
    assert agreements == 2 and backwards == list(range(8))  # 64 rows, 2 windows of 4 x 8
    agreements, backwards, accel = run(1)
    assert backwards[:1] == [0] and backwards[1] == 4, backwards  # 2 and 3 ran none
    assert agreements == 3  # told at the first boundary, then one per window of 8 x 4
    assert (accel.plan.micro_batch_size, accel.gradient_accumulation_steps) == (4, 8)


def test_splits_repeat_down_to_what_fits():
    split, accel, _ = _train(8, 1, fits=2, on_oom="split")
    planned, _, _ = _train(2, 4)
    assert all(torch.equal(a, b) for a, b in zip(split, planned))
    assert accel.plan.micro_batch_size == 2 and accel.gradient_accumulation_steps == 4


def test_the_scheduler_steps_once_per_update_as_planned():
    accel = Accelerator(gradient_accumulation_steps=2, on_oom="split")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched, loader = accel.prepare(model, opt, sched, DataLoader(_data(), batch_size=8))
    for x, y in loader:
        with accel.accumulate(model):
            if len(x) > 4:
                raise torch.OutOfMemoryError("out of memory")
            accel.backward(F.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
    assert len(loader) / accel.gradient_accumulation_steps == 4  # updates per epoch, kept
    assert sched.get_last_lr() == [0.1 * 0.5**4]


def test_below_one_row_it_raises_one_line():
    with pytest.raises(torch.OutOfMemoryError, match="cannot split further: micro_batch_size=1"):
        _train(2, 1, fits=0, on_oom="split")


def test_without_split_the_error_propagates():
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        _train(8, 2, fits=4)


def test_an_oom_outside_accumulate_is_not_caught():
    """An evaluation forward that runs out of memory raises as it is; the plan stays."""
    accel = Accelerator(gradient_accumulation_steps=2, on_oom="split")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = accel.prepare(model, opt, DataLoader(_data(), batch_size=8))

    def evaluation_runs_out(module, args):
        raise torch.OutOfMemoryError("evaluation batch")

    handle = model.register_forward_pre_hook(evaluation_runs_out)
    batch = next(iter(loader))
    with pytest.raises(torch.OutOfMemoryError, match="evaluation batch"), torch.no_grad():
        model(batch[0])
    handle.remove()
    assert (accel.plan.micro_batch_size, accel.gradient_accumulation_steps) == (8, 2)
    assert loader.split == 1 and len(loader) == 8


def test_a_resumed_run_starts_with_the_split_plan(tmp_path):
    whole, _, losses = _train(8, 2, fits=4, on_oom="split", epochs=2)
    _train(8, 2, fits=4, on_oom="split", epochs=1, save_at=2, folder=tmp_path / "ckpt")
    accel = Accelerator(gradient_accumulation_steps=2, on_oom="split")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = accel.prepare(model, opt, DataLoader(_data(), batch_size=8))
    accel.load_state(tmp_path / "ckpt")
    assert accel.gradient_accumulation_steps == 4
    assert accel.plan.micro_batch_size == 4
    resumed = []
    for _ in range(loader.epoch, 2):
        for x, y in loader:
            assert len(x) == 4
            with accel.accumulate(model):
                accel.backward(F.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
            if accel.sync_gradients:
                resumed.append(accel.window_loss)
    assert resumed == losses[2:]
    assert all(torch.equal(a, b.detach()) for a, b in zip(whole, model.parameters()))


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"micro_batch": 3}, "micro_batch_size=3 is odd"),
        ({"micro_batch": 1}, "micro_batch_size=1 cannot be halved"),
        ({"loader": False}, "prepare it"),
        ({"k": "0:2 10:4"}, "is a schedule"),
    ],
)
def test_what_cannot_split_is_refused_at_prepare(options, words):
    k = options.get("k", 2)
    accel = Accelerator(gradient_accumulation_steps=k, on_oom="split")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    objects = [model, opt]
    if options.get("loader", True):
        objects.append(DataLoader(_data(), batch_size=options.get("micro_batch", 8)))
    with pytest.raises(ConfigError, match=words):
        accel.prepare(*objects)


def test_the_setting_has_every_spelling(monkeypatch, tmp_path):
    monkeypatch.setenv("GRADSYNC_ON_OOM", "split")
    assert load_config().on_oom == "split"
    with pytest.raises(ConfigError, match="on_oom"):
        load_config(on_oom="shrink")
    script = tmp_path / "train.py"
    script.write_text("")
    args = cli.build_parser().parse_args(["launch", "--on-oom", "split", str(script)])
    assert Launcher(cli.launch_config(args), environ={}).worker_env()["GRADSYNC_ON_OOM"] == "split"


def test_plan_shows_the_ladder_split_walks(capsys, tmp_path):
    assert (
        cli.main(["plan", "--global-batch-size", "64", "--micro-batch-size", "8", "--ladder"]) == 0
    )
    assert "8 x 8 -> 4 x 16 -> 2 x 32 -> 1 x 64" in capsys.readouterr().out
    assert (
        cli.main(
            [
                "plan",
                "--global-batch-size",
                "48",
                "--micro-batch-size",
                "12",
                "--nproc-per-node",
                "1,2",
                "--ladder",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "12 x 2 -> 6 x 4 -> 3 x 8 (then raise: 3 is odd)" in out  # 2 processes
    assert "12 x 4 -> 6 x 8 -> 3 x 16 (then raise: 3 is odd)" in out  # 1 process


def test_an_elastic_launch_leaves_k_to_the_world_that_joined(tmp_path, monkeypatch):
    """--nnodes MIN:MAX with a global batch: the workers get the global and the micro batch,
    and each (re)start solves k for the processes that actually joined."""
    script = tmp_path / "train.py"
    script.write_text("")
    argv = ["launch", "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", "h:1"]
    argv += ["--global-batch-size", "16", "--micro-batch-size", "4", str(script)]
    env = Launcher(cli.launch_config(cli.build_parser().parse_args(argv)), environ={}).worker_env()
    assert env["GRADSYNC_GLOBAL_BATCH_SIZE"] == "16" and env["GRADSYNC_MICRO_BATCH_SIZE"] == "4"
    assert "GRADSYNC_GRADIENT_ACCUMULATION_STEPS" not in env
    for name, value in env.items():  # a worker of a restart on one process
        monkeypatch.setenv(name, value)
    assert Accelerator().gradient_accumulation_steps == 4


def test_a_world_that_cannot_keep_the_global_batch_names_those_that_can():
    """Resumed (or restarted by an elastic agent) on 3 processes, a global batch of 16 in
    micro-batches of 2 cannot stay whole: one line names the world sizes that keep it."""
    from gradsync._plan.batch_plan import BatchPlan

    with pytest.raises(ConfigError, match=r"or run on 1, 2, 4, 8 data-parallel processes"):
        BatchPlan.solve(data_parallel_size=3, global_batch_size=16, micro_batch_size=2)


@pytest.mark.parametrize(
    "dims, words",
    [
        ({"tp": 2}, "tp=2 run collectives"),
        ({"pp": 2}, "pp=2 run collectives"),
        ({"tp": 2, "pp": 2}, "tp=2 and pp=2 run collectives"),
    ],
)
def test_tensor_parallel_and_pipelines_are_refused_at_prepare(
    tmp_path, monkeypatch, clean_env, dims, words
):
    """On a mesh with tp > 1 or pp > 1 collectives run inside every forward and backward:
    refused in one line at prepare (a one-rank group; the refusal comes before any mesh is
    built)."""
    import torch.distributed as dist

    from gradsync.backends.fsdp import FSDPBackend
    from gradsync.mesh import Parallelism

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    backend = FSDPBackend()
    backend._dims = Parallelism(**dims)  # as such a mesh resolves
    assert words in (backend.oom_split_refusal() or "")
    assert FSDPBackend().oom_split_refusal() is None
    from gradsync._core.oom import check_at_prepare
    from gradsync._plan.batch_plan import BatchPlan

    with pytest.raises(ConfigError, match=rf"^on_oom='split' is not available: {words}"):
        check_at_prepare(BatchPlan(8, 2, 1), backend, True, None)


def test_a_window_resumed_mid_way_runs_again_from_its_first_sample(tmp_path):
    """Saved in the middle of a window, resumed, then out of memory: the re-planned window
    starts at its first sample (consumed before the save), as in the uninterrupted run."""

    def prepared() -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer, DataLoader]:
        accel = Accelerator(gradient_accumulation_steps=2, on_oom="split")
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return accel, *accel.prepare(model, opt, DataLoader(_data(), batch_size=8))

    accel, model, opt, loader = prepared()
    for step, (x, y) in enumerate(loader):
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        if step == 2:  # window 2 is open: its first micro-batch is in its gradients
            accel.save_state(tmp_path / "mid")
            break
    accel, model, opt, loader = prepared()
    accel.load_state(tmp_path / "mid")
    for _ in range(2 - loader.epoch):
        for x, y in loader:
            with accel.accumulate(model):
                if len(x) > 4:
                    raise torch.OutOfMemoryError("CUDA out of memory")
                accel.backward(F.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
    planned, _, _ = _train(4, 4)  # window 1 ran in halves of 8 here: reassociation only
    gap = max(float((a.detach() - b).abs().max()) for a, b in zip(model.parameters(), planned))
    assert gap < 1e-6, gap
    assert (accel.plan.micro_batch_size, accel.gradient_accumulation_steps) == (4, 4)


def test_the_launcher_keeps_the_folder_the_split_is_left_in():
    from gradsync._core.oom import RESTART_STATE_ENV
    from gradsync.launch.failures import RESTART_STATE_ENV as LAUNCHER_S

    assert RESTART_STATE_ENV == LAUNCHER_S
