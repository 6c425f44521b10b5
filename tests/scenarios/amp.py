"""fp16 / bf16 and activation checkpointing scenarios (ddp and fsdp), run by mp_worker.py in
one 2-rank audited gloo group; and the single-process fp16 reference they must match."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from gradsync import Accelerator

from scenarios.common import Indexed, make_model, make_optimizer, make_scheduler, to_lists, train


def saved_bytes(fn: Any) -> tuple[int, Any]:
    """Run ``fn`` and count the bytes autograd keeps for backward (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            t = t.to_local()
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def poison(model: nn.Module) -> None:
    """Put an inf into this rank's first gradient element (this rank's shard on fsdp): an
    overflow only this rank can see."""
    grad = next(model.parameters()).grad
    assert grad is not None
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    local.view(-1)[0] = float("inf")


def train_amp(*, backend: str, steps: int, samples: int, micro_batch: int, epochs: int = 2,
              mixed_precision: str = "fp16", policy: str = "auto", optimizer: str = "sgd",
              lr: float = 0.05, clip: float | None = None, clip_value: float | None = None,
              poison_window: int | None = None, spike_window: int | None = None, poison_rank: int = 1,
              grad_scaler: dict[str, Any] | None = None) -> dict[str, Any]:
    """The user's fp16 loop. One rank overflows: at the boundary of ``poison_window`` (an inf
    written into its reduced gradient, which only it sees), or in the 2nd micro-step of
    ``spike_window`` (a loss spike, its backward overflows fp16, off the boundary)."""
    accel = Accelerator(backend=backend, gradient_accumulation_steps=steps, sync_policy=policy,
                        seed=0, audit=True, mixed_precision=mixed_precision, grad_scaler=grad_scaler)
    model = make_model()
    opt = make_optimizer(model.parameters(), optimizer, lr)
    sched = make_scheduler(opt)
    loader = DataLoader(Indexed(samples), batch_size=micro_batch, shuffle=True)
    model, opt, loader, sched = accel.prepare(model, opt, loader, sched)
    windows: list[list[list[int]]] = []
    current: list[list[int]] = []
    skipped: list[bool] = []
    scales: list[float] = []
    norms: list[float] = []
    dtypes: set[str] = set()
    for _ in range(epochs):
        for x, y, idx in loader:
            with accel.accumulate(model):
                out = model(x)
                dtypes.add(str(out.dtype))
                spike = len(windows) == spike_window and len(current) == 1 and dist.get_rank() == poison_rank
                accel.backward(F.mse_loss(out, y) * (1e9 if spike else 1.0))
                current.append([int(i) for i in idx])
                if accel.sync_gradients and len(windows) == poison_window and dist.get_rank() == poison_rank:
                    poison(model)
                if clip is not None:
                    norm = accel.clip_grad_norm_(model.parameters(), clip)
                    if norm is not None:
                        norms.append(float(norm))
                if clip_value is not None:
                    accel.clip_grad_value_(model.parameters(), clip_value)
                opt.step()
                sched.step()
                opt.zero_grad()
            if accel.sync_gradients:
                windows.append(current)
                current = []
                skipped.append(accel.optimizer_step_was_skipped)
                scales.append(accel.scaler.get_scale() if accel.scaler is not None else 1.0)
    with accel.autocast():
        eval_dtype = str(model(torch.randn(2, 8)).dtype)
    assert accel.audit is not None
    return {
        "state": to_lists(accel.get_state_dict(model)),
        "windows": windows, "skipped": skipped, "scales": scales, "norms": norms,
        "optimizer_steps": accel.optimizer_steps, "scheduler_last_epoch": int(sched.last_epoch),
        "lrs": [float(v) for v in sched.get_last_lr()],
        "audit": [r.to_dict() for r in accel.audit.records], "dtypes": sorted(dtypes),
        "eval_dtype": eval_dtype,
        "scaler_state": accel.scaler.state_dict() if accel.scaler is not None else None,
    }


def reference_amp(rank_results: list[dict[str, Any]], *, samples: int, optimizer: str = "sgd",
                  lr: float = 0.05, clip: float | None = None, clip_value: float | None = None,
                  poison_window: int | None = None, spike_window: int | None = None, poison_rank: int = 1,
                  grad_scaler: dict[str, Any] | None = None) -> dict[str, Any]:
    """One process on the same global windows under the same fp16 autocast and GradScaler:
    each micro-batch's loss divided by the window's micro-batch count, scaled, backward;
    at the window's end unscale, clip, step (skipped on inf/NaN), update."""
    data = Indexed(samples)
    model = make_model()
    opt = make_optimizer(model.parameters(), optimizer, lr)
    sched = make_scheduler(opt)
    scaler = torch.amp.GradScaler("cpu", **(grad_scaler or {}))
    skipped, scales, norms = [], [], []
    for w in range(len(rank_results[0]["windows"])):
        micro = [mb for r in rank_results for mb in r["windows"][w]]
        spiked = sum(len(r["windows"][w]) for r in rank_results[:poison_rank]) + 1
        opt.zero_grad()
        for i, mb in enumerate(micro):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(data.x[mb]), data.y[mb])
            loss = loss * (1e9 if w == spike_window and i == spiked else 1.0)
            scaler.scale(loss / len(micro)).backward()
        if w == poison_window:
            poison(model)
        scaler.unscale_(opt)
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
        if not skipped[-1]:
            sched.step()
        scales.append(scaler.get_scale())
    return {"state": to_lists(model.state_dict()), "skipped": skipped, "scales": scales,
            "norms": norms, "last_epoch": sched.last_epoch}


def train_checkpointed(*, backend: str, steps: int, checkpointing: Any, policy: str = "auto",
                       **kwargs: Any) -> dict[str, Any]:
    """fp32 training with activation checkpointing (or None), and the bytes one micro-step
    keeps for backward."""
    accel = Accelerator(backend=backend, gradient_accumulation_steps=steps, sync_policy=policy,
                        seed=0, audit=True, activation_checkpointing=checkpointing)
    out = train(accel, **kwargs)
    probe = Accelerator(backend=backend, seed=0, activation_checkpointing=checkpointing)
    model = probe.prepare(make_model())
    x, y = torch.randn(2, 8), torch.randn(2, 1)
    with probe.accumulate(model):
        out["saved_bytes"], loss = saved_bytes(lambda: F.mse_loss(model(x), y))
        probe.backward(loss)
    return out


def errors(*, backend: str) -> dict[str, str]:
    """Each bad input of the mixed-precision / checkpointing settings, with its message."""
    messages: dict[str, str] = {}

    def catch(key: str, fn: Any) -> None:
        try:
            fn()
        except (ValueError, RuntimeError) as err:
            messages[key] = f"{type(err).__name__}: {err}"

    catch("unknown_class", lambda: Accelerator(backend=backend, activation_checkpointing=["Transformer"])
          .prepare(make_model()))
    wrapped = Accelerator(backend=backend).prepare(make_model())
    catch("wrapped", lambda: Accelerator(backend=backend, activation_checkpointing=["Block"],
                                         compile=True).prepare(wrapped))
    fp16 = Accelerator(backend=backend, mixed_precision="fp16")
    catch("user_scaler", lambda: fp16.prepare(make_model(), torch.amp.GradScaler("cpu")))
    dist.barrier()
    return messages
