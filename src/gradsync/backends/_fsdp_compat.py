"""The only place gradsync touches FSDP2's private state.

FSDP2 (``torch.distributed.fsdp.fully_shard``) has no public API for what gradsync needs:
reading and restoring the per-group flags that ``set_requires_gradient_sync``,
``set_reshard_after_backward`` and ``set_reshard_after_forward`` write (the public setter of
the last also turns off the root's automatic choice, so gradsync sets the group's flag
itself), running FSDP2's lazy initialisation before the first forward (it resets the root's
flag), the unpadded full size of a sharded parameter, the unsharded gradients that a
deferred window accumulates, and, on a 2-D mesh (HSDP), the partial buffers in which a window
whose all-reduce across replicas is deferred accumulates its reduce-scattered shards, and the
end of a pipeline schedule step's backward (every state of the root's ``_state_ctx``, each
group's ``post_backward``, the root's ``_root_post_backward_final_callback``: what torch's
pipeline stage runs itself). Each access goes through
``_require`` so that a torch that renamed one fails with a message naming the supported
versions instead of an AttributeError from deep inside.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from gradsync._support.torch_compat import SUPPORTED_TORCH
from gradsync._support.util import require_attr

#: One group's flags: (group, reduce_grads, all_reduce_grads, reshard_after_backward,
#: post_forward_mesh_info); the last is None when the group keeps its parameters gathered
#: after forward.
GroupFlags = tuple[Any, bool, bool, Any, Any]


def _require(obj: object, name: str, what: str) -> Any:
    return require_attr(
        obj,
        name,
        what=f"FSDP2 {what}",
        library="torch",
        version=torch.__version__,
        supported=SUPPORTED_TORCH,
    )


def param_groups(model: nn.Module) -> Iterator[Any]:
    """Every FSDP2 parameter group under ``model`` (one per sharded unit that holds parameters)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            yield from _state_groups(_require(module, "_get_fsdp_state", "per-module state")())


def _state_groups(state: Any) -> list[Any]:
    """One FSDP2 state's parameter groups: ``_fsdp_param_groups``, or on torch 2.10 and older
    ``_fsdp_param_group`` (at most one, None when the module holds no parameters)."""
    if not hasattr(state, "_fsdp_param_groups") and hasattr(state, "_fsdp_param_group"):
        group = state._fsdp_param_group
        return [] if group is None else [group]
    return list(_require(state, "_fsdp_param_groups", "parameter groups"))


def gathers_in_forward(module: nn.Module) -> bool:
    """Whether ``module``'s next forward all-gathers: one of its own parameter groups is not
    gathered now (a window that keeps its parameters gathered gathers only in its first
    forward)."""
    state = _require(module, "_get_fsdp_state", "per-module state")()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch 2.8 and older: at most one group per module
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return any(not group.is_unsharded for group in groups)


def save_flags(model: nn.Module) -> list[GroupFlags]:
    """The sync flags every group holds now (to be put back exactly by ``restore_flags``)."""
    return [
        (
            g,
            _require(g, "reduce_grads", "gradient-sync flag"),
            _require(g, "all_reduce_grads", "all-reduce flag"),
            _require(g, "reshard_after_backward", "reshard-after-backward flag"),
            _require(g, "post_forward_mesh_info", "reshard-after-forward mesh"),
        )
        for g in param_groups(model)
    ]


def restore_flags(saved: list[GroupFlags]) -> None:
    for group, reduce_grads, all_reduce_grads, reshard, post_forward in saved:
        group.reduce_grads = reduce_grads
        group.all_reduce_grads = all_reduce_grads
        group.reshard_after_backward = reshard
        group.post_forward_mesh_info = post_forward


def lazy_init(model: nn.Module) -> None:
    """FSDP2's lazy initialisation of the root, which its first forward would run (it decides
    the root and turns off the root's reshard after forward); running it before flags are
    saved keeps it from changing them behind ``save_flags``."""
    if isinstance(model, FSDPModule):
        _require(
            _require(model, "_get_fsdp_state", "per-module state")(), "_lazy_init", "lazy init"
        )()


def keep_gathered(model: nn.Module, *, after_forward: bool, after_backward: bool) -> None:
    """Keep every group's parameters unsharded after forward and/or after backward (until
    ``restore_flags``); parameters that are already unsharded are then not all-gathered again."""
    for group in param_groups(model):
        if after_forward:
            group.post_forward_mesh_info = None
        if after_backward:
            group.reshard_after_backward = False


def reshard(model: nn.Module) -> None:
    """Free every unsharded parameter under ``model`` (FSDP2's public, per-module reshard)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def unsharded_numel(param: torch.Tensor) -> int:
    """The full (unpadded) number of elements of a parameter; FSDP1 keeps flat shards whose
    full size is ``_unpadded_unsharded_size``, FSDP2's DTensors report it as their shape."""
    return torch.Size(getattr(param, "_unpadded_unsharded_size", param.shape)).numel()


