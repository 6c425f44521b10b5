"""Accelerate's names on the Accelerator, in one process: the process facts, manual
``no_sync`` / ``trigger_sync_in_backward``, ``skip_first_batches``, ``free_memory``, the
checkpoint hooks, ``backward(**kwargs)`` and ``window_loss``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from gradsync import Accelerator, ConfigError, UsageError


def _setup(k: int = 2, samples: int = 8, **kw):
    accel = Accelerator(backend="single", gradient_accumulation_steps=k, **kw)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = list(zip(torch.randn(samples, 3, generator=g), torch.randn(samples, 1, generator=g)))
    loader = DataLoader(data, batch_size=2)
    return (accel, *accel.prepare(model, opt, loader))


def test_process_facts_have_accelerates_names(clean_env):
    accel = Accelerator(backend="single", mixed_precision="bf16")
    assert (accel.process_index, accel.local_process_index, accel.num_processes) == (0, 0, 1)
    assert accel.is_last_process and accel.is_main_process
    assert accel.mixed_precision == "bf16"


def test_window_loss_is_the_mean_of_the_windows_micro_batch_losses(clean_env):
    accel, model, opt, loader = _setup(k=3, samples=10)  # windows of 3, then a partial one of 2
    losses, seen = [], []
    for x, y in loader:
        with accel.accumulate(model):
            loss = F.mse_loss(model(x), y)
            losses.append(loss.item())
            accel.backward(loss)
            opt.step()
            if accel.sync_gradients:  # read inside the block, after the step
                seen.append(accel.window_loss)
            opt.zero_grad()
    assert seen == pytest.approx([sum(losses[:3]) / 3, sum(losses[3:]) / 2], rel=1e-6)
    assert accel.window_loss == seen[-1]  # and after the block


def test_window_loss_weights_items_like_the_update(clean_env):
    accel = Accelerator(
        backend="single", gradient_accumulation_steps=2, count_items=lambda b: int(b[1].sum())
    )
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    # (x, mask): 3 items then 1 item: a token-weighted window
    data = [(torch.ones(1, 1) * v, torch.tensor([n])) for v, n in ((1.0, 3), (2.0, 1))]
    model, opt, loader = accel.prepare(model, opt, DataLoader(data, batch_size=None))
    sums = []
    for x, n in loader:
        with accel.accumulate(model):
            per_item = model(x).pow(2).sum()  # the same value for each of its n items
            loss = per_item * n.sum()
            sums.append(loss.item())
            accel.backward(loss, reduction="sum")
            opt.step()
    assert accel.window_loss == pytest.approx(sum(sums) / 4, rel=1e-6)


def test_window_loss_bad_reads(clean_env):
    accel, _model, _opt, _loader = _setup()
    with pytest.raises(UsageError, match="known once a window closed"):
        _ = accel.window_loss
    off = Accelerator(backend="single", track_window_loss=False)
    with pytest.raises(ConfigError, match="track_window_loss=False"):
        _ = off.window_loss


def test_backward_passes_keywords_to_torch(clean_env):
    accel, model, _opt, loader = _setup(k=1)
    x, y = next(iter(loader))
    with accel.accumulate(model):
        loss = F.mse_loss(model(x), y)
        accel.backward(loss, retain_graph=True)
        accel.backward(loss)  # the graph is still there
    with pytest.raises(RuntimeError, match="second time"):
        with accel.accumulate(model):
            loss = F.mse_loss(model(x), y)
            accel.backward(loss)
            accel.backward(loss)


def test_manual_no_sync_and_trigger_close_the_window_where_told(clean_env):
    accel, model, opt, loader = _setup(k=4)
    before = model.weight.detach().clone()
    batches = list(loader)
    reference = nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    losses = []
    with accel.no_sync(model):
        loss = F.mse_loss(model(batches[0][0]), batches[0][1])
        losses.append(loss.item())
        accel.backward(loss)
        opt.step()  # off the boundary: nothing
    assert not accel.sync_gradients and torch.equal(model.weight, before)
    with accel.trigger_sync_in_backward(model):
        loss = F.mse_loss(model(batches[1][0]), batches[1][1])
        losses.append(loss.item())
        accel.backward(loss)
    assert accel.sync_gradients
    opt.step()
    assert opt.steps_applied == 1 and not torch.equal(model.weight, before)
    # backward divided each loss by k = 4 (as Accelerate does), whatever the micro-steps
    (sum(F.mse_loss(reference(x), y) for x, y in batches[:2]) / 4).backward()
    assert torch.allclose(model.weight, before - 0.1 * reference.weight.grad)
    assert accel.window_loss == pytest.approx(sum(losses) / 4, rel=1e-6)


def test_skip_first_batches_skips_the_next_pass_only(clean_env):
    accel, _model, _opt, loader = _setup(k=1, samples=8)
    first = [x for x, _ in loader]
    assert accel.skip_first_batches(loader, 3) is loader
    skipped = [x for x, _ in loader]
    assert len(skipped) == 1 and torch.equal(skipped[0], first[3])
    assert len([x for x, _ in loader]) == 4  # the pass after is whole
    with pytest.raises(ConfigError, match="returned by accel.prepare"):
        accel.skip_first_batches(DataLoader(list(range(4))), 1)
    with pytest.raises(ConfigError, match="num_batches=-1"):
        accel.skip_first_batches(loader, -1)


def test_free_memory_forgets_what_was_prepared(clean_env):
    accel, model, opt, loader = _setup()
    assert accel.free_memory(model, opt, loader) == [None, None, None]
    with pytest.raises(UsageError, match="no optimizer was prepared"):
        _ = accel.optimizer


def test_checkpoint_hooks_run_with_the_folder(tmp_path: Path, clean_env):
    accel, _model, _opt, _loader = _setup()
    calls = []

    def on_save(models, weights, output_dir):
        calls.append(("save", len(models), sorted(weights[0]), Path(output_dir).name))
        (Path(output_dir) / "extra.json").write_text("{}")

    handle = accel.register_save_state_pre_hook(on_save)
    accel.register_load_state_pre_hook(
        lambda models, input_dir: calls.append(("load", len(models), input_dir))
    )
    path = accel.save_state(tmp_path / "ckpt")
    assert (Path(path) / "extra.json").is_file()  # committed with the checkpoint
    accel.load_state(path)
    assert calls[0][:3] == ("save", 1, ["bias", "weight"]) and calls[1] == ("load", 1, path)
    handle.remove()
    accel.save_state(tmp_path / "again")
    assert len(calls) == 2


def test_two_blocks_per_batch_advance_the_window_twice(clean_env):
    """The GAN pattern is one accumulate(G, D) block per batch; a block per model is two
    micro-steps, so with k=2 each batch is a whole window."""

    def run(blocks_per_batch: int) -> tuple[int, int]:
        accel = Accelerator(backend="single", gradient_accumulation_steps=2)
        torch.manual_seed(0)
        g, d = nn.Linear(2, 2), nn.Linear(2, 1)
        opt_g, opt_d = (
            torch.optim.SGD(g.parameters(), lr=0.1),
            torch.optim.SGD(d.parameters(), lr=0.1),
        )
        loader = DataLoader(torch.randn(8, 2), batch_size=2)
        g, d, opt_g, opt_d, loader = accel.prepare(g, d, opt_g, opt_d, loader)
        for x in loader:
            if blocks_per_batch == 1:
                with accel.accumulate(g, d):
                    accel.backward(d(g(x).detach()).pow(2).mean())
                    opt_d.step()
                    accel.backward(g(x).pow(2).mean())
                    opt_g.step()
            else:
                with accel.accumulate(d):
                    accel.backward(d(g(x).detach()).pow(2).mean())
                    opt_d.step()
                with accel.accumulate(g):
                    accel.backward(g(x).pow(2).mean())
                    opt_g.step()
        return opt_d.steps_applied, opt_g.steps_applied

    assert run(1) == (2, 2)  # 4 batches, windows of 2 batches: each model updated twice
    # A block per model: D's block opens each window and G's closes it, so G is updated
    # after every batch and D only where the end of the data closed a window early.
    assert run(2) == (1, 3)


def test_logged_window_losses_one_record_per_optimizer_step(tmp_path: Path, clean_env):
    """accel.log with W&B (offline), MLflow (local store) and CSV: one record per applied
    optimizer step, at steps 1, 2, 3 (the default step), with the window's loss."""
    import csv
    import json
    import time

    from mlflow.tracking import MlflowClient

    from harness.trackers import wandb_records

    accel, model, opt, loader = _setup(
        k=2, samples=12, log_with=["wandb", "mlflow", "csv"], project_dir=str(tmp_path)
    )
    accel.init_trackers("run")
    losses = []
    for x, y in loader:
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        if accel.sync_gradients:
            losses.append(accel.window_loss)
            accel.log({"loss": accel.window_loss})
    run_id = accel.get_tracker("mlflow").run_id
    accel.end_training()
    assert len(losses) == 3

    client = MlflowClient(f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}")
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert history == [(s + 1, pytest.approx(v)) for s, v in enumerate(losses)]

    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["step"]), float(r["loss"])) for r in rows] == [
        (s + 1, pytest.approx(v)) for s, v in enumerate(losses)
    ]

    (log_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 60
    while True:  # W&B's service may end the file a moment after finish() returns
        records = wandb_records(log_file)
        if (
            any(r.WhichOneof("record_type") == "exit" for r in records)
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.1)
    history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    assert [h.step.num for h in history] == [1, 2, 3]
    assert [
        json.loads(next(i.value_json for i in h.item if i.nested_key[0] == "loss")) for h in history
    ] == [pytest.approx(v) for v in losses]


def test_the_scaling_seed_is_never_shared_between_backward_passes(clean_env):
    """The window's 1/n scaling seeds backward; autograd may keep that seed (or a view of it)
    as a parameter's gradient and add into it, so a shared seed would be corrupted."""
    accel = Accelerator(backend="single", gradient_accumulation_steps=4)
    p = nn.Parameter(torch.tensor([2.0]))
    q = nn.Parameter(torch.tensor(3.0))
    holder = nn.Module()
    holder.p, holder.q = p, q
    holder = accel.prepare(holder)
    for _ in range(4):
        with accel.accumulate(holder):
            accel.backward(p.view(()))  # a loss that is a view of a parameter
    assert torch.equal(p.grad, torch.tensor([1.0]))  # 4 x 1/4
    for _ in range(4):
        with accel.accumulate(holder):
            accel.backward(q * 2.0)
    assert torch.equal(q.grad, torch.tensor(2.0))  # 4 x 2/4
