"""fairscale (ShardedDataParallel + OSS) scenarios, run by mp_worker.py in one 2-rank gloo group
(fairscale is imported where a scenario needs it: the module imports without it)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from gradsync import Accelerator

from scenarios.common import Dropped, Indexed, Loop, make_model, make_optimizer, train

#: fairscale_kwargs that turn ShardedDataParallel's reduce buckets off: each gradient is then
#: reduced on its own and dropped (set to None) on the ranks that do not own it.
NO_BUCKETS = {"reduce_buffer_size": 0}


def _accel(steps: int, policy: str = "auto", buckets: bool = True, **options: Any) -> Accelerator:
    if not buckets:
        options["fairscale_kwargs"] = NO_BUCKETS
    return Accelerator(
        backend="fairscale",
        gradient_accumulation_steps=steps,
        sync_policy=policy,
        seed=0,
        audit=True,
        **options,
    )


def train_fs(
    *,
    steps: int,
    loop: Loop,
    policy: str = "auto",
    buckets: bool = True,
    mixed_precision: str = "no",
) -> dict[str, Any]:
    accel = _accel(steps, policy, buckets, mixed_precision=mixed_precision)
    out = train(accel, loop)
    out["reason"] = accel.sync_policy_reason
    return out


def _lists(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().float().tolist()
    if isinstance(value, dict):
        return {str(k): _lists(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_lists(v) for v in value]
    return value


def optimizer_state(*, steps: int, loop: Loop) -> dict[str, Any]:
    """Train, then read the consolidated optimizer state (on every rank), load it into a
    fresh OSS and read that back."""
    accel = _accel(steps)
    out = train(accel, loop)
    full = accel.optimizer.state_dict()
    opt = accel.optimizer.optimizer
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    out["held"] = sorted(index[id(p)] for p in opt.optim.state)  # this rank's shard
    out["consolidated"] = _lists(full["state"])
    out["lr"] = full["param_groups"][0]["lr"]
    fresh = _accel(steps)
    model = make_model(1)
    _, opt2 = fresh.prepare(model, make_optimizer(model.parameters(), loop.optimizer, 0.5))
    opt2.load_state_dict(full)
    out["intact_after_load"] = len(full["state"]) == len(out["consolidated"]) and all(
        full["state"].values()
    )
    out["reloaded"] = _lists(opt2.state_dict()["state"])
    out["reloaded_lr"] = opt2.param_groups[0]["lr"]
    return out


def misuse() -> dict[str, str]:
    """Each misuse raises a clear error; returns the messages, prefixed with the error type."""
    from fairscale.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
    from fairscale.optim import OSS

    messages: dict[str, str] = {}

    def catch(key: str, fn: Any) -> None:
        try:
            fn()
        except Exception as err:
            messages[key] = f"{type(err).__name__}: {err}"

    def prepared(steps: int) -> tuple[Accelerator, Any]:
        accel = _accel(steps)
        raw = make_model()
        return accel, accel.prepare(raw, make_optimizer(raw.parameters(), "sgd", 0.1))[0]

    def unprepared() -> None:
        accel, _ = prepared(4)
        with accel.accumulate(make_model()):
            pass

    def clip_subset() -> None:
        accel, model = prepared(1)
        x, y, _ = next(iter(DataLoader(Indexed(4), batch_size=2)))
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(x), y))
            accel.clip_grad_norm_(list(model.parameters())[:2], 1.0)

    def given(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        _accel(4).prepare(model, optimizer)

    catch("unprepared", unprepared)
    catch("clip_subset", clip_subset)
    catch("no_optimizer", lambda: _accel(4).prepare(make_model()))
    plain = make_model()
    catch("oss", lambda: given(plain, OSS(plain.parameters(), optim=torch.optim.SGD, lr=0.1)))
    inner = make_model()
    catch(
        "sdp",
        lambda: given(
            ShardedDataParallel(inner, OSS(inner.parameters(), lr=0.1)),
            make_optimizer(inner.parameters(), "sgd", 0.1),
        ),
    )
    used = make_model()
    used_opt = make_optimizer(used.parameters(), "adam", 0.1)
    F.mse_loss(used(torch.randn(2, 8)), torch.randn(2, 1)).backward()
    used_opt.step()
    catch("optimizer_with_state", lambda: given(used, used_opt))
    # fairscale's FSDP builds on the CPU (its forward needs CUDA); nested inside a model.
    nested = torch.nn.Sequential(FullyShardedDataParallel(make_model()))
    catch("fairscale_fsdp", lambda: given(nested, make_optimizer(nested.parameters(), "sgd", 0.1)))
    return messages


def grads_stay_in_buckets(*, steps: int) -> dict[str, Any]:
    """After gradsync's window clears (zero_grad at the window start, twice per window of
    the loop), every bucketed gradient is still a view of ShardedDataParallel's reduce
    bucket: zeroing in place kept them there."""
    accel = _accel(steps)
    out = train(accel, Loop(samples=40, micro_batch=2, epochs=1))  # windows of 4, 4, 2
    model = accel._prepared.models[-1]
    bucket_storages = {b.buffer.untyped_storage().data_ptr() for b in model._bucket_list}
    out["bucketed"] = sum(model._should_bucket_grad)
    out["in_bucket"] = sum(
        1
        for p in model.module.parameters()
        if p.grad is not None and p.grad.untyped_storage().data_ptr() in bucket_storages
    )
    out["params"] = len(list(model.module.parameters()))
    return out


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises on the ``fail_at``-th backward pass (1-based)."""

    calls = 0
    fail_at = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _FailingBackward.calls += 1
        if _FailingBackward.calls == _FailingBackward.fail_at:
            raise Dropped
        return grad


def drop_in_backward(
    *, steps: int, fail_at: int, loop: Loop, policy: str = "auto", buckets: bool = True
) -> dict[str, Any]:
    """The backward of the ``fail_at``-th micro-step raises half-way (after the head's and the
    blocks' gradients, before the input layer's), on every rank: a window whose reduction
    was only partly issued is dropped."""
    _FailingBackward.calls, _FailingBackward.fail_at = 0, fail_at
    model = make_model()
    model.inp.register_forward_hook(lambda module, args, out: _FailingBackward.apply(out))
    return train(_accel(steps, policy, buckets), loop, model=model)


def abort_clears_the_window(*, buckets: bool) -> dict[str, Any]:
    """The adapter's abort_window alone (not the optimizer's zero_grad that follows it in
    the Accelerator) leaves no gradient of the window behind."""
    accel = _accel(4, "defer", buckets)
    raw = make_model()
    model, _ = accel.prepare(raw, make_optimizer(raw.parameters(), "sgd", 0.1))
    loader = DataLoader(Indexed(16), batch_size=2)
    for _, (x, y, _) in zip(range(2), loader):
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(x), y))
    before = sum(float(p.grad.abs().sum()) for p in raw.parameters() if p.grad is not None)
    accel._backend.abort_window([model])
    after = sum(float(p.grad.abs().sum()) for p in raw.parameters() if p.grad is not None)
    return {"before": before, "after": after}


def mid_window_save() -> dict[str, Any]:
    from scenarios.common import mid_window_save_refused

    return mid_window_save_refused(_accel(4))


def export_model() -> dict[str, Any]:
    from scenarios.common import export_model as export

    return export(_accel(4))