def grads_live_on_leaf(fsdp_param: Any) -> bool:
    """Whether FSDP2 keeps a deferred window's gradients only on the unsharded parameter's
    ``.grad`` (torch 2.15 on: ``unsharded_accumulated_grad`` is a read-only view of it), or
    also in a separate ``unsharded_accumulated_grad`` buffer of the reduce dtype (earlier)."""
    _require(fsdp_param, "unsharded_accumulated_grad", "accumulated unsharded gradient")
    found = getattr(type(fsdp_param), "unsharded_accumulated_grad", None)
    return isinstance(found, property) and found.fset is None


def _fsdp_params(model: nn.Module) -> list[Any]:
    return [
        fp
        for group in param_groups(model)
        for fp in _require(group, "fsdp_params", "parameters of a group")
    ]


def clear_unsharded_grads(model: nn.Module) -> None:
    """Drop the unsharded gradients a deferred window left inside FSDP2 (they are reduced
    into the sharded ``.grad`` only at the boundary, so ``zero_grad`` never sees them)."""
    for fsdp_param in _fsdp_params(model):
        if not grads_live_on_leaf(fsdp_param):
            fsdp_param.unsharded_accumulated_grad = None
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is not None:
            unsharded.grad = None


def window_grads(model: nn.Module) -> list[torch.Tensor | None]:
    """The unsharded gradients a deferred window holds on this rank, one entry per FSDP2
    parameter (in the model's group order): this rank's local sums, not yet reduced."""
    out: list[torch.Tensor | None] = []
    for fsdp_param in _fsdp_params(model):
        grad = _require(fsdp_param, "unsharded_accumulated_grad", "accumulated unsharded gradient")
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if grad is None and unsharded is not None:
            grad = unsharded.grad
        out.append(None if grad is None else grad.detach().cpu().clone())
    return out


def put_window_grads(
    model: nn.Module, grads: list[torch.Tensor | None], device: torch.device
) -> None:
    """Give a deferred window's saved gradients back to FSDP2 where it accumulates them: the
    next backward adds to them, and the boundary reduce-scatters the sum. Where they live on
    the unsharded parameter (torch 2.15 on) and a freshly loaded model has none yet, its
    modules are unsharded and resharded once to create it (an all-gather: every rank loads)."""
    fsdp_params = _fsdp_params(model)
    if len(fsdp_params) != len(grads):
        raise ValueError(
            f"the window holds {len(grads)} gradients, the model has {len(fsdp_params)} parameters"
        )
    if any(
        grad is not None and grads_live_on_leaf(fp) and not hasattr(fp, "_unsharded_param")
        for fp, grad in zip(fsdp_params, grads)
    ):
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.unshard()
                module.reshard()
    for fsdp_param, grad in zip(fsdp_params, grads):
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if not grads_live_on_leaf(fsdp_param):
            fsdp_param.unsharded_accumulated_grad = None if grad is None else grad.to(device)
            if unsharded is not None:
                unsharded.grad = None
        elif unsharded is not None:
            dtype = getattr(unsharded, "grad_dtype", None) or unsharded.dtype
            unsharded.grad = None if grad is None else grad.to(device, dtype)


def reset_iter_state(model: nn.Module) -> None:
    """Drop what a broken-off window left in FSDP2's per-iteration state, the partial buffers
    of a deferred all-reduce across replicas (HSDP) included: torch's public
    ``reset_iter_state()`` on the root where it exists, else the buffers cleared directly."""
    # A window dropped before the model's first forward: the root was never initialised,
    # and torch's reset reads the communication state that initialisation makes.
    lazy_init(model)
    reset = getattr(model, "reset_iter_state", None)
    if callable(reset):
        reset()
        return
    # Older torch (before reset_iter_state): what a forward or backward broken off midway
    # leaves behind, put back by hand: every state and group idle, nothing gathered, the
    # root's per-iteration trackers cleared, the partial buffers dropped.
    for group in param_groups(model):
        _require(group, "_partial_reduce_output", "partial all-reduce buffer")
        group._partial_reduce_output = None
        group._all_gather_result = None
        group._post_forward_indices.clear()
        group._training_state = type(group._training_state).IDLE
    state = model._get_fsdp_state()  # type: ignore[operator]
    for each in state._state_ctx.all_states:
        each._training_state = type(each._training_state).IDLE
        each._modules_to_run_forward.clear()
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False
    state._comm_ctx.post_forward_order.clear()
    reshard(model)


