"""Loop shapes and edge cases of the accumulation semantics, in one process (backend "single").

Each test pins down a way a training loop can go wrong silently: an error at the boundary,
calls after the block, epoch-level schedulers, two optimizers, an early break, a wrong len(),
two loaders, a plain loss.backward(), samplers that must not be replaced.
"""

from __future__ import annotations

import collections
import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler

from gradsync import Accelerator
from gradsync.data import BatchShard, shard_dataloader

from harness.checks import max_diff, reference
from scenarios.common import Indexed, Loop, make_model, train


def accel(**kwargs) -> Accelerator:
    return Accelerator(backend="single", seed=0, **kwargs)


def grads(model) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]


def grad_diff(got, want) -> float:
    return max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))


def window_grad(model, batches) -> list[torch.Tensor]:
    """The gradient one window of these micro-batches must produce (mean of their losses)."""
    ref = make_model()
    ref.load_state_dict(model.state_dict())
    loss = sum(F.mse_loss(ref(x), y) for x, y in batches) / len(batches)
    loss.backward()
    return [p.grad for p in ref.parameters()]


def test_calls_after_the_block_step_only_at_the_boundary(clean_env):
    r = train(
        accel(gradient_accumulation_steps=4), Loop(samples=22, micro_batch=2, calls="after_block")
    )
    assert r["optimizer_steps"] == len(r["windows"]) == 6  # 11 batches per epoch: 4, 4, 3
    assert max_diff(r["state"], reference([r], samples=22)["state"]) < 1e-6


def test_an_error_at_the_boundary_drops_the_window(clean_env):
    a = accel(gradient_accumulation_steps=2)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = a.prepare(model, opt)
    data = [(torch.randn(2, 8), torch.randn(2, 1)) for _ in range(4)]
    with a.accumulate(model):
        a.backward(F.mse_loss(model(data[0][0]), data[0][1]))
    with pytest.raises(ValueError, match="bad batch"), a.accumulate(model):
        a.backward(F.mse_loss(model(data[1][0]), data[1][1]))
        raise ValueError("bad batch")
    opt.step()  # a stray step after the error applies nothing
    assert a.optimizer_steps == 0
    assert a.micro_step is None
    for x, y in data[2:]:
        with a.accumulate(model):
            a.backward(F.mse_loss(model(x), y))
            if a.sync_gradients:
                got = grads(model)
    want = window_grad(model, data[2:])
    assert grad_diff(got, want) < 1e-6


def test_plain_loss_backward_accumulates_too(clean_env):
    a = accel(gradient_accumulation_steps=3)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = a.prepare(model, opt)
    data = [(torch.randn(2, 8), torch.randn(2, 1)) for _ in range(3)]
    for x, y in data:
        with a.accumulate(model):
            (F.mse_loss(model(x), y) / 3).backward()
            if a.sync_gradients:
                got = grads(model)
            opt.step()
            opt.zero_grad()
    want = window_grad(make_model(), data)
    assert grad_diff(got, want) < 1e-6
    assert all(p.grad is not None for p in model.parameters()), "gradients stay readable after step"
    with a.accumulate(model):
        assert all(p.grad is None for p in model.parameters()), "a new window starts cleared"


def _loop(a, model, opt, loader, per_epoch=None, epochs=2):
    for _ in range(epochs):
        for x, y, _ in loader:
            with a.accumulate(model):
                a.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        if per_epoch is not None:
            per_epoch()


def test_epoch_level_schedulers(clean_env):
    a = accel(gradient_accumulation_steps=2)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = DataLoader(Indexed(16), batch_size=2)
    model, opt, loader, step_lr = a.prepare(model, opt, loader, step_lr)
    _loop(a, model, opt, loader, per_epoch=step_lr.step, epochs=3)
    assert a.optimizer_steps == 12
    assert step_lr.get_last_lr() == [0.125]  # three epochs, three halvings


def test_reduce_on_plateau_passes_through(clean_env):
    a = accel(gradient_accumulation_steps=2)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.1)
    model, opt, plateau = a.prepare(model, opt, plateau)
    plateau.step(1.0)
    plateau.step(1.0)  # no improvement once: one reduction
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert plateau.num_bad_epochs == 0


