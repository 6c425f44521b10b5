"""The only place gradsync reaches into torch.distributed.pipelining's private surface.

gradsync's stage is torch's ``PipelineStage`` with three of its methods replaced, all called
by torch's schedules and none a public extension point: ``perform_reduce_grad`` (the end
of a schedule step's backward, where torch turns FSDP2's gradient sync on and reduces; it
is given the schedule's gradient scale, 1 with ``scale_grads=False``),
``backward_maybe_with_nosync`` (each micro-batch's backward; for a stage wrapped in DDP
torch runs all but the schedule step's last under ``no_sync()`` and has DDP's reducer
all-reduce in the last one, which it is told by ``last_backward``: gradsync's stage tells it
only when the micro-step syncs) and
``_post_metadata_inference_cleanup`` (after the first schedule step infers the shapes with a
real forward and backward, torch drops every gradient of the stage's FSDP2 modules; torch
2.10 infers the shapes without running them and has no such method, nor drops anything).
The first two are checked when a stage is made, so a torch that renamed one fails with a
message naming the supported versions instead of running torch's own silently (every
schedule step reduced). What they mean is covered by tests/unit/test_compat.py (on a torch
with the cleanup: called once, on the first step; on any: a gradient from before the first
step survives it; a DDP stage's backward all-reduces exactly when ``last_backward`` is
true); the FSDP2 state that the end of the backward reaches is
``_fsdp_compat.end_pipeline_backward``. On a torch newer than the tested range,
``_pipeline_canary`` checks a pipeline's first window that they still act.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage

from gradsync._support.torch_compat import SUPPORTED_TORCH
from gradsync._support.util import require_attr

#: torch's ``PipelineStage`` methods that gradsync's stage needs to replace: (name, what it is).
HOOKS = (
    ("perform_reduce_grad", "end of a schedule step's backward"),
    ("backward_maybe_with_nosync", "backward of one micro-batch"),
)
#: The cleanup after shape inference (torch 2.13 on), replaced where torch has it.
CLEANUP = "_post_metadata_inference_cleanup"


def _require(obj: object, name: str, what: str) -> Any:
    return require_attr(
        obj,
        name,
        what=f"pipelining {what}",
        library="torch",
        version=torch.__version__,
        supported=SUPPORTED_TORCH,
    )


def check_hooks() -> None:
    """Every method in ``HOOKS`` exists on torch's ``PipelineStage`` (a RuntimeError naming
    the missing one and the supported torch versions otherwise)."""
    for name, what in HOOKS:
        _require(PipelineStage, name, what)


class Stage(PipelineStage):
    """torch's stage, ending each schedule step's backward with ``end_backward()`` instead of
    torch's reduction, letting the step's last backward reduce (torch's DDP path) only when
    ``reduces()``, and calling ``after_cleanup()`` after torch's cleanup of the first
    schedule step's shape inference (where torch runs one)."""

    def __init__(
        self,
        end_backward: Callable[[], None],
        after_cleanup: Callable[[], None],
        *args: Any,
        reduces: Callable[[], bool] = lambda: True,
        **kwargs: Any,
    ) -> None:
        check_hooks()
        super().__init__(*args, **kwargs)
        self._end_backward = end_backward
        self._after_cleanup = after_cleanup
        self._reduces = reduces

    def backward_maybe_with_nosync(
        self, backward_type: Any, bwd_kwargs: dict[str, Any], last_backward: bool = False
    ) -> Any:
        last = last_backward and self._reduces()
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if grad_scale_factor != 1:
            raise RuntimeError(
                f"the pipeline schedule scales gradients by {grad_scale_factor}; gradsync's "
                "stage runs with scale_grads=False and scales the loss itself"
            )
        self._end_backward()

    def _post_metadata_inference_cleanup(self) -> None:
        cleanup = getattr(super(), CLEANUP, None)
        if cleanup is not None:
            cleanup()
        self._after_cleanup()
