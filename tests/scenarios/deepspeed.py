"""DeepSpeed scenarios, run by mp_worker.py inside one 2-rank audited gloo group."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from gradsync import Accelerator

from scenarios.common import DEEPSPEED_PRELOAD as PRELOAD  # noqa: F401  (mp_worker.py)
from scenarios.common import (
    Indexed,
    Loop,
    Probe,
    captured_log,
    make_model,
    make_optimizer,
    train,
)


class CastIO(nn.Module):
    """Feeds the model inputs in its parameter dtype and returns fp32 (for bf16 runs)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = next(self.net.parameters()).dtype
        return self.net(x.to(dtype)).float()


def ds_config(stage: int, **extra: Any) -> dict[str, Any]:
    return {
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        **extra,
    }


def train_ds(
    *,
    stage: int,
    steps: int | str,
    loop: Loop,
    policy: str = "auto",
    mixed_precision: str = "no",
    ds_extra: dict[str, Any] | None = None,
    budget: int | None = None,
    checkpointing: list[str] | None = None,
    compile: bool | None = None,
) -> dict[str, Any]:
    accel = Accelerator(
        backend="deepspeed",
        gradient_accumulation_steps=steps,
        sync_policy=policy,
        seed=0,
        audit=True,
        mixed_precision=mixed_precision,
        deepspeed_config=ds_config(stage, **(ds_extra or {})),
        sync_memory_budget=budget,
        activation_checkpointing=checkpointing,
        compile=compile,
    )
    model = CastIO(make_model()) if mixed_precision == "bf16" else make_model()
    assert accel.audit is not None
    start = len(accel.audit.records)
    with captured_log() as logged:
        out = train(accel, loop, model=model)
    out["stage"] = stage
    out["reason"] = accel.sync_policy_reason
    out["logged"] = [m for m in logged if "sync_policy" in m]
    # modules whose forward gradsync made recompute in backward (activation_checkpointing)
    out["checkpointed"] = sorted(
        type(m).__name__ for m in model.modules() if getattr(m, "_gradsync_checkpointed", False)
    )
    # each collective with its payload, per micro-step (the audit dicts keep only totals)
    out["audit_ops"] = [[list(op) for op in rec.ops] for rec in accel.audit.records[start:]]
    return out


class BoundaryFlag(Probe):
    """The engine's own boundary flag around each block: gradsync's decision inside it, its
    prior value after it; ``accel.sync_gradients`` and the window's size as the block saw
    them, against what is read after it."""

    def __init__(self) -> None:
        self.prior = False
        self.inside: tuple[bool, int] = (False, 0)
        self.set_inside: list[bool] = []
        self.restored: list[bool] = []
        self.after_block_sync: list[bool] = []
        self.window_sizes: list[int] = []

    def before_block(self, accel: Any, model: nn.Module) -> None:
        self.prior = model.is_gradient_accumulation_boundary()

    def after_backward(self, accel: Any, model: nn.Module, window: int) -> None:
        assert accel.micro_step is not None
        self.inside = (accel.sync_gradients, accel.micro_step.size)
        self.set_inside.append(model.is_gradient_accumulation_boundary() == self.inside[0])

    def after_block(self, accel: Any, model: nn.Module) -> None:
        boundary, size = self.inside
        self.after_block_sync.append(accel.sync_gradients == boundary)
        self.restored.append(model.is_gradient_accumulation_boundary() == self.prior)
        if boundary:  # the window's truth, taken inside the block
            self.window_sizes.append(size)

    def finish(self, accel: Any, model: nn.Module, scheduler: Any) -> dict[str, Any]:
        return {
            "sync_kept_after_block": all(self.after_block_sync),
            "flag_set_inside": all(self.set_inside),
            "flag_restored": all(self.restored),
            "window_sizes": self.window_sizes,
        }


def step_after_block(*, stage: int, steps: int, loop: Loop, policy: str = "auto") -> dict[str, Any]:
    """The loop with clip / optimizer.step() / scheduler.step() / zero_grad() AFTER the
    accumulate block (``Loop(calls="after_block")``): ``accel.sync_gradients`` keeps the
    last micro-step's decision there."""
    accel = Accelerator(
        backend="deepspeed",
        gradient_accumulation_steps=steps,
        sync_policy=policy,
        seed=0,
        deepspeed_config=ds_config(stage),
    )
    return train(accel, replace(loop, calls="after_block"), probe=BoundaryFlag())