def partial_buffers(model: nn.Module) -> list[torch.Tensor | None]:
    """Each group's partial buffer on this rank (HSDP with the all-reduce deferred: the
    window's reduce-scattered shard sums, not yet all-reduced across replicas), on the CPU."""
    out: list[torch.Tensor | None] = []
    for group in param_groups(model):
        buffer = _require(group, "_partial_reduce_output", "partial all-reduce buffer")
        out.append(None if buffer is None else buffer.detach().cpu().clone())
    return out


#: Where each parameter's shard sits in a group's partial buffer: (index of the parameter in
#: the group, offset, padded size), in buffer order.
Layout = list[tuple[int, int, int]]


def partial_layouts(model: nn.Module) -> list[Layout | None]:
    """Each group's partial-buffer layout (torch 2.15 on keeps it beside the buffer, keyed by
    parameter, and repacks a buffer whose layout it does not know into zeros); None where this
    torch keeps none (the buffer then packs every parameter of the group in order)."""
    out: list[Layout | None] = []
    for group in param_groups(model):
        layout = getattr(group, "_partial_reduce_output_layout", None)
        if layout is None:
            out.append(None)
            continue
        index = {id(fp): i for i, fp in enumerate(group.fsdp_params)}
        out.append([(index[id(fp)], offset, size) for fp, (offset, size) in layout.items()])
    return out


def _packed_in_order(group: Any, buffer: torch.Tensor) -> Layout:
    """The layout of a buffer that packs every parameter of ``group`` in order (what torch
    before 2.15 keeps, and what a checkpoint written there holds)."""
    layout, offset = [], 0
    for i, fsdp_param in enumerate(_require(group, "fsdp_params", "parameters of a group")):
        size = _require(fsdp_param, "padded_sharded_param_size", "padded shard size").numel()
        layout.append((i, offset, size))
        offset += size
    if offset != buffer.numel():
        raise ValueError(
            f"a saved partial buffer of {buffer.numel()} elements does not pack the "
            f"{len(layout)} parameters of its group ({offset} elements)"
        )
    return layout


def put_partial_buffers(
    model: nn.Module,
    buffers: list[torch.Tensor | None],
    device: torch.device,
    layouts: list[Layout | None] | None = None,
) -> None:
    """Give saved partial buffers back to their groups, with the layout that says which
    parameter each part belongs to: the boundary adds them before its all-reduce across
    replicas. A buffer saved without a layout packs its group's parameters in order."""
    groups = list(param_groups(model))
    if len(groups) != len(buffers):
        raise ValueError(
            f"the window holds {len(buffers)} partial buffers, the model has {len(groups)} groups"
        )
    for group, buffer, layout in zip(groups, buffers, layouts or [None] * len(groups)):
        _require(group, "_partial_reduce_output", "partial all-reduce buffer")
        keeps_layout = hasattr(group, "_partial_reduce_output_layout")
        if buffer is None:
            group._partial_reduce_output = None
            if keeps_layout:
                group._partial_reduce_output_layout = {}
            continue
        layout = layout if layout is not None else _packed_in_order(group, buffer)
        if keeps_layout:
            params = group.fsdp_params
            group._partial_reduce_output_layout = {params[i]: (o, n) for i, o, n in layout}
        else:  # packed in the group's parameter order, as the next reduce-scatter packs it
            buffer = torch.cat([buffer.narrow(0, o, n) for _, o, n in sorted(layout)])
        group._partial_reduce_output = buffer.to(device)


def hold_back(model: nn.Module) -> None:
    """Keep every group's gradients unreduced and unsharded through a pipeline schedule
    step's backward (what torch's stage sets on an FSDP2 module it runs itself), until
    ``end_pipeline_backward``."""
    model.set_is_last_backward(False)  # type: ignore[operator]
    for group in param_groups(model):
        group.reduce_grads = False
        group.reshard_after_backward = False


def end_pipeline_backward(model: nn.Module, flags: list[GroupFlags]) -> None:
    """Close one pipeline schedule step's backward on a stage's FSDP2 root with the sync flags
    gradsync chose for the micro-step (``flags``, from ``save_flags`` before the schedule ran),
    where torch's schedule would turn gradient sync on. Off the boundary the groups reshard and
    keep the step's gradients unsharded, to be added to by the next schedule step; at the
    boundary they reduce the whole window's gradients once."""
    model.set_is_last_backward(True)  # type: ignore[operator]
    restore_flags(flags)
    for group in param_groups(model):
        group.reshard_after_backward = True
    state = _require(model, "_get_fsdp_state", "per-module state")()
    context = _require(state, "_state_ctx", "state context")
    for each in _require(context, "all_states", "states"):
        for group in _state_groups(each):
            _require(group, "post_backward", "post-backward")()
    _require(state, "_root_post_backward_final_callback", "final backward callback")()
