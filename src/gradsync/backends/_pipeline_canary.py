"""A check, on a torch newer than the tested range, that the pipeline's replaced stage
methods (``_pipeline_compat.Stage``) still take effect, before a run depends on them.

torch's schedules call ``perform_reduce_grad`` at the end of each schedule step's backward,
where gradsync's stage closes the step with the micro-step's sync flags instead of
reducing. A torch that renamed the method, stopped calling it, or reduces elsewhere would
train on with a reduction on every schedule step (or none at the boundary), silently. So on
an untested torch every schedule step of a pipeline's first window is checked on each rank,
with no collective: the stage's end of backward ran once; off the boundary the step's
gradients are held unsharded and no sharded gradient was written (nothing reduced, the
gradients from before the step kept); at the boundary nothing is left held and the reduced
gradients are there. What does not hold is one RuntimeError line naming the torch version.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from gradsync._support import torch_range as _torch_range
from gradsync.backends import _fsdp_compat

log = logging.getLogger("gradsync")

__all__ = ["Canary"]


class Canary:
    """Checks each schedule step of a pipeline's first window on a torch newer than the
    tested range (nothing on a tested torch, nothing after the first boundary)."""

    def __init__(self) -> None:
        self.active = _torch_range.above(torch.__version__)
        #: how many times the stage's end of backward closed the rank's schedule step
        self.closed = 0

    def start(self) -> None:
        self.closed = 0

    def failed(self, error: BaseException) -> None:
        """The stage's end of backward raised inside torch: on an untested torch, one
        RuntimeError line naming it (torch may have run its own reduction first)."""
        if self.active:
            first = (str(error).strip().splitlines() or [""])[0]
            raise self._refusal(
                f"the end of a schedule step's backward failed inside torch "
                f"({type(error).__name__}: {first})"
            ) from error

    def check(
        self,
        module: nn.Module,
        flags: list[_fsdp_compat.GroupFlags] | None,
        before: dict[nn.Parameter, torch.Tensor | None],
    ) -> None:
        """After a schedule step of ``module`` (the rank's FSDP2 root) run with ``flags``
        (the micro-step's sync flags; None for a stage DDP wraps, whose reduction is torch's
        own reducer told by the replaced backward, checked when the stage is made),
        ``before`` holding each parameter's gradient from before the step; one RuntimeError
        line where the stage's methods did not act."""
        if not self.active or flags is None:
            return
        reduces = [reduce_grads for _, reduce_grads, _, _, _ in flags]
        boundary = all(reduces) and all(all_reduce for _, _, all_reduce, _, _ in flags)
        held = not any(reduces)  # else a reduce-scatter whose all-reduce waits (HSDP)
        problem = _problem(self.closed, held, boundary, module, before)
        if problem:
            raise self._refusal(problem)
        if boundary:  # the first window held and reduced as gradsync meant: checked
            self.active = False
            log.info("gradsync pipeline: stage hooks checked on torch %s", torch.__version__)

    @staticmethod
    def _refusal(problem: str) -> RuntimeError:
        return RuntimeError(
            f"torch {torch.__version__} is newer than the releases gradsync was tested on "
            f"({_torch_range.supported()}), and gradsync's pipeline stage does not act on "
            f"it: {problem}; install a tested torch "
            f"(pip install 'torch=={_torch_range.NEWEST_PIN}'), or train without pp"
        )


def _problem(
    closed: int,
    held: bool,
    boundary: bool,
    module: nn.Module,
    before: dict[nn.Parameter, torch.Tensor | None],
) -> str | None:
    """What did not act as ``held`` (no reduction asked) or ``boundary`` (the whole
    reduction asked) mean; None when all did."""
    if closed != 1:
        return (
            f"the end of a schedule step's backward (PipelineStage.perform_reduce_grad) "
            f"closed it {closed} times, not once"
        )
    kept = any(g is not None for g in _fsdp_compat.window_grads(module))
    if held:
        if not kept or any(p.grad is not before.get(p) for p in module.parameters()):
            return "the data-parallel reduction ran off the window boundary under deferral"
        return None
    if kept or (boundary and all(p.grad is None for p in module.parameters())):
        return "the window boundary did not reduce the window's gradients"
    return None
