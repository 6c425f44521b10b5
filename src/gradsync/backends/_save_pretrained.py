"""Letting a sharded model's own ``save_pretrained`` (Transformers') write its full weights:
every rank gathers, the writer writes, every rank returns once it has (see
``gather_in_save_pretrained``)."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from gradsync._support import dist
from gradsync.errors import UsageError

#: How long ``save_pretrained`` on a sharded model waits for every rank to call it too before
#: it fails (it gathers the weights from every rank, so a call on rank 0 alone cannot work).
ARRIVAL_TIMEOUT_S = 60.0
#: The gathering ``save_pretrained`` calls that went ahead in this process, of any model:
#: every rank makes the same calls, so each call's meeting has the same name on every rank.
_meetings = [0]


def gather_in_save_pretrained(
    module: torch.nn.Module, gather: Callable[[], dict[str, Any]], barrier: Callable[[], None]
) -> None:
    """Let ``module.save_pretrained`` (Transformers', or any whose signature takes
    ``state_dict``) write the full weights of a model whose own state dict holds shards.

    Called on every rank, as Accelerate scripts call it, without ``state_dict`` or with a
    sharded one, it gathers the weights (a collective), hands them to the model's own
    ``save_pretrained`` (which writes where ``is_main_process`` is true) and returns once
    every rank is done. With a ``state_dict`` of whole tensors it is the model's own call.
    Called on fewer than every rank, it fails in one line after :data:`ARRIVAL_TIMEOUT_S`
    seconds instead of hanging in the gather.

    Args:
        module: the sharded model (the module ``unwrap_model`` returns); the method is set on
            this instance only, and a module without such a ``save_pretrained`` is left as is.
        gather: the full state dict of ``module`` (a collective on every rank).
        barrier: waits for every rank.
    """
    own = getattr(type(module), "save_pretrained", None)
    if not callable(own) or "save_pretrained" in vars(module):
        return
    try:
        signature = inspect.signature(own)
    except (TypeError, ValueError):
        return
    if "state_dict" not in signature.parameters:
        return

    def save_pretrained(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = signature.bind(self, *args, **kwargs)
        given = call.arguments.get("state_dict")
        if given is not None and not any(isinstance(v, DTensor) for v in given.values()):
            return own(*call.args, **call.kwargs)
        missing = dist.missing_ranks(f"save_pretrained/{_meetings[0]}", ARRIVAL_TIMEOUT_S)
        if missing:
            raise UsageError(
                f"save_pretrained() on a sharded model gathers its weights from every rank, and "
                f"rank {missing[0]}{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''} "
                f"did not call it within {ARRIVAL_TIMEOUT_S:g} s; call it on every rank "
                "(is_main_process= picks the writer), or call accel.save_model(model, dir) on every rank"
            )
        _meetings[0] += 1
        call.arguments["state_dict"] = (
            gather()
            if given is None
            else {
                k: v.full_tensor().detach().cpu() if isinstance(v, DTensor) else v
                for k, v in given.items()
            }
        )
        result = own(*call.args, **call.kwargs)
        barrier()  # the other ranks return once the writer has written
        return result

    module.__dict__["save_pretrained"] = types.MethodType(save_pretrained, module)
