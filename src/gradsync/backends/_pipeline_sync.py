"""How a pipeline stage's data-parallel reduction follows the micro-step's sync flags: the
part of ``_pipeline`` that depends on what wraps the stage.

A schedule step runs ``pp_microbatches`` backwards of the stage. Off the boundary under
"defer" none of them reduces and the gradients add up locally; at the boundary (and on every
schedule step under "every_step") the data-parallel reduction runs once, for the sum of the
window's schedule steps. Each wrapper gets there its own way:

- FSDP2 (:class:`FSDPSync`): the stage keeps FSDP2's reduction off through the backwards and
  ends the schedule step with the flags the micro-step chose (``_fsdp_compat``).
- DDP (:class:`DDPSync`): torch's stage runs every backward but the schedule step's last
  under ``no_sync()`` and has DDP's reducer all-reduce in the last one; gradsync's stage lets
  the last one reduce only when the micro-step syncs (``_pipeline_compat.Stage``), and every
  forward of the schedule step runs with the sync flag off, so none prepares a reduction.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync.backends import _fsdp_compat

__all__ = ["DDPSync", "FSDPSync", "StageSync"]


class StageSync(Protocol):
    """What a backend does around one schedule step of a stage."""

    @property
    def flags(self) -> list[_fsdp_compat.GroupFlags] | None:
        """The FSDP2 groups' sync flags of the running schedule step, which the run-time
        check on a newer torch reads (``_pipeline_canary``); None where the stage is not
        FSDP2's."""

    def begin(self, module: nn.Module, several: bool) -> None:
        """A schedule step starts on ``module`` (``several``: more than one stage per rank)."""

    def reduces(self) -> bool:
        """Whether the schedule step's last backward may reduce (torch's own DDP path)."""

    def end_backward(self, module: nn.Module) -> None:
        """Every backward of the schedule step has run on this rank's stages."""

    def finish(self) -> None:
        """The schedule step ended (or failed): the micro-step's flags as they were."""


class FSDPSync:
    """An FSDP2-sharded stage: its groups' sync flags saved when a schedule step starts, the
    reduction run (or kept back) when its backward ends, the flags restored after it."""

    def __init__(self) -> None:
        self.flags: list[_fsdp_compat.GroupFlags] = []

    def begin(self, module: nn.Module, several: bool) -> None:
        _fsdp_compat.lazy_init(module)  # the stage is the root, whichever part runs first
        self.flags = _fsdp_compat.save_flags(module)
        if several:  # as torch's stage does for an FSDP2 module it runs itself
            _fsdp_compat.hold_back(module)

    def reduces(self) -> bool:
        return True  # torch's FSDP2 path ignores it: end_backward reduces

    def end_backward(self, module: nn.Module) -> None:
        _fsdp_compat.end_pipeline_backward(module, self.flags)

    def finish(self) -> None:
        _fsdp_compat.restore_flags(self.flags)


class DDPSync:
    """A stage wrapped in ``DistributedDataParallel`` over its data-parallel ranks: the
    micro-step's ``require_backward_grad_sync`` (off inside ``no_sync()``) decides whether
    the schedule step's last backward all-reduces."""

    def __init__(self) -> None:
        self.flags: None = None  # torch's own DDP path: checked when the stage is made
        self._module: DDP | None = None
        self._sync = True

    def begin(self, module: nn.Module, several: bool) -> None:
        assert isinstance(module, DDP) and not several, "one DDP stage per rank"
        self._module, self._sync = module, module.require_backward_grad_sync
        # Off for every forward of the step (torch's shape inference runs one outside its
        # no_sync()): a forward with it on would prepare a reduction no backward finishes.
        module.require_backward_grad_sync = False

    def reduces(self) -> bool:
        return self._sync

    def end_backward(self, module: nn.Module) -> None:
        return None  # DDP's reducer all-reduced inside the last backward (when it synced)

    def finish(self) -> None:
        if self._module is not None:
            self._module.require_backward_grad_sync = self._sync
            # As after a synchronised forward of DDP itself: the next schedule step's first
            # forward broadcasts the buffers from the data group's first rank (once a window
            # under defer); the step's own forwards ran with the flag off and cleared it.
            self._module.require_forward_param_sync = self._sync
