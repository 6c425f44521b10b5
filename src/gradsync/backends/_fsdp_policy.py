"""FSDP helpers: which submodules become sharded units, what deferring costs in memory, and
which level of deferral a policy and a budget pick.

Used by the fsdp adapter; kept apart so the adapter reads as the sync logic alone.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import nn

from gradsync._support.util import human_bytes
from gradsync.backends._fsdp_compat import unsharded_numel
from gradsync.backends._memory import AUTO_BUDGET_FRACTION, Budget, available_memory, extra_text
from gradsync.config import RequestedPolicy, SyncPolicy
from gradsync.errors import ConfigError

__all__ = [
    "AUTO_BUDGET_FRACTION",
    "Keep",
    "available_memory",
    "crosses_nodes",
    "decide",
    "deferral_cost",
    "held_numel",
    "mesh_shape",
    "partial_cost",
    "select_units",
]

_MESH_FIX = "give (R, S) with R x S = the world size (one of them may be -1), or 'node'"


def mesh_shape(spec: Any, world: int, per_node: int) -> tuple[int, int]:
    """(R replicas, S shards) of ``fsdp_mesh`` (None, "node" or (R, S) with at most one -1,
    as the settings checked it) on ``world`` processes, ``per_node`` of them per node;
    a ConfigError naming the value and the fix when the product is not the world size."""
    if spec is None:
        return 1, world
    if spec == "node":
        if per_node < 1 or world % per_node:
            raise ConfigError(
                f"fsdp_mesh='node' shards over the {per_node} processes of a node, which does "
                f"not divide the world of {world}; {_MESH_FIX}"
            )
        return world // per_node, per_node
    replicas, shards = int(spec[0]), int(spec[1])
    known = shards if replicas == -1 else replicas if shards == -1 else None
    if known is not None:
        if world % known:
            raise ConfigError(
                f"fsdp_mesh={tuple(spec)!r}: {known} does not divide the world of {world} "
                f"processes, so the -1 cannot be inferred; {_MESH_FIX}"
            )
        replicas, shards = (world // known, known) if replicas == -1 else (known, world // known)
    if replicas * shards != world:
        raise ConfigError(
            f"fsdp_mesh={tuple(spec)!r} holds {replicas} x {shards} = {replicas * shards} "
            f"processes, but the world has {world}; {_MESH_FIX}, e.g. (-1, {shards})"
        )
    return replicas, shards


def crosses_nodes(shards: int, per_node: int) -> bool:
    """A shard group of ``shards`` ranks spans nodes: it does not divide the processes per node."""
    return shards > 1 and per_node % shards != 0


#: How long a deferred window keeps the parameters gathered: "no" (FSDP2's default: gathered
#: for forward, again for backward), "after_backward" (the deprecated
#: fsdp_reshard_after_backward=False: from backward to the next forward) or "window" (from the
#: window's first forward to its boundary backward: one all-gather per window).
Keep = Literal["no", "after_backward", "window"]


def select_units(model: nn.Module, wrap: Any = None) -> list[nn.Module]:
    """The submodules to shard as their own unit (outermost first; never the root).

    ``wrap`` is None (the children of every ModuleList / Sequential container), a list of
    module class names or classes, or a callable ``module -> bool``.
    """
    if wrap is None:

        def pick(parent: nn.Module, child: nn.Module) -> bool:
            return isinstance(parent, nn.ModuleList | nn.Sequential)
    elif callable(wrap) and not isinstance(wrap, type):

        def pick(parent: nn.Module, child: nn.Module) -> bool:
            return bool(wrap(child))
    else:
        wanted = [wrap] if isinstance(wrap, str | type) else list(wrap)
        names = {w if isinstance(w, str) else w.__name__ for w in wanted}
        present = {type(m).__name__ for m in model.modules()}
        if not names & present:
            raise ConfigError(
                f"fsdp_wrap={sorted(names)} names no module class of this model; use class "
                f"names from: {', '.join(sorted(present))}, a callable, or None for the default"
            )

        def pick(parent: nn.Module, child: nn.Module) -> bool:
            return type(child).__name__ in names

    units: list[nn.Module] = []

    def walk(parent: nn.Module) -> None:
        for child in parent.children():
            if pick(parent, child) and any(True for _ in child.parameters()):
                units.append(child)  # a unit is sharded whole: do not descend into it
            else:
                walk(child)

    walk(model)
    return units


def held_numel(param: Any) -> int:
    """The elements of a parameter this rank holds once FSDP2 gathers it: its full size, or
    under tensor parallelism its tensor-parallel share (a DTensor split over the mesh's
    "tp" dim: the full size / T)."""
    full = unsharded_numel(param)
    mesh = getattr(param, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if mesh is not None and "tp" in names:
        dim = names.index("tp")
        if param.placements[dim].is_shard():
            return -(-full // int(mesh.size(dim)))
    return full


def deferral_cost(
    model: nn.Module, world: int, *, grad_bytes: int | None, keep_params: bool
) -> int:
    """Extra bytes per rank that deferring holds: the unsharded gradients minus their shard
    (in the gradient dtype), plus the whole gathered parameters when they stay gathered
    (FSDP2 keeps each rank's shard beside the gathered copy, so nothing is subtracted).
    ``world``: the ranks a parameter is sharded over (S on a 2-D mesh); under tensor
    parallelism a split parameter counts its tensor-parallel share (``held_numel``)."""
    # FSDP2 parameters are DTensors (numel is the full size); FSDP1's are local flat shards.
    sizes = [(held_numel(p), p.element_size()) for p in model.parameters()]
    grads = sum(n * (grad_bytes or size) for n, size in sizes)
    gathered = sum(n * size for n, size in sizes) if keep_params else 0
    return grads - grads // world + gathered


def partial_cost(model: nn.Module, shards: int, *, grad_bytes: int | None) -> int:
    """Bytes per rank of defer_replicate's partial buffer: this rank's 1/S shard of the
    reduced gradients (in the reduction dtype), held through the window."""
    full = sum(held_numel(p) * (grad_bytes or p.element_size()) for p in model.parameters())
    return -(-full // shards)


def decide(
    asked: RequestedPolicy,
    keep: bool | None,
    legacy_keep: bool,
    *,
    grads: int,
    full: int,
    budget: Budget | None,
    world: int,
    replicas: int = 1,
    partial: int = 0,
) -> tuple[SyncPolicy, Keep, int, str]:
    """Pick the deferral level. ``grads`` / ``full``: extra bytes per rank that deferring
    holds for the gradients alone / for gradients and parameters. ``keep``: the option
    fsdp_keep_params_in_window (None: auto decides by the budget; explicit policies do not
    consult it). ``legacy_keep``: the deprecated fsdp_reshard_after_backward=False.
    ``world``: the ranks a parameter is sharded over (S); ``replicas``: R of a 2-D mesh (1:
    1-D), where ``partial`` bytes per rank are what defer_replicate holds."""
    g_text = extra_text(grads, "unsharded gradients", world)
    f_text = extra_text(full, "unsharded gradients and parameters", world, gathered=True)
    p_text = (
        f"defer_replicate holds a partial buffer of {human_bytes(partial)} ({partial} bytes) "
        f"per rank (1/{world} of the gradients) and all-reduces across the {replicas} "
        "replicas once per window"
    )
    if asked == "every_step":
        return "every_step", "no", 0, f"every_step (requested): {g_text} when deferring"
    if asked == "defer_replicate":
        return "defer_replicate", "no", partial, f"defer_replicate (requested): {p_text}"
    if asked == "defer":
        if keep:
            return (
                "defer",
                "window",
                full,
                f"defer (requested), parameters kept gathered in the window: {f_text}",
            )
        if legacy_keep:
            return "defer", "after_backward", full, f"defer (requested): {f_text}"
        return "defer", "no", grads, f"defer (requested): {g_text}"
    assert budget is not None
    b = budget.describe()
    texts = {"window": f_text, "after_backward": f_text, "no": g_text}
    options: list[tuple[Keep, int]] = (
        [("after_backward", full)]
        if legacy_keep and keep is None
        else [("window", full)]
        if keep
        else [("no", grads)]
        if keep is False
        else [("window", full), ("no", grads)]
    )
    for i, (level, extra) in enumerate(options):
        if extra <= budget.nbytes:
            how = {
                "window": ", parameters kept gathered in the window",
                "after_backward": ", parameters kept gathered after backward",
                "no": " (gradients only)" if keep is None else "",
            }[level]
            also = (
                (
                    f"; keeping the parameters gathered too would hold {human_bytes(full)} "
                    f"({full} bytes), which exceeds it"
                )
                if i > 0
                else ""
            )
            return (
                "defer",
                level,
                extra,
                f"auto -> defer{how}: {texts[level]}, which fits the budget {b}{also}",
            )
    level, _ = options[-1]
    if replicas > 1 and partial <= budget.nbytes:
        return (
            "defer_replicate",
            "no",
            partial,
            f"auto -> defer_replicate: {texts[level]}, which exceeds the budget {b}; {p_text}, which fits it",
        )
    if replicas > 1:
        return (
            "every_step",
            "no",
            0,
            f"auto -> every_step: {texts[level]}, and {p_text}: both exceed the budget {b}",
        )
    return (
        "every_step",
        "no",
        0,
        f"auto -> every_step: {texts[level]}, which exceeds the budget {b}",
    )


def mp_policy(bf16: bool, reduce: Any, *, root: bool) -> Any:
    """FSDP2's MixedPrecisionPolicy: bf16 compute (the root's outputs in fp32: the user's
    loss sees fp32, as without bf16); the gradients reduced in comm_hook's dtype (the
    reduce-scatter and, on HSDP, the all-reduce across the replicas), else in fp32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param = torch.bfloat16 if bf16 else None
    return MixedPrecisionPolicy(
        param_dtype=param,
        reduce_dtype=reduce or torch.float32,
        output_dtype=torch.float32 if root and param else None,
    )


def check_replicate_policy(spec: Any, shape: tuple[int, int], *, nd: bool) -> None:
    """``sync_policy="defer_replicate"`` needs replicas to defer across: one ConfigError line
    naming the mesh (``spec``: ``fsdp_mesh``'s value, or the N-D ``parallelism`` when ``nd``)."""
    replicas, shards = shape
    if replicas != 1:
        return
    shown = tuple(spec.shape) if hasattr(spec, "shape") and not isinstance(spec, str) else spec
    named = f"parallelism={spec!r}" if nd else f"fsdp_mesh={shown!r}"
    need = "dp_replicate > 1" if nd else "fsdp_mesh=(R, S) with R > 1"
    raise ConfigError(
        f"sync_policy='defer_replicate' defers the all-reduce across replicas, and {named} "
        f"has one replica (a 1-D mesh of {shards}); give {need}, or use sync_policy='defer'"
    )
