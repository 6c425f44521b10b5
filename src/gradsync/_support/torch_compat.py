"""The only place outside ``backends/`` that touches private torch attributes.

The audit's process-group wrapper hands the single-tensor collectives on to the wrapped
group's ``_allgather_base`` / ``_reduce_scatter_base`` (the C++ methods that
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` end in), sets the NCCL options'
timeout, and the dataloader sharding asks whether a ``RandomSampler`` was given
``num_samples``; the fp16 scaler asks GradScaler whether it found inf/NaN, and the adapters
see through ``torch.compile``'s ``OptimizedModule``; ranks that must all arrive at one call
before a collective meet in the default group's key-value store. A torch that renamed one
fails here with a message naming the supported versions.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import torch

from gradsync._support import torch_range as _torch_range
from gradsync._support.util import require_attr

#: The torch versions whose internals this module was written and tested against.
SUPPORTED_TORCH = _torch_range.supported()


def require(obj: object, name: str, what: str) -> Any:
    """``getattr(obj, name)``, or a RuntimeError naming what is missing and the fix."""
    return require_attr(
        obj, name, what=what, library="torch", version=torch.__version__, supported=SUPPORTED_TORCH
    )


def default_store() -> Any:
    """The default process group's key-value store (the one its ranks met through)."""
    import torch.distributed.distributed_c10d as c10d

    return require(c10d, "_get_default_store", "default process group's store")()


def allgather_base(pg: Any, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> Any:
    args = (output, inp) if opts is None else (output, inp, opts)
    return require(pg, "_allgather_base", "all-gather into one tensor")(*args)


def reduce_scatter_base(pg: Any, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> Any:
    args = (output, inp) if opts is None else (output, inp, opts)
    return require(pg, "_reduce_scatter_base", "reduce-scatter of one tensor")(*args)


def set_nccl_timeout(opts: Any, timeout: timedelta) -> None:
    require(opts, "_timeout", "NCCL options timeout")
    opts._timeout = timeout


def sampler_num_samples(sampler: torch.utils.data.RandomSampler) -> int | None:
    """The ``num_samples`` a RandomSampler was built with (None: one pass over the data)."""
    value: int | None = require(sampler, "_num_samples", "RandomSampler's own num_samples")
    return value


def scaler_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether the scaler found inf/NaN in the optimizer's gradients when it unscaled them
    (after ``unscale_``; a ShardedGradScaler has already combined every rank's finding).
    GradScaler keeps this per optimizer and says it only through ``step``'s skipping."""
    per_device = require(scaler, "_found_inf_per_device", "GradScaler's per-optimizer inf check")
    return bool(sum(float(v.item()) for v in per_device(optimizer).values()))


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside ``torch.compile(model)`` (``OptimizedModule._orig_mod``), through
    any number of such wrappers; ``model`` itself when it is not one."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # torch._dynamo was never imported: nothing has been compiled
        return model
    optimized = eval_frame.OptimizedModule
    while isinstance(model, optimized):
        model = require(model, "_orig_mod", "the module inside torch.compile's OptimizedModule")
    return model


def weights_only_globals() -> frozenset[str]:
    """The globals ``torch.load(weights_only=True)`` accepts (``module.name``): torch's own
    set (tensors, storages, dtypes, ``OrderedDict``, ...) and what the user added with
    ``torch.serialization.add_safe_globals``."""
    from torch import _weights_only_unpickler

    own = require(
        _weights_only_unpickler,
        "_get_allowed_globals",
        "the weights_only allow-list (checkpoint safety)",
    )()
    added = set()
    for entry in torch.serialization.get_safe_globals():
        obj = entry[0] if isinstance(entry, tuple) else entry
        name = entry[1] if isinstance(entry, tuple) else f"{obj.__module__}.{obj.__qualname__}"
        added.add(name)
    return frozenset(own) | frozenset(added)