def test_two_optimizers_each_drive_their_own_scheduler(clean_env):
    a = accel(gradient_accumulation_steps=2)
    g, d = make_model(0), make_model(1)
    opt_g = torch.optim.SGD(g.parameters(), lr=1.0)
    opt_d = torch.optim.SGD(d.parameters(), lr=1.0)
    sch_g = torch.optim.lr_scheduler.StepLR(opt_g, 1, gamma=0.5)
    sch_d = torch.optim.lr_scheduler.StepLR(opt_d, 1, gamma=0.5)
    g, opt_g, sch_g = a.prepare(g, opt_g, sch_g)
    d, opt_d, sch_d = a.prepare(d, opt_d, sch_d)
    for _ in range(6):
        x, y = torch.randn(2, 8), torch.randn(2, 1)
        with a.accumulate(g):
            a.backward(F.mse_loss(g(x), y) + F.mse_loss(d(x), y))
            for opt, sch in ((opt_g, sch_g), (opt_d, sch_d)):
                opt.step()
                sch.step()
                opt.zero_grad()
    assert a.optimizer_steps == 3  # 3 windows, each optimizer stepping once in each
    assert sch_g.last_epoch == sch_d.last_epoch == 3
    assert sch_g.get_last_lr() == sch_d.get_last_lr() == [0.125]


def test_breaking_out_of_an_epoch_does_not_carry_the_window_over(clean_env, caplog):
    a = accel(gradient_accumulation_steps=4)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Indexed(20), batch_size=2)  # 10 batches
    model, opt, loader = a.prepare(model, opt, loader)
    for i, (x, y, _) in enumerate(loader):
        with a.accumulate(model):
            a.backward(F.mse_loss(model(x), y))
        if i == 5:
            break  # mid-window (index 1 of the second window)
    seen = []
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        for x, y, _ in loader:
            with a.accumulate(model):
                a.backward(F.mse_loss(model(x), y))
                seen.append((a.micro_step.index, a.micro_step.size, a.sync_gradients))
            opt.step()
            opt.zero_grad()
    assert "unfinished accumulation window" in caplog.text
    assert seen[:4] == [(0, 4, False), (1, 4, False), (2, 4, False), (3, 4, True)]
    assert seen[-2:] == [(0, 2, False), (1, 2, True)]
    # and the loader's position does not outlive its loop
    with a.accumulate(model):
        assert a.micro_step.size == 4


class Stream(IterableDataset):
    def __init__(self, n: int, claimed: int | None = None) -> None:
        self.data, self.claimed = Indexed(n), claimed

    def __iter__(self):
        for i in range(len(self.data)):
            yield self.data[i]

    def __len__(self) -> int:
        if self.claimed is None:
            raise TypeError("unsized")
        return self.claimed


def _sizes(a, model, loader, change=None):
    out = []
    for i, (x, y, _) in enumerate(loader):
        if change is not None and i == change[0]:
            a.gradient_accumulation_steps = change[1]
        with a.accumulate(model):
            a.backward(F.mse_loss(model(x), y))
            out.append((a.micro_step.size, a.sync_gradients))
    return out


def test_a_len_that_over_reports_still_flushes(clean_env):
    a = accel(gradient_accumulation_steps=4)
    model = a.prepare(make_model())
    loader = a.prepare(DataLoader(Stream(12, claimed=16), batch_size=2))  # says 8 batches, has 6
    got = _sizes(a, model, loader)
    # len() sizes the windows; reading one batch ahead finds the real end and flushes there
    assert got == [(4, False)] * 3 + [(4, True)] + [(4, False), (2, True)]


def test_raising_k_with_an_unsized_loader_keeps_the_weights_right(clean_env):
    a = accel(gradient_accumulation_steps=2)
    model = a.prepare(make_model())
    loader = a.prepare(DataLoader(Stream(10), batch_size=2))  # 5 batches
    got = _sizes(a, model, loader, change=(2, 4))
    # windows: 2, then the remaining 3 (known when that window starts)
    assert got == [(2, False), (2, True), (3, False), (3, False), (3, True)]


def test_the_outer_of_two_zipped_loaders_drives_the_window(clean_env):
    a = accel(gradient_accumulation_steps=4)
    model = a.prepare(make_model())
    train_loader = a.prepare(DataLoader(Indexed(12), batch_size=2))  # 6 batches
    aux = a.prepare(DataLoader(Indexed(20), batch_size=2))  # 10 batches
    got = []
    for (x, y, _), _aux in zip(train_loader, aux):
        with a.accumulate(model):
            a.backward(F.mse_loss(model(x), y))
            got.append((a.micro_step.size, a.sync_gradients))
    assert got == [(4, False)] * 3 + [(4, True)] + [(2, False), (2, True)]


