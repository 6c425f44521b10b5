"""The only place that reads torch DDP's private behaviour: the text of its reducer's
"Expected to have finished reduction in the prior iteration" error.

When a backward that DDP synchronises leaves some parameters without a gradient (and
``find_unused_parameters`` is off), the reducer never finishes and the NEXT forward raises a
long error that lists the parameters by index ("Parameter indices which did not receive grad
for rank 0: 4 5"), or by name under ``TORCH_DISTRIBUTED_DEBUG=INFO``. The message format is
torch's own and may change: where it cannot be parsed, the names stay unknown and the caller
still gives its one-line error.
"""

from __future__ import annotations

import re

import torch

_UNFINISHED = "Expected to have finished reduction in the prior iteration"
_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")
_NAMES = re.compile(r"Parameters which did not receive grad for rank (\d+): ([^\n]+)")


def is_unfinished_reduction(err: BaseException) -> bool:
    """Whether ``err`` is DDP's error for a synchronised backward that left parameters out."""
    return isinstance(err, RuntimeError) and _UNFINISHED in str(err)


def reducer_parameter_names(
    module: torch.nn.Module, ignored: frozenset[str] = frozenset()
) -> list[str]:
    """The names of the parameters DDP's reducer tracks, in its order (the one its indices
    refer to): each module's own trainable parameters in ``named_modules()`` order, without
    ``ignored`` ones and without repeats (as ``DistributedDataParallel._build_params_for_reducer``)."""
    seen: set[int] = set()
    names = []
    for module_name, sub in module.named_modules():
        for param_name, param in sub.named_parameters(recurse=False):
            fqn = f"{module_name}.{param_name}" if module_name else param_name
            if (
                not param.requires_grad
                or f"{module_name}.{param_name}" in ignored
                or id(param) in seen
            ):
                continue
            seen.add(id(param))
            names.append(fqn)
    return names


def unused_parameters(
    message: str, module: torch.nn.Module, ignored: frozenset[str] = frozenset()
) -> tuple[int | None, list[str] | None]:
    """(rank, names of the parameters that got no gradient) read from DDP's error message;
    (None, None) where the message does not say in a form this version understands."""
    found = _NAMES.search(message)
    if found:
        names = [n.strip() for n in found.group(2).split(",") if n.strip()]
        return int(found.group(1)), names or None
    found = _INDICES.search(message)
    if found:
        order = reducer_parameter_names(module, ignored)
        try:
            return int(found.group(1)), [order[int(i)] for i in found.group(2).split()]
        except IndexError:
            return int(found.group(1)), None
    return None, None


def expect_backward(model: torch.nn.parallel.DistributedDataParallel) -> None:
    """Have DDP's reducer reduce in the next backward although the forward ran under
    ``no_sync()`` (what DDP's own forward does when it will sync). With
    ``find_unused_parameters`` the reducer needs the forward's outputs: nothing is done, the
    forward must run inside the syncing micro-step."""
    if not model.find_unused_parameters:
        model.reducer.prepare_for_backward([])


def start_window_again(model: torch.nn.parallel.DistributedDataParallel) -> None:
    """After a dropped window, every rank's next forward does what a window's first forward
    does after a boundary: broadcast the buffers (when DDP does). A rank whose dropped
    window reached its boundary's forward and one whose did not otherwise disagree on it,
    and one of them would wait in a broadcast the other never starts. The reducer forgets a
    synchronising forward whose backward never ran (else the next backward, off the
    boundary, would reduce on that rank alone)."""
    model.require_forward_param_sync = True
    reset = getattr(model.reducer, "_reset_state", None)
    if callable(reset):
        reset()


def bf16_hooks_run() -> bool:
    """Whether torch's DDP takes its bf16 communication hooks here: it refuses them (a
    TypeError when registered) unless NCCL 2.10+ on a CUDA or ROCm build, or XCCL on an
    XPU, is available (``DistributedDataParallel._check_comm_hook``)."""
    import torch.distributed as dist

    gpu = torch.version.cuda is not None or torch.version.hip is not None
    nccl = gpu and dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
    xccl = getattr(dist, "is_xccl_available", lambda: False)() and torch.xpu.is_available()
    return bool(nccl or xccl)
