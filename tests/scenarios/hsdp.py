"""FSDP2 on a 2-D mesh (HSDP) scenarios, run by mp_worker.py inside one 4-rank audited gloo
group (and the checkpoint loads in a 2-rank and a 1-rank group)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync import Accelerator
from gradsync.backends._fsdp_compat import param_groups

from scenarios.common import Loop, Probe, make_model, make_optimizer, micro_step, to_lists, train


def _accel(mesh: Any, steps: int | str, policy: str, **options: Any) -> Accelerator:
    options = {k: v for k, v in options.items() if v is not None}
    if mesh is not None:
        options["fsdp_mesh"] = tuple(mesh)
    return Accelerator(
        backend="fsdp",
        gradient_accumulation_steps=steps,
        sync_policy=policy,
        seed=0,
        audit=True,
        **options,
    )


def _coords(accel: Accelerator) -> list[int]:
    """(replica, shard) of this rank on the mesh (a 1-D mesh: replica 0)."""
    mesh = accel.mesh
    assert mesh is not None
    if mesh.ndim == 1:
        return [0, mesh.get_local_rank()]
    return [mesh.get_local_rank(0), mesh.get_local_rank(1)]


def local_shards(model: nn.Module) -> list[list[float]]:
    """This rank's shard of each parameter, as it holds it."""
    return [p.to_local().detach().flatten().tolist() for p in model.parameters()]  # type: ignore[attr-defined]


class Shards(Probe):
    """Each rank's local parameter shards after every optimizer step."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.after_steps: list[list[list[float]]] = []

    def before_block(self, accel: Any, model: nn.Module) -> None:
        self.model = model

    def window_end(self, accel: Any) -> None:
        assert self.model is not None
        self.after_steps.append(local_shards(self.model))

    def finish(self, accel: Any, model: nn.Module, scheduler: Any) -> dict[str, Any]:
        return {"shards": self.after_steps}


def partial_groups(model: nn.Module) -> int:
    """Groups holding a partial buffer (a window's shards not yet all-reduced across replicas)."""
    return sum(1 for g in param_groups(model) if g._partial_reduce_output is not None)


def train_hsdp(
    *,
    mesh: list[int] | None,
    steps: int | str,
    loop: Loop,
    policy: str = "auto",
    keep: bool | None = None,
    sync_budget: int | None = None,
    mixed_precision: str | None = None,
) -> dict[str, Any]:
    accel = _accel(
        mesh,
        steps,
        policy,
        fsdp_keep_params_in_window=keep,
        sync_memory_budget=sync_budget,
        mixed_precision=mixed_precision,
    )
    model = make_model()
    probe = Shards()
    out = train(accel, loop, model=model, probe=probe)
    out["reason"] = accel.sync_policy_reason
    out["coords"] = _coords(accel)
    out["mesh_shape"] = list(accel.mesh.shape) if accel.mesh is not None else None
    out["partial_after"] = partial_groups(model)
    out["memory"] = accel._backend.memory  # type: ignore[attr-defined]
    return out


def _batches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's own micro-batches, the same in every run."""
    g = torch.Generator().manual_seed(1000 * seed + dist.get_rank())
    return [(torch.randn(2, 8, generator=g), torch.randn(2, 1, generator=g)) for _ in range(n)]


def _prepared(mesh: Any, policy: str) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer]:
    accel = _accel(mesh, 4, policy)
    raw = make_model()
    model, opt = accel.prepare(raw, make_optimizer(raw.parameters(), "adam", 0.01))
    return accel, model, opt


def resume_mid_window(*, mesh: list[int], policy: str, folder: str) -> dict[str, Any]:
    """A window of 4 saved after 2 micro-steps, finished in the same run and in a fresh one
    that loads the checkpoint: both end with the same parameters (bitwise)."""
    data = _batches(8, seed=7)
    accel, model, opt = _prepared(mesh, policy)
    for x, y in data[:6]:  # one full window, then half of the next
        micro_step(accel, model, opt, x, y)
    seen = {
        "partial_at_save": partial_groups(model),
        "sharded_grads_at_save": sum(1 for p in model.parameters() if p.grad is not None),
    }
    accel.save_state(folder)
    for x, y in data[6:]:
        micro_step(accel, model, opt, x, y)
    seen["went_on"] = to_lists(accel.get_state_dict(model))
    seen["steps"] = accel.optimizer_steps
    accel2, model2, opt2 = _prepared(mesh, policy)
    accel2.load_state(folder)
    seen["partial_after_load"] = partial_groups(model2)
    for x, y in data[6:]:
        micro_step(accel2, model2, opt2, x, y)
    seen["resumed"] = to_lists(accel2.get_state_dict(model2))
    seen["resumed_steps"] = accel2.optimizer_steps
    return seen


def save_at_boundary(*, mesh: list[int], folder: str) -> dict[str, Any]:
    """Two windows on the mesh under defer_replicate, saved at the boundary: the full state."""
    accel, model, opt = _prepared(mesh, "defer_replicate")
    for x, y in _batches(8, seed=3):
        micro_step(accel, model, opt, x, y)
    accel.save_state(folder)
    return {"state": to_lists(accel.get_state_dict(model)), "steps": accel.optimizer_steps}


def load_boundary(*, folder: str) -> dict[str, Any]:
    """That checkpoint loaded on this group's default 1-D mesh (or in one process)."""
    accel, model, opt = _prepared(None, "defer")
    accel.load_state(folder)
    adam = opt.state_dict()["state"]
    steps = sorted({float(s["step"]) for s in adam.values()})
    return {
        "state": to_lists(accel.get_state_dict(model)),
        "steps": accel.optimizer_steps,
        "adam_steps": steps,
        "world": accel.world_size,
        "mesh_ndim": accel.mesh.ndim if accel.mesh is not None else None,
    }


def auto_choice(*, mesh: list[int], budget: int) -> dict[str, Any]:
    """What auto picks on the mesh for a budget (the model holds 705 fp32 parameters)."""
    accel = _accel(mesh, 2, "auto", sync_memory_budget=budget)
    accel.prepare(make_model())
    return {
        "policy": accel.sync_policy,
        "reason": accel.sync_policy_reason,
        "memory": accel._backend.memory,
    }  # type: ignore[attr-defined]


def restores_flags(*, mesh: list[int]) -> dict[str, Any]:
    """defer_replicate's micro-steps set FSDP2's flags and put back what it held before."""
    accel = _accel(mesh, 2, "defer_replicate")
    model = accel.prepare(make_model())
    backend = accel._backend

    def flags() -> list[list[bool]]:
        return [[g.reduce_grads, g.all_reduce_grads] for g in param_groups(model)]

    seen: dict[str, Any] = {"before": flags()}
    with backend.micro_step(model, boundary=False):
        seen["inside_off"] = flags()
    seen["after_off"] = flags()
    with backend.micro_step(model, boundary=True):
        seen["inside_boundary"] = flags()
    seen["after_boundary"] = flags()
    return seen


def folder_exists(*, folder: str) -> bool:
    return Path(folder).is_dir()
