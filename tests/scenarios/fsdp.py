"""FSDP2 (and FSDP1) scenarios, run by mp_worker.py inside one 2-rank audited gloo group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

from gradsync import Accelerator
from gradsync.backends._fsdp_compat import param_groups

from scenarios.common import Block, Loop, captured_log, make_model, make_optimizer, train


def _accel(steps: int, policy: str = "auto", **options: Any) -> Accelerator:
    options = {k: v for k, v in options.items() if v is not None}
    return Accelerator(
        backend="fsdp",
        gradient_accumulation_steps=steps,
        sync_policy=policy,
        seed=0,
        audit=True,
        **options,
    )


def _units(model: nn.Module) -> int:
    """Sharded units that hold parameters (each reduce-scatters once per reduction)."""
    return sum(1 for _ in param_groups(model))


def grad_bytes(model: nn.Module) -> dict[str, int]:
    """Gradient bytes this rank holds: FSDP2's unsharded (deferred) and sharded gradients."""
    unsharded = sharded = 0
    for group in param_groups(model):
        for fp in group.fsdp_params:
            up = getattr(fp, "_unsharded_param", None)
            # torch 2.15 on: the accumulated gradient is a view of the leaf's, one tensor
            held = {
                id(t): t
                for t in (fp.unsharded_accumulated_grad, getattr(up, "grad", None))
                if t is not None
            }
            unsharded += sum(t.numel() * t.element_size() for t in held.values())
            g = fp.sharded_param.grad
            if g is not None:
                local = g.to_local()
                sharded += local.numel() * local.element_size()
    return {"unsharded": unsharded, "sharded": sharded}


def train_fsdp(
    *,
    steps: int | str,
    loop: Loop,
    policy: str = "auto",
    mixed_precision: str | None = None,
    budget: int | None = None,
    reshard: bool | None = None,
    wrap: list[str] | None = None,
    keep: bool | None = None,
    sync_budget: int | None = None,
) -> dict[str, Any]:
    accel = _accel(
        steps,
        policy,
        mixed_precision=mixed_precision,
        fsdp_memory_budget=budget,
        fsdp_reshard_after_backward=reshard,
        fsdp_wrap=wrap,
        fsdp_keep_params_in_window=keep,
        sync_memory_budget=sync_budget,
    )
    model = make_model()
    out = train(accel, loop, model=model)
    out["units"] = _units(model)
    out["reason"] = accel.sync_policy_reason
    out["flags_after"] = flags(model)  # FSDP's own flags once training is over
    out["unsharded_after"] = _unsharded_groups(model)
    return out


def flags(model: nn.Module) -> list[list[Any]]:
    """Per group: gradient sync, reshard after backward, reshard after forward."""
    return [
        [g.reduce_grads, g.reshard_after_backward, g.post_forward_mesh_info is not None]
        for g in param_groups(model)
    ]


def _unsharded_groups(model: nn.Module) -> int:
    """Groups whose parameters are gathered right now (none once a window has ended)."""
    return sum(1 for g in param_groups(model) if g.is_unsharded)


def train_wrap_callable(*, steps: int, loop: Loop) -> dict[str, Any]:
    """fsdp_wrap as a callable: shard only the Block modules (plus the root)."""
    accel = _accel(steps, "defer", fsdp_wrap=lambda m: isinstance(m, Block))
    model = make_model()
    out = train(accel, loop, model=model)
    out["units"] = _units(model)
    return out


def memory(*, policy: str, budget: int | None = None) -> dict[str, Any]:
    """Gradient bytes held after a non-boundary micro-step and after the boundary."""
    accel = _accel(2, policy, fsdp_memory_budget=budget)
    raw = make_model()
    params = sum(p.numel() for p in raw.parameters())
    with captured_log() as logged:
        model, _ = accel.prepare(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
    shard = sum(p.to_local().numel() for p in model.parameters())
    held = []
    for _ in range(2):
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(torch.randn(2, 8)), torch.randn(2, 1)))
            held.append(grad_bytes(model))
    return {
        "policy": accel.sync_policy,
        "reason": accel.sync_policy_reason,
        "memory": accel._backend.memory,  # type: ignore[attr-defined]
        "logged": logged,
        "off_boundary": held[0],
        "boundary": held[1],
        "param_numel": params,
        "shard_numel": shard,
    }


