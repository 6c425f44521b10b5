"""A check, on a torch newer than the tested range, that FSDP2's private state still means
what ``_fsdp_compat`` relies on, before a user's run depends on it.

It runs once per process, when a save inside a window (or the load of one) first needs it,
on every rank together (nothing at prepare), on a tiny module sharded over the same
mesh as the user's model (every rank runs the same steps, so its collectives match): a
deferred window's gradients are saved, cleared and given to a freshly sharded copy, and the
boundary must reduce the whole window's gradients (known in closed form); on a 2-D mesh the same
for the partial buffers of a deferred all-reduce across replicas. What does not hold is
refused by name (mid-window saves, dropped windows) instead of training differently.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from gradsync._support import torch_range as _torch_range
from gradsync.backends import _fsdp_compat

log = logging.getLogger("gradsync")

#: What a failed check refuses, by check.
WINDOW_GRADS = "the unsharded gradients of a deferred window (mid-window saves, dropped windows)"
PARTIAL_BUFFERS = (
    "the partial buffers of a deferred all-reduce across replicas "
    "(mid-window saves and dropped windows under sync_policy='defer_replicate')"
)


def _tiny(mesh: DeviceMesh, device: torch.device) -> nn.Module:
    model = nn.Linear(4, 4, device="meta").to_empty(device=device)  # no random draws
    with torch.no_grad():
        model.weight.copy_(torch.arange(16.0).reshape(4, 4) / 16)
        model.bias.copy_(torch.arange(4.0) / 4)
    fully_shard(model, mesh=mesh)
    return model


def _inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(8.0, device=device).reshape(2, 4) / 8
    return x, x.flip(0) - 0.5


def _reduced_as_expected(model: nn.Module, device: torch.device) -> bool:
    """Whether this rank's shards of the reduced gradients are those of the whole window
    (both inputs), known in closed form: ``d sum(x W^T + b) / dW`` has every row equal to the
    window's summed inputs, ``/ db`` every entry equal to its row count. Every rank computes
    the same, so the data-parallel mean is that too, whatever rows this rank holds."""
    x1, x2 = _inputs(device)
    weight = (x1.sum(0) + x2.sum(0)).expand(4, 4)
    bias = torch.full((4,), float(len(x1) + len(x2)), device=device)
    local = [p.grad.to_local() for p in model.parameters()]  # type: ignore[union-attr]
    return all(
        torch.allclose(got, want[: len(got)], rtol=1e-6, atol=0)
        for got, want in zip(local, (weight, bias))
    )


def _window_grads_hold(mesh: DeviceMesh, device: torch.device) -> bool:
    x1, x2 = _inputs(device)
    first, fresh = _tiny(mesh, device), _tiny(mesh, device)
    assert isinstance(first, FSDPModule) and isinstance(fresh, FSDPModule)
    first.set_requires_gradient_sync(False)
    first(x1).sum().backward()
    saved = _fsdp_compat.window_grads(first)
    _fsdp_compat.clear_unsharded_grads(first)
    cleared = all(g is None for g in _fsdp_compat.window_grads(first))
    _fsdp_compat.put_window_grads(fresh, saved, device)  # as a load does: before any forward
    fresh(x2).sum().backward()
    return cleared and _reduced_as_expected(fresh, device)


def _partial_buffers_hold(mesh: DeviceMesh, device: torch.device) -> bool:
    x1, x2 = _inputs(device)
    first, fresh = _tiny(mesh, device), _tiny(mesh, device)
    assert isinstance(first, FSDPModule) and isinstance(fresh, FSDPModule)
    first.set_requires_all_reduce(False)
    first(x1).sum().backward()
    saved = _fsdp_compat.partial_buffers(first), _fsdp_compat.partial_layouts(first)
    _fsdp_compat.reset_iter_state(first)
    cleared = all(b is None for b in _fsdp_compat.partial_buffers(first))
    _fsdp_compat.put_partial_buffers(fresh, saved[0], device, saved[1])
    fresh(x2).sum().backward()
    return cleared and _reduced_as_expected(fresh, device)


def _holds(
    check: Callable[[DeviceMesh, torch.device], bool], mesh: DeviceMesh, device: torch.device
) -> bool:
    try:
        return check(mesh, device)
    except Exception as err:  # a renamed field, a changed signature: the same on every rank
        log.debug("gradsync fsdp canary %s: %r", check.__name__, err)
        return False


def check(mesh: DeviceMesh, device: torch.device) -> list[str]:
    """What of FSDP2's private state does not hold on this torch, agreed by every rank
    ([] when everything holds). It draws no random numbers."""
    checks = [(WINDOW_GRADS, _window_grads_hold)]
    if mesh.ndim == 2:
        checks.append((PARTIAL_BUFFERS, _partial_buffers_hold))
    held = torch.tensor([float(_holds(fn, mesh, device)) for _, fn in checks], device=device)
    dist.all_reduce(held, op=dist.ReduceOp.MIN)
    return [what for (what, _), ok in zip(checks, held.tolist()) if not ok]


class Canary:
    """Runs ``check`` once, on a torch newer than the tested range only, when a feature that
    needs it is first used on every rank together (a save inside a window, or the load of
    one): nothing at prepare. It says what it found: one warning on the main process, and
    the refusal of a feature that needs what did not hold."""

    def __init__(self) -> None:
        self.failed: list[str] | None = None  # None: not run (a tested torch, or not yet)
        self.seconds = 0.0

    def run(self, mesh: DeviceMesh, device: torch.device) -> None:
        if self.failed is not None or not _torch_range.above(torch.__version__):
            return
        start = time.perf_counter()
        self.failed = check(mesh, device)
        self.seconds = time.perf_counter() - start
        if self.failed and dist.get_rank() == 0:
            warnings.warn(
                f"torch {torch.__version__}: gradsync's check of FSDP2's internals found "
                f"{'; '.join(self.failed)} changed; those are refused",
                stacklevel=2,
            )
        log.info("gradsync fsdp: internals checked in %.0f ms", self.seconds * 1000)

    def refuse(self, feature: str, *, partial: bool) -> None:
        """Raise one line where ``feature`` needs state the check found not to hold."""
        needed = [WINDOW_GRADS] + ([PARTIAL_BUFFERS] if partial else [])
        broken = [what for what in needed if what in (self.failed or [])]
        if broken:
            raise _refusal(feature, broken[0])

    def refuse_uncleared(self, models: list[nn.Module], *, partial: bool) -> None:
        """After a dropped window was cleared, on a torch newer than the tested range whose
        check has not run (a drop need not happen on every rank at once, so it runs no
        collective): what gradsync cleared must read as empty, else the drop is refused."""
        if self.failed is not None or not _torch_range.above(torch.__version__):
            return
        left = []
        for model in models:
            if isinstance(model, FSDPModule):
                if any(g is not None for g in _fsdp_compat.window_grads(model)):
                    left.append(WINDOW_GRADS)
                if partial and any(b is not None for b in _fsdp_compat.partial_buffers(model)):
                    left.append(PARTIAL_BUFFERS)
        if left:
            raise _refusal("dropping a window", left[0])


def _refusal(feature: str, what: str) -> RuntimeError:
    return RuntimeError(
        f"{feature} is not available on torch {torch.__version__}: gradsync's check of "
        f"{what} did not hold (gradsync supports torch {_torch_range.supported()}); "
        f"install torch {_torch_range.NEWEST} or save at a window boundary"
    )