def _expect_error(fn: Any) -> str:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def config_errors() -> dict[str, str]:
    """Contradicting or incomplete configs fail in prepare(), before deepspeed.initialize."""

    def prepare(steps: int, ds: dict[str, Any], with_loader: bool = True, **kw: Any) -> None:
        accel = Accelerator(
            backend="deepspeed", gradient_accumulation_steps=steps, deepspeed_config=ds, **kw
        )
        model = make_model()
        opt = make_optimizer(model.parameters(), "sgd", 0.1)
        loader = DataLoader(Indexed(8), batch_size=2)
        if with_loader:
            accel.prepare(model, opt, loader)
        else:
            accel.prepare(model, opt)

    out = {
        "gas": _expect_error(lambda: prepare(4, ds_config(0, gradient_accumulation_steps=8))),
        "train_batch": _expect_error(lambda: prepare(4, ds_config(0, train_batch_size=32))),
        "micro": _expect_error(lambda: prepare(4, ds_config(0, train_micro_batch_size_per_gpu=4))),
        "no_micro": _expect_error(lambda: prepare(4, ds_config(0), with_loader=False)),
        "every_step_stage1": _expect_error(
            lambda: Accelerator(
                backend="deepspeed", sync_policy="every_step", deepspeed_config=ds_config(1)
            )
        ),
    }

    def two_models(shared: bool) -> None:
        accel = Accelerator(backend="deepspeed", deepspeed_config=ds_config(0), micro_batch_size=2)
        a, b = make_model(), make_model(1)
        if shared:  # one optimizer over two engines
            accel.prepare(a, b, make_optimizer([*a.parameters(), *b.parameters()], "sgd", 0.1))
        else:  # two optimizers for one engine
            accel.prepare(
                a,
                make_optimizer(a.blocks.parameters(), "sgd", 0.1),
                make_optimizer(a.head.parameters(), "sgd", 0.1),
            )

    out["one_optimizer_two_models"] = _expect_error(lambda: two_models(True))
    out["two_optimizers_one_model"] = _expect_error(lambda: two_models(False))
    # "auto" and matching values are accepted; prepare without a loader works given micro_batch_size
    ok_ds = ds_config(0, gradient_accumulation_steps="auto", train_batch_size=16)
    out["auto_ok"] = _expect_error(lambda: prepare(4, ok_ds, with_loader=False, micro_batch_size=2))
    return out


def clip_twice() -> dict[str, str]:
    """A second clip_grad_norm_ with another max_norm is an error (DeepSpeed has one value)."""
    accel = Accelerator(backend="deepspeed", deepspeed_config=ds_config(2), micro_batch_size=2)
    model = make_model()
    model, opt = accel.prepare(model, make_optimizer(model.parameters(), "sgd", 0.1))
    x, y = torch.randn(2, 8), torch.randn(2, 1)
    out = {}
    with accel.accumulate(model):
        accel.backward(torch.nn.functional.mse_loss(model(x), y))
        out["first"] = str(float(accel.clip_grad_norm_(model.parameters(), 0.5)))
        out["second"] = _expect_error(lambda: accel.clip_grad_norm_(model.parameters(), 2.0))
        opt.step()
    return out


def config_optimizer(*, stage: int) -> dict[str, Any]:
    """No torch optimizer: the config's optimizer section (torch Adam on the CPU) is used."""
    accel = Accelerator(
        backend="deepspeed",
        gradient_accumulation_steps=2,
        seed=0,
        deepspeed_config=ds_config(stage, optimizer={"type": "Adam", "params": {"lr": 0.01}}),
    )
    model = make_model()
    loader = DataLoader(Indexed(16), batch_size=2)
    model, loader = accel.prepare(model, loader)
    before = {k: v.clone() for k, v in accel.get_state_dict(model).items()}
    opt = accel.optimizer
    for x, y, _ in loader:
        with accel.accumulate(model):
            accel.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    after = accel.get_state_dict(model)
    return {
        "changed": max(float((after[k] - before[k]).abs().max()) for k in after),
        "optimizer_steps": accel.optimizer_steps,
        "basic": type(model.basic_optimizer).__name__,
    }


def mid_window_save() -> dict[str, Any]:
    from scenarios.common import mid_window_save_refused

    return mid_window_save_refused(
        Accelerator(
            backend="deepspeed", gradient_accumulation_steps=4, deepspeed_config=ds_config(2)
        )
    )


def export_model(*, stage: int) -> dict[str, Any]:
    from scenarios.common import export_model as export

    return export(
        Accelerator(
            backend="deepspeed", gradient_accumulation_steps=4, deepspeed_config=ds_config(stage)
        )
    )