def test_prepared_loader_exposes_the_loader_and_moves_named_batches(clean_env):
    a = accel()
    loader = a.prepare(DataLoader(Indexed(6), batch_size=2))
    assert len(loader.dataset) == 6 and loader.batch_size == 2
    Pair = collections.namedtuple("Pair", "x y")
    from gradsync.data import to_device as _to_device

    moved = _to_device(Pair(torch.ones(1), {"z": torch.zeros(1)}), torch.device("cpu"))
    assert isinstance(moved, Pair) and isinstance(moved.y, dict)


def test_optimizer_hooks_reach_the_wrapped_optimizer(clean_env):
    a = accel()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = a.prepare(model, opt)
    calls = []
    opt.register_step_post_hook(lambda *args: calls.append(1))
    with a.accumulate(model):
        a.backward(F.mse_loss(model(torch.randn(2, 8)), torch.randn(2, 1)))
        opt.step()
    assert calls == [1]


def test_samplers_are_sharded_or_kept():
    data = Indexed(8)
    weighted = DataLoader(data, batch_size=2, sampler=WeightedRandomSampler([1.0] * 8, 8))
    sharded = shard_dataloader(weighted, rank=0, world_size=2, seed=0)
    assert isinstance(sharded.batch_sampler, BatchShard) and len(sharded) == 2
    own = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=1))
    assert shard_dataloader(own, rank=1, world_size=2, seed=0) is own
    g = torch.Generator()
    plain = DataLoader(data, batch_size=2, shuffle=True, generator=g)
    sharded = shard_dataloader(plain, rank=0, world_size=2, seed=0)
    assert isinstance(sharded.sampler, DistributedSampler) and sharded.generator is g


def test_user_set_epoch_on_the_sampler_is_respected(clean_env):
    a = accel()
    loader = DataLoader(
        Indexed(16),
        batch_size=4,
        sampler=DistributedSampler(Indexed(16), num_replicas=1, rank=0, shuffle=True),
    )
    prepared = a.prepare(loader)
    first = [int(i) for _, _, idx in prepared for i in idx]
    loader.sampler.set_epoch(5)
    fifth = [int(i) for _, _, idx in prepared for i in idx]
    loader.sampler.set_epoch(5)
    again = [int(i) for _, _, idx in prepared for i in idx]
    assert fifth == again != first


def test_bf16_and_fp16_autocast_on_single(clean_env):
    a = accel(mixed_precision="bf16")
    model = a.prepare(make_model())
    with a.accumulate(model):
        assert model(torch.randn(2, 8)).dtype == torch.bfloat16
    assert a.scaler is None
    a = accel(
        mixed_precision="fp16"
    )  # fp16 runs with a loss scaler (tests/unit/test_amp_single.py)
    model = a.prepare(make_model())
    with a.accumulate(model):
        assert model(torch.randn(2, 8)).dtype == torch.float16
    assert a.scaler is not None


