"""Token-weighting in one process: the counter, the scaling, and every bad input."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader

import gradsync
from gradsync import Accelerator, ConfigError

from scenarios.common import make_model


def labelled(lengths, ignored=()):
    """A batch of rows with these numbers of label tokens (-100 elsewhere)."""
    width = max(lengths) + 1
    labels = torch.full((len(lengths), width), -100)
    for row, n in enumerate(lengths):
        labels[row, :n] = 7
    for row, col in ignored:
        labels[row, col] = -100
    return {"labels": labels, "x": torch.randn(len(lengths), 8)}


def test_count_label_tokens_skips_ignored_and_each_first_position():
    batch = labelled([4, 1, 3])
    assert gradsync.count_label_tokens(batch) == 3 + 0 + 2
    assert gradsync.count_label_tokens(batch, shift=False) == 8
    assert gradsync.count_label_tokens({"labels": torch.tensor([[5, 5, 0]])}, ignore_index=0) == 1
    with pytest.raises(ConfigError, match="needs a batch with a 'labels' tensor.*keys x"):
        gradsync.count_label_tokens({"x": torch.ones(2)})


def _run(accel, batches, reduction="sum", loss_of=None):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    loader = DataLoader(batches, batch_size=None)
    model, opt, loader, sched = accel.prepare(model, opt, loader, sched)
    seen = []
    for batch in loader:
        with accel.accumulate(model):
            out = model(batch["x"]).sum() if loss_of is None else loss_of(model, batch)
            accel.backward(out, reduction=reduction)
            seen.append(accel.window_items)
            opt.step()
            sched.step()
    return model, opt, sched, seen


def test_window_items_counts_the_whole_window_from_its_first_micro_step(clean_env):
    accel = Accelerator(
        backend="single", gradient_accumulation_steps=2, count_items=gradsync.count_label_tokens
    )
    batches = [labelled([3]), labelled([5, 2]), labelled([4])]
    _, _, _, seen = _run(accel, batches)
    assert seen == [2 + 5, 2 + 5, 3]  # the partial last window holds one batch


def test_sum_reduction_gives_the_item_mean(clean_env):
    """Per-item losses summed, window of 2 micro-batches with 1 and 3 items: the gradient is
    the mean over the 4 items, not the mean of the two micro-batch means."""
    accel = Accelerator(
        backend="single", gradient_accumulation_steps=2, count_items=lambda b: int(b["n"])
    )
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = accel.prepare(model, opt)
    xs = [torch.tensor([[1.0]]), torch.tensor([[2.0], [3.0], [4.0]])]
    loader = accel.prepare(DataLoader([{"x": x, "n": len(x)} for x in xs], batch_size=None))
    for batch in loader:
        with accel.accumulate(model):
            accel.backward(model(batch["x"]).sum(), reduction="sum")
            if accel.sync_gradients:
                grad = float(model.weight.grad)
    assert grad == pytest.approx((1 + 2 + 3 + 4) / 4)


def test_a_window_without_items_skips_the_step_and_the_scheduler(clean_env, caplog):
    accel = Accelerator(
        backend="single", gradient_accumulation_steps=2, count_items=gradsync.count_label_tokens
    )
    empty = labelled([0, 1])  # no label token after the shift
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        model, _opt, sched, seen = _run(
            accel,
            [empty, empty, labelled([3]), labelled([2])],
            # a loss over no item gone wrong: NaN
            loss_of=lambda m, b: (
                m(b["x"]).sum() * (1.0 if gradsync.count_label_tokens(b) else float("nan"))
            ),
        )
    assert seen[:2] == [0, 0]
    assert accel.optimizer_steps == 1 and sched.last_epoch == 1
    assert "holds no item" in caplog.text
    assert all(torch.isfinite(p).all() for p in model.parameters()), "no NaN reaches the weights"


@pytest.mark.parametrize(
    "value, message",
    [
        (-2, "count_items returned -2 for batch 1 of epoch 0; a count must be >= 0"),
        (2.5, r"count_items returned 2.5 \(float\) for batch 1 of epoch 0"),
        ("3", r"count_items returned '3' \(str\) for batch 1"),
        (torch.tensor(1.5), r"count_items returned tensor\(1.5000\) for batch 1"),
    ],
)
def test_bad_counts_name_the_value_and_the_batch(clean_env, value, message):
    accel = Accelerator(
        backend="single",
        gradient_accumulation_steps=2,
        count_items=lambda b: value if b["i"] == 1 else 1,
    )
    model = accel.prepare(make_model())
    loader = accel.prepare(
        DataLoader([{"i": i, "x": torch.randn(1, 8)} for i in range(4)], batch_size=None)
    )
    with pytest.raises(ConfigError, match=message):
        for _ in loader:
            with accel.accumulate(model):
                pass
    assert accel.micro_step is None


def test_sum_without_count_items_names_the_fix(clean_env):
    accel = Accelerator(backend="single", gradient_accumulation_steps=2)
    model = accel.prepare(make_model())
    with accel.accumulate(model):
        with pytest.raises(
            ConfigError, match=r"reduction='sum'\) needs count_items.*count_label_tokens"
        ):
            accel.backward(model(torch.randn(2, 8)).sum(), reduction="sum")
        with pytest.raises(ConfigError, match="accel.window_items needs count_items"):
            accel.window_items  # noqa: B018


def test_unknown_reduction_lists_the_known_ones(clean_env):
    accel = Accelerator(backend="single")
    model = accel.prepare(make_model())
    with (
        accel.accumulate(model),
        pytest.raises(ConfigError, match="unknown; use one of mean, sum, normalized"),
    ):
        accel.backward(model(torch.randn(2, 8)).sum(), reduction="avg")


def test_window_items_without_a_prepared_loader_or_a_window(clean_env):
    accel = Accelerator(
        backend="single", gradient_accumulation_steps=2, count_items=gradsync.count_label_tokens
    )
    model = accel.prepare(make_model())
    with pytest.raises(RuntimeError, match="known once a window fed by a prepared dataloader"):
        accel.window_items  # noqa: B018
    with accel.accumulate(model):
        with pytest.raises(RuntimeError, match="iterate a loader returned by accel.prepare"):
            accel.backward(model(torch.randn(2, 8)).sum(), reduction="normalized")
    with pytest.raises(RuntimeError, match=r"outside `with accel.accumulate\(model\):`"):
        accel.backward(model(torch.randn(2, 8)).sum(), reduction="sum")


def test_count_items_from_the_environment_as_module_and_function(clean_env):
    clean_env.setenv("GRADSYNC_COUNT_ITEMS", "gradsync:count_label_tokens")
    accel = Accelerator(backend="single")
    assert accel.config.count_items is gradsync.count_label_tokens
    with pytest.raises(ConfigError, match="count_items='nope' must be a callable"):
        Accelerator(backend="single", count_items="nope")


def test_metrics_in_one_process_are_the_identity(clean_env):
    accel = Accelerator(backend="single")
    data = {"a": torch.arange(3.0), "b": [torch.tensor(2.0)]}
    assert torch.equal(accel.gather(data)["a"], data["a"])
    assert accel.gather(data)["b"][0].tolist() == [2.0]
    assert float(accel.reduce(torch.tensor(3), "mean")) == 3.0
    assert torch.equal(accel.pad_across_processes(data["a"]), data["a"])
    with pytest.raises(ConfigError, match="median"):
        accel.reduce(data, "median")
    with pytest.raises(TypeError, match="not a str"):
        accel.gather("text")
    with accel.main_process_first():
        pass
    assert accel.is_local_main_process
