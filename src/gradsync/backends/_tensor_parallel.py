"""Tensor parallelism's plan: which modules are split over the "tp" dim, and how.

A plan is a mapping of module-name patterns (``fnmatch``, Transformers' style:
``"layers.*.self_attn.q_proj"``) to styles (Transformers' words for torch's ParallelStyles, or
a ParallelStyle), a callable ``(model, tp_mesh) -> None``, or "auto" (the plan a Transformers
model carries). It is applied with ``parallelize_module`` before FSDP2 shards over the
data-parallel dims. What it names is checked against the model first (a pattern naming no
module, a degree that does not divide a layer's features or the heads), each in one line,
before any collective.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from gradsync.errors import ConfigError

__all__ = ["STYLES", "apply", "check", "clip_grad_norm_", "clip_grad_value_", "resolve"]

#: A style word -> the torch ParallelStyle it stands for (a new one per module), and the
#: dimension it splits: "out" (colwise: out_features / embedding_dim), "in" (rowwise:
#: in_features / num_embeddings) or None.
STYLES: dict[str, tuple[Callable[[], ParallelStyle], str | None]] = {
    "colwise": (ColwiseParallel, "out"),
    "rowwise": (RowwiseParallel, "in"),
    "colwise_rep": (lambda: ColwiseParallel(output_layouts=Replicate()), "out"),
    "colwise_gather_output": (lambda: ColwiseParallel(output_layouts=Replicate()), "out"),
    "rowwise_rep": (lambda: RowwiseParallel(input_layouts=Replicate()), "in"),
    "embedding_rowwise": (lambda: RowwiseParallel(input_layouts=Replicate()), "in"),
    "sequence_parallel": (SequenceParallel, None),
    "replicate": (lambda: PrepareModuleInput(desired_input_layouts=Replicate()), None),
}
#: Where a style splits a layer's weight, by module type: dimension -> (attribute, what).
_FEATURES: dict[type[nn.Module], dict[str, tuple[str, str]]] = {
    nn.Linear: {"out": ("out_features", "out_features"), "in": ("in_features", "in_features")},
    nn.Embedding: {
        "out": ("embedding_dim", "embedding_dim"),
        "in": ("num_embeddings", "num_embeddings"),
    },
}


def resolve(model: nn.Module, plan: Any) -> Any:
    """The plan to apply: a mapping module name -> style (word or ParallelStyle), or the
    user's callable. "auto" reads the model's own plan (Transformers: ``_tp_plan`` on the
    model, or ``base_model_tp_plan`` on its config, prefixed by ``base_model_prefix``)."""
    if callable(plan) and not isinstance(plan, Mapping):
        return plan
    patterns = _auto(model) if plan == "auto" else dict(plan)
    names = [name for name, _ in model.named_modules() if name]
    chosen: dict[str, Any] = {}
    for pattern, style in patterns.items():
        hits = [n for n in names if fnmatchcase(n, pattern)]
        if not hits:
            close = sorted(
                {_shape(n) for n in names if n.rsplit(".", 1)[-1] == pattern.rsplit(".", 1)[-1]}
            )
            near = (
                f"; module names look like {close[0]!r}"
                if close
                else (f"; module names look like {', '.join(repr(n) for n in names[:4])}")
            )
            raise ConfigError(
                f"tp_plan: the pattern {pattern!r} names no module of the {type(model).__name__}"
                f"{near}: fix the pattern or drop it"
            )
        for name in hits:
            chosen.setdefault(name, style)
    return chosen


def _shape(name: str) -> str:
    """A module name with its numbers as ``*`` (how plans write layer indices)."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _auto(model: nn.Module) -> dict[str, Any]:
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, Mapping) and own:
        return dict(own)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if isinstance(base, Mapping) and base:
        prefix = getattr(model, "base_model_prefix", "")
        inner = prefix and hasattr(model, prefix)
        return {(f"{prefix}.{k}" if inner else k): v for k, v in base.items()}
    raise ConfigError(
        f"tp_plan='auto' needs a model that carries its plan (a Transformers model with "
        f"base_model_tp_plan), and the {type(model).__name__} has none; give tp_plan as a "
        "dict of module-name patterns to styles, or a callable (model, tp_mesh) -> None"
    )


def check(model: nn.Module, plan: Any, degree: int) -> None:
    """A ConfigError (one line) where the degree does not divide what a style splits: a
    Linear's out/in features, an Embedding's dims, a Transformers config's heads."""
    if not isinstance(plan, Mapping):
        return  # the user's callable: torch checks what it does
    modules = dict(model.named_modules())
    for name, style in plan.items():
        if not isinstance(style, str):
            if not isinstance(style, ParallelStyle):
                raise ConfigError(
                    f"tp_plan: {name!r} -> {style!r} is no style; use one of "
                    f"{', '.join(STYLES)} or a torch ParallelStyle"
                )
            continue
        if style not in STYLES:
            raise ConfigError(
                f"tp_plan: {name!r} -> {style!r} is no style; use one of {', '.join(STYLES)}"
            )
        split = STYLES[style][1]
        module = modules[name]
        for kind, dims in _FEATURES.items():
            if split is not None and isinstance(module, kind):
                attr, what = dims[split]
                size = int(getattr(module, attr))
                if size % degree:
                    raise ConfigError(
                        f"tp_plan: {name!r} -> {style!r} splits the {type(module).__name__}'s "
                        f"{what}={size} over tp={degree}, which does not divide it; pick a tp "
                        "that divides it, or leave the module out of the plan"
                    )
    config = getattr(model, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads", "n_head"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % degree:
            raise ConfigError(
                f"parallelism tp={degree} does not divide the model's {attr}={heads}: each "
                f"tensor-parallel rank holds whole heads; pick a tp that divides {heads}"
            )


def apply(model: nn.Module, plan: Any, tp_mesh: DeviceMesh) -> None:
    """Split ``model`` over ``tp_mesh`` (before FSDP2 shards it over the data-parallel dims)."""
    if callable(plan) and not isinstance(plan, Mapping):
        plan(model, tp_mesh)
        return
    styles = {
        name: STYLES[style][0]() if isinstance(style, str) else style
        for name, style in plan.items()
    }
    parallelize_module(model, tp_mesh, styles)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    stages: Any = None,
) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` over DTensor gradients that live on several meshes (a
    split layer's on (dp_shard, tp), a layer left out of the plan on dp_shard alone), which
    torch's cannot stack: the norm of each mesh's gradients (made plain with
    ``full_tensor()``), combined into the global norm; with ``stages`` (a pipeline's group)
    the norms of every stage's gradients are combined too. Every gradient is scaled in place
    on its local shard. Returns the global norm (a plain tensor, equal on every rank)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = [torch.zeros((), dtype=torch.float32)]
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = norms[-1].device
    stacked = torch.stack([n.to(device, torch.float32) for n in norms])
    infinite = math.isinf(norm_type)
    total = stacked.max() if infinite else stacked.pow(norm_type).sum()
    if stages is not None:
        op = torch.distributed.ReduceOp.MAX if infinite else torch.distributed.ReduceOp.SUM
        torch.distributed.all_reduce(total, op=op, group=stages)
    if not infinite:
        total = total.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(local.device, local.dtype))
    return total


def clip_grad_value_(parameters: Iterable[torch.Tensor], clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]``, each on its local shard
    (element-wise, so the same on any placement; no list op across meshes)."""
    for p in parameters:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            local.clamp_(-clip_value, clip_value)