def test_audit_is_off_when_the_group_cannot_be_counted(clean_env, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    a = Accelerator(backend="ddp", audit=True)
    assert a.audit is None


def _pattern(a, model, batches):
    out = []
    for x, y, _ in batches:
        with a.accumulate(model):
            a.backward(F.mse_loss(model(x), y))
            step = a.micro_step
            out.append(f"{step.index}/{step.size}{'S' if step.boundary else ''}")
    return out


def test_a_nested_inner_loader_drives_the_window(clean_env):
    a = accel(gradient_accumulation_steps=4)
    model = a.prepare(make_model())
    outer = a.prepare(DataLoader(Indexed(6), batch_size=2))  # 3 tasks
    inner = a.prepare(DataLoader(Indexed(16), batch_size=2))  # 8 batches per task
    for _task in outer:
        assert _pattern(a, model, inner) == ["0/4", "1/4", "2/4", "3/4S"] * 2


def test_two_passes_over_one_loader_do_not_disturb_each_other(clean_env):
    a = accel(gradient_accumulation_steps=4)
    model = a.prepare(make_model())
    loader = a.prepare(DataLoader(Indexed(8), batch_size=2))
    pairs = [(p[2].tolist(), q[2].tolist()) for p, q in zip(loader, loader)]
    assert pairs == [([0, 1], [0, 1]), ([2, 3], [2, 3]), ([4, 5], [4, 5]), ([6, 7], [6, 7])]
    probe = iter(loader)
    next(probe)  # a sample batch, the pass left open
    loader6 = a.prepare(DataLoader(Indexed(12), batch_size=2))
    for _ in range(2):
        assert _pattern(a, model, loader6) == ["0/4", "1/4", "2/4", "3/4S", "0/2", "1/2S"]
    del probe


def test_an_eval_loader_mid_window_does_not_drop_the_training_window(clean_env, caplog):
    a = accel(gradient_accumulation_steps=4)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = a.prepare(model, opt)
    evaluation = a.prepare(DataLoader(Indexed(4), batch_size=2))
    data = [(torch.randn(2, 8), torch.randn(2, 1)) for _ in range(4)]
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        for i, (x, y) in enumerate(data):
            with a.accumulate(model):
                a.backward(F.mse_loss(model(x), y))
                if a.sync_gradients:
                    got = grads(model)
            if i == 1:
                with torch.no_grad():
                    for ex, _, _ in evaluation:
                        model(ex)
    assert "unfinished" not in caplog.text
    want = window_grad(model, data)
    assert grad_diff(got, want) < 1e-6


def test_loader_state_dict_mid_epoch_names_the_epoch_in_progress(clean_env):
    a = accel()
    loader = a.prepare(DataLoader(Indexed(8), batch_size=2))
    list(loader)
    it = iter(loader)
    next(it)
    next(it)
    assert loader.state_dict() == {"epoch": 1, "batches_yielded": 2}


class Broken(Indexed):
    def __getitem__(self, i):
        if i == 5:
            raise OSError("shard unreadable")
        return super().__getitem__(i)


def test_a_loading_error_surfaces_at_its_own_batch(clean_env):
    a = accel(gradient_accumulation_steps=4)
    model = a.prepare(make_model())
    loader = a.prepare(DataLoader(Broken(10), batch_size=1))
    seen = []
    with pytest.raises(OSError, match="shard unreadable"):
        for x, y, idx in loader:
            with a.accumulate(model):
                a.backward(F.mse_loss(model(x), y))
            seen.append(int(idx))
    assert seen == [0, 1, 2, 3, 4]

    class Stream10(IterableDataset):
        def __iter__(self):
            for i in range(10):
                if i == 6:
                    raise OSError("stream broke")
                yield Indexed(10)[i]

    stream = a.prepare(DataLoader(Stream10(), batch_size=1))
    got = []
    with pytest.raises(OSError, match="stream broke"):
        for x, y, idx in stream:
            with a.accumulate(model):  # the window look-ahead must not raise it early
                a.backward(F.mse_loss(model(x), y))
            got.append(int(idx))
    assert got == [0, 1, 2, 3, 4, 5]


def test_gradients_are_readable_after_step_and_stale_ones_never_leak(clean_env):
    a = accel()  # k = 1
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = a.prepare(model, opt)
    x, y = torch.randn(2, 8), torch.randn(2, 1)
    F.mse_loss(model(x), y).backward()  # a sanity-check backward before training
    with a.accumulate(model):
        opt.zero_grad()
        a.backward(F.mse_loss(model(x), y))
        want = window_grad(model, [(x, y)])
        got = grads(model)
        opt.step()
    assert grad_diff(got, want) < 1e-6
    assert all(p.grad is not None for p in model.parameters())


def test_optimizer_methods_that_bypass_the_window_are_refused(clean_env):
    class SAM(torch.optim.SGD):
        def first_step(self):
            pass

    a = accel(gradient_accumulation_steps=2)
    model = make_model()
    model, opt = a.prepare(model, SAM(model.parameters(), lr=0.1))
    with pytest.raises(AttributeError, match="first_step.*not gated"):
        opt.first_step()
    assert isinstance(opt.defaults, dict)


def test_random_sampler_with_replacement_is_sharded_by_batch():
    from torch.utils.data import RandomSampler

    data = Indexed(8)
    ranks = []
    for rank in range(2):
        torch.manual_seed(100 + rank)  # the ranks' global RNGs differ: the sequence must not
        loader = DataLoader(
            data, batch_size=2, sampler=RandomSampler(data, replacement=True, num_samples=40)
        )
        ranks.append(
            [b[2].tolist() for b in shard_dataloader(loader, rank=rank, world_size=2, seed=0)]
        )
    assert len(ranks[0]) == len(ranks[1]) == 10
    torch.manual_seed(7)
    again = DataLoader(
        data, batch_size=2, sampler=RandomSampler(data, replacement=True, num_samples=40)
    )
    assert [b[2].tolist() for b in shard_dataloader(again, rank=0, world_size=2, seed=0)] == ranks[
        0
    ]
