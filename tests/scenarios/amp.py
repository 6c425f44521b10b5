"""fp16 / bf16 and activation checkpointing scenarios (ddp and fsdp), run by mp_worker.py in
one 2-rank audited gloo group (the one-process fp16 reference is ``harness.checks.reference_amp``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from gradsync import Accelerator

from scenarios.common import Loop, Probe, make_model, train


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


class Overflows(Probe):
    """fp16 in the shared loop: one rank overflows, at the boundary of ``poison_window`` (an
    inf written into its reduced gradient, which only it sees), or in the 2nd micro-step of
    ``spike_window`` (a loss spike, its backward overflows fp16, off the boundary); records
    the forward's dtypes and, per window, whether the step was skipped and the scale."""

    def __init__(
        self, poison_window: int | None, spike_window: int | None, poison_rank: int
    ) -> None:
        self.poison_window, self.spike_window, self.poison_rank = (
            poison_window,
            spike_window,
            poison_rank,
        )
        self.dtypes: set[str] = set()
        self.skipped: list[bool] = []
        self.scales: list[float] = []

    def forward(self, out: torch.Tensor) -> None:
        self.dtypes.add(str(out.dtype))

    def loss(self, loss: torch.Tensor, accel: Any, window: int, micro: int) -> torch.Tensor:
        spike = window == self.spike_window and micro == 1 and dist.get_rank() == self.poison_rank
        return loss * (1e9 if spike else 1.0)

    def after_backward(self, accel: Any, model: nn.Module, window: int) -> None:
        if (
            accel.sync_gradients
            and window == self.poison_window
            and dist.get_rank() == self.poison_rank
        ):
            poison(model)

    def window_end(self, accel: Any) -> None:
        self.skipped.append(accel.optimizer_step_was_skipped)
        self.scales.append(accel.scaler.get_scale() if accel.scaler is not None else 1.0)

    def finish(self, accel: Any, model: nn.Module, scheduler: Any) -> dict[str, Any]:
        with accel.autocast():
            eval_dtype = str(model(torch.randn(2, 8)).dtype)
        return {
            "skipped": self.skipped,
            "scales": self.scales,
            "dtypes": sorted(self.dtypes),
            "eval_dtype": eval_dtype,
            "last_lrs": [float(v) for v in scheduler.get_last_lr()],
            "scaler_state": accel.scaler.state_dict() if accel.scaler is not None else None,
        }


def train_amp(
    *,
    backend: str,
    steps: int,
    loop: Loop,
    mixed_precision: str = "fp16",
    policy: str = "auto",
    poison_window: int | None = None,
    spike_window: int | None = None,
    poison_rank: int = 1,
    grad_scaler: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The user's fp16 (or bf16) loop: ``train`` with the ``Overflows`` probe."""
    accel = Accelerator(
        backend=backend,
        gradient_accumulation_steps=steps,
        sync_policy=policy,
        seed=0,
        audit=True,
        mixed_precision=mixed_precision,
        grad_scaler=grad_scaler,
    )
    return train(accel, loop, probe=Overflows(poison_window, spike_window, poison_rank))


def train_checkpointed(
    *, backend: str, steps: int, checkpointing: list[str] | None, loop: Loop, policy: str = "auto"
) -> dict[str, Any]:
    """fp32 training with activation checkpointing (or None), and the bytes one micro-step
    keeps for backward."""
    accel = Accelerator(
        backend=backend,
        gradient_accumulation_steps=steps,
        sync_policy=policy,
        seed=0,
        audit=True,
        activation_checkpointing=checkpointing,
    )
    out = train(accel, loop)
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

    catch(
        "unknown_class",
        lambda: Accelerator(backend=backend, activation_checkpointing=["Transformer"]).prepare(
            make_model()
        ),
    )
    wrapped = Accelerator(backend=backend).prepare(make_model())
    catch(
        "wrapped",
        lambda: Accelerator(
            backend=backend, activation_checkpointing=["Block"], compile=True
        ).prepare(wrapped),
    )
    fp16 = Accelerator(backend=backend, mixed_precision="fp16")
    catch("user_scaler", lambda: fp16.prepare(make_model(), torch.amp.GradScaler("cpu")))
    dist.barrier()
    return messages
