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
2.10 infers them with a forward only, has no such method and drops nothing), and
``_prepare_forward_infra`` (where every torch in the range runs the shape inference's
forward: the stage's buffers are kept before it and put back after it).
The first three are checked when a stage is made, so a torch that renamed one fails with a
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
    ("_prepare_forward_infra", "shape inference of the first schedule step"),
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
    ``reduces()``, calling ``after_cleanup()`` after torch's cleanup of the first schedule
    step's shape inference (where torch runs one), and putting the stage's buffers back as
    they were before the shape inference."""

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
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        # Every torch in the range infers the shapes with a forward in training mode (2.10 on
        # zeros, 2.13 on uninitialised memory), which updates the buffers (a batch norm's
        # running statistics) with values no real batch gave; they are put back after torch
        # is done with that forward: after its cleanup where it has one (its backward may
        # still need them), else at once.
        self._kept = [(b, b.detach().clone()) for b in self.submod.buffers()]
        try:
            return super()._prepare_forward_infra(*args, **kwargs)
        finally:
            if not hasattr(PipelineStage, CLEANUP):
                self._put_back_buffers()

    def _put_back_buffers(self) -> None:
        with torch.no_grad():
            for buffer, kept in self._kept:
                buffer.copy_(kept)
        self._kept = []

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
        self._put_back_buffers()
        self._after_cleanup()
