"""Accelerate's ``accelerate.local_sgd`` on gradsync: ``LocalSGD``.

Local SGD trains each process on its own gradients and averages the parameters every few
steps, instead of averaging the gradients at every optimizer step. The gradient sync is
turned off on purpose, through the backend (``Backend.pause_sync``), so gradsync's
self-check knows it and says nothing about the boundaries that reduce nothing.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch

from gradsync._support.util import check_positive_int


class LocalSGD:
    """Local SGD over a prepared model, with Accelerate's arguments and counting.

    Inside ``with LocalSGD(accelerator=..., model=..., local_sgd_steps=K) as local_sgd:``
    the model's gradients are never synchronised, boundaries included: each process steps
    on its own. Every K-th call of ``local_sgd.step()`` (Accelerate's example calls it once
    per batch, inside ``accumulate``) and once more when the block ends, the parameters are
    averaged over the processes. In one process, or with ``enabled=False``, it does nothing.

    Where Accelerate's averages also when the block raised, this one does not: a rank that
    failed would leave the others waiting in the average.

    Args:
        accelerator: the Accelerator that prepared ``model`` (``gradsync.accelerate``'s or
            ``gradsync``'s).
        model: the prepared model.
        local_sgd_steps: calls of ``step()`` between two averagings (>= 1).
        enabled: False: the block trains as it would without LocalSGD.

    Raises:
        ConfigError: ``local_sgd_steps`` < 1, or a backend whose processes do not each hold
            the whole model (FSDP2, DeepSpeed: use DDP).
    """

    def __init__(
        self, accelerator: Any, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True
    ) -> None:
        self.enabled = bool(enabled) and int(accelerator.num_processes) > 1
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self._paused: Any = None
        if self.enabled:
            check_positive_int("local_sgd_steps", local_sgd_steps)
            self._paused = accelerator._backend.pause_sync(model)

    def __enter__(self) -> LocalSGD:
        if self._paused is not None:
            self._paused.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._paused is None:
            return
        try:
            if kind is None:
                self._average()
        finally:
            self._paused.__exit__(kind, error, tb)

    def step(self) -> None:
        """Count one step; every ``local_sgd_steps``-th averages the parameters."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    def _average(self) -> None:
        """Every parameter replaced by its mean over the processes (one all-reduce each)."""
        with torch.no_grad():
            for param in self.model.parameters():
                param.copy_(self.accelerator.reduce(param.detach(), reduction="mean"))
