"""Prepared optimizer, scheduler and dataloader: thin wrappers that obey the boundary.

They share one ``StepState`` with the Accelerator that made them (never a global).
"""

from __future__ import annotations

import collections
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler

if TYPE_CHECKING:
    from gradsync.backends.base import Backend

log = logging.getLogger("gradsync")


@dataclass
class StepState:
    """What the wrappers need to know about the micro-step in progress."""

    sync: bool = True  # this micro-step is a boundary (True outside accumulate())
    optimizer_steps: int = 0  # optimizer steps really applied
    grads_pending: bool = False  # a backward ran since the last applied step or clear
    remaining: int | None = None  # batches left in the epoch, this one included (None: unknown)
    last: bool = False  # the batch just yielded is the epoch's last


class PreparedOptimizer(torch.optim.Optimizer):
    """Steps and clears only at a boundary; everything else goes to the wrapped optimizer.

    ``zero_grad`` clears only when no gradient of the open window would be lost: after an
    applied step, or before the window's first backward. So both loop orders
    (``zero_grad`` first, or after ``step``) accumulate correctly.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, backend: Backend, state: StepState) -> None:
        # Deliberately no super().__init__: the wrapped optimizer owns groups and state.
        self.optimizer = optimizer
        self._backend = backend
        self._state = state

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError(
                "step(closure) is not supported under gradient accumulation; "
                "call the closure yourself inside accel.accumulate()"
            )
        if not self._state.sync:
            return
        if self._backend.step(self.optimizer):
            self._state.optimizer_steps += 1
        self._state.grads_pending = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._state.grads_pending:
            return
        self._backend.zero_grad(self.optimizer, set_to_none)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


class PreparedScheduler:
    """Steps once per optimizer step that was really applied, never per micro-step."""

    def __init__(self, scheduler: Any, state: StepState) -> None:
        self.scheduler = scheduler
        self._state = state
        self._seen = state.optimizer_steps

    def step(self, *args: Any, **kwargs: Any) -> None:
        pending = self._state.optimizer_steps - self._seen
        if pending <= 0:
            return
        self._seen = self._state.optimizer_steps
        with warnings.catch_warnings():
            # The wrapped optimizer's step was called through the backend; torch cannot see that order.
            warnings.filterwarnings("ignore", message=r".*lr_scheduler\.step\(\)")
            for _ in range(pending):
                self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple) and not hasattr(batch, "_fields"):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def shard_dataloader(loader: DataLoader[Any], *, rank: int, world_size: int, seed: int) -> DataLoader[Any]:
    """A DataLoader over this rank's shard: seeded, reshuffled per epoch, equal batch counts."""
    if world_size == 1 or isinstance(loader.dataset, IterableDataset):
        if world_size > 1:
            log.warning(
                "gradsync: an IterableDataset is not resharded; make each rank yield its own "
                "shard with the same number of batches"
            )
        return loader
    if loader.batch_size is None:
        from gradsync.errors import ConfigError

        raise ConfigError(
            "dataloader has a custom batch_sampler (batch_size=None), which gradsync cannot "
            "shard over ranks; pass a DataLoader built with batch_size=..., or shard it yourself "
            "and prepare it with shard=False"
        )
    shuffle = isinstance(loader.sampler, RandomSampler)
    sampler: DistributedSampler[Any] = DistributedSampler(
        loader.dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
        drop_last=loader.drop_last,
    )
    kwargs: dict[str, Any] = {
        "batch_size": loader.batch_size,
        "sampler": sampler,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "drop_last": loader.drop_last,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "persistent_workers": loader.persistent_workers,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, **kwargs)


class PreparedDataLoader:
    """Iterates the (sharded) loader and tells the window where the epoch stands.

    With a sized loader it knows how many batches remain; with an unsized one it looks
    ahead up to one accumulation window, so the last, partial window is still known
    when it starts.
    """

    def __init__(
        self,
        loader: Any,
        state: StepState,
        device: torch.device,
        lookahead: Callable[[], int],
    ) -> None:
        self.loader = loader
        self._state = state
        self._device = device
        self._lookahead = lookahead
        self._epoch = 0
        self._epoch_set = False

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._epoch_set = True

    @property
    def sampler(self) -> Any:
        return getattr(self.loader, "sampler", None)

    @property
    def batch_size(self) -> int | None:
        return getattr(self.loader, "batch_size", None)

    def __len__(self) -> int:
        return len(self.loader)

    def _sized_len(self) -> int | None:
        try:
            return len(self.loader)
        except TypeError:
            return None

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(self._epoch)
        if not self._epoch_set:
            self._epoch += 1
        self._epoch_set = False
        total = self._sized_len()
        if total is not None:
            yield from self._iter_sized(total)
        else:
            yield from self._iter_lookahead()

    def _publish(self, remaining: int | None, last: bool) -> None:
        self._state.remaining = remaining
        self._state.last = last

    def _iter_sized(self, total: int) -> Iterator[Any]:
        for i, batch in enumerate(self.loader):
            self._publish(total - i, i == total - 1)
            yield _to_device(batch, self._device)
        self._publish(None, False)

    def _iter_lookahead(self) -> Iterator[Any]:
        it = iter(self.loader)
        buffer: collections.deque[Any] = collections.deque()
        exhausted = False
        while True:
            want = max(1, self._lookahead())
            while not exhausted and len(buffer) < want + 1:
                try:
                    buffer.append(next(it))
                except StopIteration:
                    exhausted = True
            if not buffer:
                break
            batch = buffer.popleft()
            remaining = len(buffer) + 1 if exhausted else None
            self._publish(remaining, exhausted and not buffer)
            yield _to_device(batch, self._device)
        self._publish(None, False)
