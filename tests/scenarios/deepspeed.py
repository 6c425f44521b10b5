"""DeepSpeed scenarios, run by mp_worker.py inside one 2-rank audited gloo group."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from gradsync import Accelerator, audit

from scenarios.common import (
    Indexed,
    captured_log,
    make_model,
    make_optimizer,
    make_scheduler,
    to_lists,
    train,
)


def setup_process_group() -> None:
    """The audited gloo group DeepSpeed adopts; no C++ op builds on the CPU."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    audit.register()
    dist.init_process_group(audit.AUDIT_BACKEND["cpu"], timeout=timedelta(seconds=180))
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


class CastIO(nn.Module):
    """Feeds the model inputs in its parameter dtype and returns fp32 (for bf16 runs)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = next(self.net.parameters()).dtype
        return self.net(x.to(dtype)).float()


def ds_config(stage: int, **extra: Any) -> dict[str, Any]:
    return {"zero_optimization": {"stage": stage}, "steps_per_print": 10**9, "wall_clock_breakdown": False,
            **extra}


def train_ds(*, stage: int, steps: int, policy: str = "auto", mixed_precision: str = "no",
             ds_extra: dict[str, Any] | None = None, budget: int | None = None,
             checkpointing: Any = None, compile: bool | None = None,
             **kwargs: Any) -> dict[str, Any]:
    accel = Accelerator(backend="deepspeed", gradient_accumulation_steps=steps, sync_policy=policy,
                        seed=0, audit=True, mixed_precision=mixed_precision,
                        deepspeed_config=ds_config(stage, **(ds_extra or {})),
                        sync_memory_budget=budget, activation_checkpointing=checkpointing,
                        compile=compile)
    if mixed_precision == "bf16":
        kwargs["model"] = CastIO(make_model())
    model = kwargs.setdefault("model", make_model())
    assert accel.audit is not None
    start = len(accel.audit.records)
    with captured_log() as logged:
        out = train(accel, **kwargs)
    out["stage"] = stage
    out["reason"] = accel.sync_policy_reason
    out["logged"] = [m for m in logged if "sync_policy" in m]
    # modules whose forward gradsync made recompute in backward (activation_checkpointing)
    out["checkpointed"] = sorted(type(m).__name__ for m in model.modules()
                                 if getattr(m, "_gradsync_checkpointed", False))
    # each collective with its payload, per micro-step (the audit dicts keep only totals)
    out["audit_ops"] = [[list(op) for op in rec.ops] for rec in accel.audit.records[start:]]
    return out


def step_after_block(*, stage: int, steps: int, samples: int, micro_batch: int, policy: str = "auto",
                     epochs: int = 2, optimizer: str = "sgd", lr: float = 0.05,
                     clip: float | None = None) -> dict[str, Any]:
    """The loop with clip / optimizer.step() / scheduler.step() / zero_grad() AFTER the
    accumulate block: ``accel.sync_gradients`` keeps the last micro-step's decision there."""
    accel = Accelerator(backend="deepspeed", gradient_accumulation_steps=steps, sync_policy=policy,
                        seed=0, deepspeed_config=ds_config(stage))
    model = make_model()
    opt = make_optimizer(model.parameters(), optimizer, lr)
    sched = make_scheduler(opt)
    loader = DataLoader(Indexed(samples), batch_size=micro_batch, shuffle=True)
    model, opt, loader, sched = accel.prepare(model, opt, loader, sched)
    windows: list[list[list[int]]] = []
    current: list[list[int]] = []
    sizes: list[int] = []
    norms: list[float] = []
    after_block_sync: list[bool] = []
    set_inside: list[bool] = []  # the engine's boundary flag is gradsync's decision in the block
    restored: list[bool] = []  # and back to its prior value after it
    for _ in range(epochs):
        for x, y, idx in loader:
            prior = model.is_gradient_accumulation_boundary()
            with accel.accumulate(model):
                accel.backward(F.mse_loss(model(x), y))
                current.append([int(i) for i in idx])
                assert accel.micro_step is not None
                boundary, size = accel.sync_gradients, accel.micro_step.size
                set_inside.append(model.is_gradient_accumulation_boundary() == boundary)
            after_block_sync.append(accel.sync_gradients == boundary)
            restored.append(model.is_gradient_accumulation_boundary() == prior)
            if clip is not None:
                norm = accel.clip_grad_norm_(model.parameters(), clip)
                if norm is not None:
                    norms.append(float(norm))
            opt.step()
            sched.step()
            opt.zero_grad()
            if boundary:  # the window's truth, taken inside the block
                sizes.append(size)
                windows.append(current)
                current = []
    return {"state": to_lists(accel.get_state_dict(model)), "windows": windows, "sizes": sizes,
            "norms": norms, "optimizer_steps": accel.optimizer_steps,
            "scheduler_last_epoch": int(sched.last_epoch), "policy": accel.sync_policy,
            "sync_kept_after_block": all(after_block_sync), "flag_set_inside": all(set_inside),
            "flag_restored": all(restored)}


def _expect_error(fn: Any) -> str:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def config_errors() -> dict[str, str]:
    """Contradicting or incomplete configs fail in prepare(), before deepspeed.initialize."""
    def prepare(steps: int, ds: dict[str, Any], with_loader: bool = True, **kw: Any) -> None:
        accel = Accelerator(backend="deepspeed", gradient_accumulation_steps=steps,
                            deepspeed_config=ds, **kw)
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
            lambda: Accelerator(backend="deepspeed", sync_policy="every_step",
                                deepspeed_config=ds_config(1))),
    }
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
    accel = Accelerator(backend="deepspeed", gradient_accumulation_steps=2, seed=0,
                        deepspeed_config=ds_config(stage, optimizer={"type": "Adam", "params": {"lr": 0.01}}))
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
    return {"changed": max(float((after[k] - before[k]).abs().max()) for k in after),
            "optimizer_steps": accel.optimizer_steps,
            "basic": type(model.basic_optimizer).__name__}


def mid_window_save() -> dict[str, Any]:
    from scenarios.common import mid_window_save_refused

    return mid_window_save_refused(Accelerator(backend="deepspeed", gradient_accumulation_steps=4,
                                               deepspeed_config=ds_config(2)))


def export_model(*, stage: int) -> dict[str, Any]:
    from scenarios.common import export_model as export

    return export(Accelerator(backend="deepspeed", gradient_accumulation_steps=4,
                              deepspeed_config=ds_config(stage)))