def drop_kept_window() -> dict[str, Any]:
    """A window that keeps its parameters gathered, dropped by an error in its 3rd micro-step:
    what FSDP holds right after (gathered groups, flags, gradients), against the 2nd."""
    accel = _accel(4, "auto", sync_memory_budget=10**9)
    raw = make_model()
    model, _ = accel.prepare(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
    seen: dict[str, Any] = {"reason": accel.sync_policy_reason}
    x, y = torch.randn(2, 8), torch.randn(2, 1)
    for i in range(3):
        try:
            with accel.accumulate(model):
                accel.backward(F.mse_loss(model(x), y))
                if i == 2:
                    raise KeyError("dropped")
        except KeyError:
            pass
        if i == 1:
            seen["open"] = {"gathered": _unsharded_groups(model), "grads": grad_bytes(model)}
    seen["dropped"] = {
        "gathered": _unsharded_groups(model),
        "grads": grad_bytes(model),
        "flags": flags(model),
    }
    return seen


def restores_state_keep() -> dict[str, Any]:
    """With the parameters kept gathered in the window: flags inside each kind of micro-step,
    and what accumulate() puts back (a user's own setting included)."""
    accel = _accel(2, "defer", fsdp_keep_params_in_window=True)
    model = accel.prepare(make_model())
    backend = accel._backend
    seen: dict[str, Any] = {"before": flags(model)}
    model.blocks[1].set_reshard_after_backward(False, recurse=False)  # the user's own setting
    seen["user"] = flags(model)
    with backend.micro_step(model, boundary=False):
        seen["inside_defer"] = flags(model)
    seen["after_defer"] = flags(model)
    with backend.micro_step(model, boundary=True):
        seen["inside_sync"] = flags(model)
    seen["after_sync"] = flags(model)
    return seen


def restores_state() -> dict[str, Any]:
    """accumulate() puts back what FSDP held before, whatever that was."""
    accel = _accel(2, "defer")
    model = accel.prepare(make_model())
    backend = accel._backend

    def flags() -> list[list[bool]]:
        return [[g.reduce_grads, g.reshard_after_backward] for g in param_groups(model)]

    seen: dict[str, Any] = {"before": flags()}
    model.blocks[0].set_requires_gradient_sync(False, recurse=False)  # the user's own setting
    seen["user"] = flags()
    with backend.micro_step(model, boundary=True):
        seen["inside_sync"] = flags()
    seen["after_sync"] = flags()
    with backend.micro_step(model, boundary=False):
        seen["inside_defer"] = flags()
    seen["after_defer"] = flags()
    return seen


def train_fsdp1(*, steps: int, loop: Loop, policy: str = "defer") -> dict[str, Any]:
    """A model the user wrapped in FSDP1 is deferred through its no_sync()."""
    accel = _accel(steps, policy)
    model = FSDP1(make_model(), device_id=torch.device("cpu"))
    out = train(accel, loop, model=model)
    out["reason"] = accel.sync_policy_reason
    return out


def misuse() -> dict[str, str]:
    """Each misuse raises a clear error; returns 'ExceptionType: message' per case."""
    messages: dict[str, str] = {}

    def catch(key: str, fn: Any) -> None:
        try:
            fn()
        except (ValueError, RuntimeError) as err:
            messages[key] = f"{type(err).__name__}: {err}"

    accel = _accel(4, "defer")
    catch("no_parameters", lambda: accel.prepare(nn.Sequential(nn.ReLU())))
    catch(
        "foreign_optimizer",
        lambda: accel.prepare(make_model(), torch.optim.SGD(make_model(1).parameters(), lr=0.1)),
    )
    raw = make_model()
    stateful = make_optimizer(raw.parameters(), "adam", 0.1)
    F.mse_loss(raw(torch.randn(2, 8)), torch.randn(2, 1)).backward()
    stateful.step()
    catch("optimizer_with_state", lambda: accel.prepare(raw, stateful))
    catch(
        "unknown_wrap", lambda: _accel(4, "defer", fsdp_wrap=["Transformer"]).prepare(make_model())
    )
    plain = make_model()

    def unprepared() -> None:
        with accel.accumulate(plain):
            pass

    catch("unprepared", unprepared)
    dist.barrier()
    return messages


def export_model() -> dict[str, Any]:
    from scenarios.common import export_model as export

    return export(_accel(4, "defer"))
