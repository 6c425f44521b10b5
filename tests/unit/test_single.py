"""The Accelerator in one process (backend "single"): semantics without a process group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

from gradsync import Accelerator, ConfigError
from gradsync._core.wrappers import PreparedScheduler

from harness.checks import max_diff, reference
from scenarios.common import Indexed, Loop, make_model, train


def accel(clean_env, **kwargs) -> Accelerator:
    return Accelerator(backend="single", seed=0, **kwargs)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_equivalence_with_plain_training(clean_env, k):
    r = train(accel(clean_env, gradient_accumulation_steps=k), Loop(samples=22, micro_batch=2))
    ref = reference([r], samples=22)
    assert max_diff(r["state"], ref["state"]) < 1e-6
    per_epoch = [k] * (11 // k) + ([11 % k] if 11 % k else [])
    assert r["sizes"] == per_epoch * 2
    assert r["scheduler_last_epoch"] == r["optimizer_steps"] == len(per_epoch) * 2


def test_partial_window_is_weighted_by_its_own_size(clean_env):
    """Scaling the last 3 micro-batches of a k=4 window by 1/4 would shrink that update."""
    r = train(
        accel(clean_env, gradient_accumulation_steps=4),
        Loop(samples=14, micro_batch=2, epochs=1, shuffle=False),
    )
    assert r["sizes"] == [4, 3]
    ref = reference([r], samples=14)
    assert max_diff(r["state"], ref["state"]) < 1e-6


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.data = Indexed(n)

    def __iter__(self):
        for i in range(len(self.data)):
            yield self.data[i]


def test_unsized_loader_knows_its_partial_last_window(clean_env):
    a = accel(clean_env, gradient_accumulation_steps=4)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Stream(14), batch_size=2)
    model, opt, loader = a.prepare(model, opt, loader)
    seen = []
    for x, y, _ in loader:
        with a.accumulate(model):
            a.backward(F.mse_loss(model(x), y))
            seen.append((a.micro_step.size, a.sync_gradients))
            opt.step()
            opt.zero_grad()
    assert seen == [(4, False)] * 3 + [(4, True)] + [(3, False)] * 2 + [(3, True)]


def test_gated_calls_do_nothing_off_the_boundary(clean_env):
    a = accel(clean_env, gradient_accumulation_steps=2)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = a.prepare(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(2, 8), torch.randn(2, 1)
    with a.accumulate(model):
        a.backward(F.mse_loss(model(x), y))
        assert not a.sync_gradients
        assert a.clip_grad_norm_(model.parameters(), 1.0) is None
        opt.step()
        opt.zero_grad()
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert all(p.grad is not None for p in model.parameters()), "zero_grad cleared a window"
    with a.accumulate(model):
        opt.zero_grad()  # the top-of-loop order: must not drop the first micro-batch's gradient
        a.backward(F.mse_loss(model(x), y))
        assert a.sync_gradients
        assert isinstance(a.clip_grad_norm_(model.parameters(), 1e9), torch.Tensor)
        opt.step()
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert a.optimizer_steps == 1


def test_backward_outside_accumulate(clean_env):
    a = accel(clean_env, gradient_accumulation_steps=4)
    model = a.prepare(make_model())
    loss = F.mse_loss(model(torch.randn(2, 8)), torch.randn(2, 1))
    with pytest.raises(
        RuntimeError,
        match=r"outside `with accel.accumulate\(model\):` while gradient_accumulation_steps=4",
    ):
        a.backward(loss)
    b = accel(clean_env)  # k = 1: plain backward is fine
    b.backward(F.mse_loss(model(torch.randn(2, 8)), torch.randn(2, 1)))


def test_ddp_without_a_process_group_names_the_fix(clean_env):
    with pytest.raises(
        RuntimeError, match="needs a process group.*gradsync launch --nproc-per-node"
    ):
        Accelerator(backend="ddp")


def test_reads_the_launcher_environment(clean_env):
    clean_env.setenv("GRADSYNC_BACKEND", "single")
    clean_env.setenv("GRADSYNC_GRADIENT_ACCUMULATION_STEPS", "3")
    a = Accelerator()
    assert (a.backend, a.gradient_accumulation_steps, a.world_size, a.rank) == ("single", 3, 1, 0)
    assert a.is_main_process and a.device == torch.device("cpu")


def test_auto_is_single_in_one_process(clean_env):
    assert Accelerator().backend == "single"


def test_dataloader_batch_size_must_match_the_plan(clean_env):
    a = accel(clean_env, micro_batch_size=4, gradient_accumulation_steps=2)
    with pytest.raises(ConfigError, match="batch_size=2 contradicts micro_batch_size=4"):
        a.prepare(DataLoader(Indexed(8), batch_size=2))


def test_prepare_returns_in_order_and_rejects_unknown(clean_env):
    a = accel(clean_env)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    loader = DataLoader(Indexed(4), batch_size=2)
    out = a.prepare(loader, sched, model, opt)
    assert out[2] is model and len(out[1].get_last_lr()) == 1 and len(out[0]) == 2
    with pytest.raises(ConfigError, match="does not know what to do with a str"):
        a.prepare("model.pt")
    with pytest.raises(ConfigError, match="belong to no model prepared"):
        a.prepare(torch.optim.SGD(make_model().parameters(), lr=0.1))


def test_scheduler_does_not_step_when_the_optimizer_step_was_skipped():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    applied = [0]
    sched = PreparedScheduler(
        torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), lambda: applied[0]
    )
    sched.step()  # no optimizer step applied yet (e.g. an fp16 overflow skipped it)
    assert sched.get_last_lr() == [1.0]
    applied[0] += 1
    sched.step()
    sched.step()  # a second call for the same optimizer step does nothing
    assert sched.get_last_lr() == [0.5]


def test_every_window_starts_from_cleared_gradients_without_a_prepared_optimizer(clean_env):
    """Only the model is prepared (the update is the user's own): the gradients at the end of
    window 2 are window 2's alone, as one process computing its mean loss gets them."""
    acc = accel(clean_env, gradient_accumulation_steps=2)
    model = acc.prepare(make_model())
    data = Indexed(8)
    batches = [[0, 1], [2, 3], [4, 5], [6, 7]]
    for ids in batches:
        with acc.accumulate(model):
            acc.backward(F.mse_loss(model(data.x[ids]), data.y[ids]))
    ref = make_model()
    loss = sum(F.mse_loss(ref(data.x[ids]), data.y[ids]) for ids in batches[2:]) / 2
    loss.backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-7)
