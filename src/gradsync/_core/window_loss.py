"""``accel.window_loss``: the loss a window's update really minimised, equal on every rank.

Each ``accel.backward(loss, reduction=...)`` adds this rank's share of the window's
objective (kept as a list of detached losses and weights, combined once per window),
weighted exactly as the update weights it: ``loss / (n * world)`` for
``"mean"`` (n micro-batches in this window), ``loss / items`` for ``"sum"`` (the global
window's items), ``loss`` for ``"normalized"`` (already divided by them). The losses stay on
the device (no synchronisation per micro-step). When the boundary micro-step ends, one
small all-reduce of ``[share, backward calls]`` starts on every rank — so reading the value
on the main process only can never hang — and the first read waits for it.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gradsync.errors import UsageError

if TYPE_CHECKING:
    from gradsync._plan.window import MicroStep

log = logging.getLogger("gradsync")


class WindowLoss:
    """The window loss of one Accelerator (see the module docstring). The micro-step runner
    calls ``at_boundary`` after a window's last micro-step; nothing runs on the others."""

    def __init__(
        self,
        device: torch.device,
        world: int,
        own: Callable[[], contextlib.AbstractContextManager[None]],
        group: Any = None,
    ) -> None:
        self._device = device
        self.world = world  # the data-parallel ranks (their process group: ``group``)
        self._group = group
        self._own = own
        # This rank's share of the open window: each backward's detached loss and weight,
        # combined into one tensor when the window closes (cheaper than adding per backward).
        self._losses: list[torch.Tensor] = []
        self._weights: list[float] = []
        # The closed window's [loss, calls]: an all-reduce in flight, or (one process) the
        # losses and weights themselves, combined when read.
        self._pending: tuple[Any, Any] | None = None
        self._value: float | None = None
        self._closed: MicroStep | None = None  # the boundary micro-step whose loss was taken
        self._outside = False  # a backward outside accumulate() added to the share
        self._first: MicroStep | None = None  # the first micro-step of the share's window
        self.windows = 0  # windows whose loss was taken

    def add(
        self,
        loss: torch.Tensor,
        weight: float,
        step: MicroStep | None,
        *,
        keeps_graph: bool = False,
    ) -> None:
        """This rank's ``loss`` counts ``weight`` times in the objective of the window of
        ``step`` (None: a backward outside ``accumulate``, a window of its own).
        ``keeps_graph``: the backward keeps its graph (``retain_graph=True``): only a
        detached copy is kept, so the window does not hold the graph's buffers."""
        if step is None:
            self._outside = True
        elif step.index == 0 and step is not self._first:
            self._first = step  # what a dropped window left is not this one's
            self._losses, self._weights = [], []
        elif step is self._closed:
            log.warning(
                "gradsync: backward() after optimizer.step() in a window's last micro-step: "
                "its gradients reach no update, and accel.window_loss leaves it out"
            )
            return
        # The loss itself (detaching costs a tensor per micro-step): after its backward the
        # graph's buffers are freed, and only this scalar and its graph's nodes stay alive.
        self._losses.append(loss.detach() if keeps_graph else loss)
        self._weights.append(weight)

    def at_boundary(self, step: MicroStep) -> None:
        """The window's last micro-step ended: take its loss unless a step already did."""
        if self._closed is not step:
            self.close()
        self._closed = None

    def before_step(self, step: MicroStep | None) -> None:
        """A prepared optimizer is about to step (every rank does, in program order): the
        window's backward passes are all done, so its loss is taken now (once)."""
        if step is not None and step.boundary and self._closed is not step:
            self.close()
            self._closed = step
        elif step is None and self._outside:
            self.close()

    def close(self) -> None:
        """The window's update is done: start the all-reduce of its loss (every rank). In
        one process nothing is computed until the value is read."""
        if self._pending is not None and self._pending[0] is not None:
            self._settle()  # the previous window's all-reduce (an unread one-process window is dropped)
        losses, weights = self._losses, self._weights
        self._losses, self._weights = [], []
        self._outside = False
        self.windows += 1
        if self.world > 1 and dist.is_available() and dist.is_initialized():
            share = self._share(losses, weights)
            with self._own():
                work = dist.all_reduce(share, group=self._group, async_op=True)
            self._pending = (work, share)
        else:
            self._pending = (None, (losses, weights))

    def _share(self, losses: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        """[the weighted sum of ``losses``, how many] on this rank's device."""
        if not losses:
            return torch.zeros(2, device=self._device)
        with torch.no_grad():
            try:
                stacked = torch.stack(losses).reshape(-1)  # scalars (the usual case)
            except RuntimeError:  # losses of different shapes, each with one element
                stacked = torch.stack([t.reshape(()) for t in losses])
            values = stacked.to(device=self._device, dtype=torch.float32)
            total = values @ torch.tensor(weights, dtype=torch.float32, device=self._device)
            return torch.stack([total, torch.tensor(float(len(losses)), device=self._device)])

    def _settle(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        work, share = pending
        if work is not None:
            work.wait()
        total = share if isinstance(share, torch.Tensor) else self._share(*share)
        loss, calls = total.tolist()
        self._value = loss if calls > 0 else math.nan  # a window without any backward

    @property
    def value(self) -> float:
        """The last closed window's loss (waits for its all-reduce on first read)."""
        self._settle()
        if self._value is None:
            raise UsageError(
                "accel.window_loss is known once a window closed: read it after optimizer.step() "
                "in the boundary micro-step (accel.sync_gradients is True), or after its block"
            )
        return self._value
