"""Prepared optimizer, scheduler and dataloader: thin wrappers that obey the boundary.

They share one ``StepState`` with the Accelerator that made them (never a global).
"""

from __future__ import annotations

import collections
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from gradsync.errors import ConfigError

if TYPE_CHECKING:
    from gradsync.backends.base import Backend

log = logging.getLogger("gradsync")


@dataclass
class StepState:
    """What the wrappers need to know about the micro-step in progress (or the last one)."""

    sync: bool = True  # the current (or, after the block, the last) micro-step is a boundary
    in_window: bool = False  # inside accumulate(), or between micro-steps of an unfinished window
    optimizer_steps: int = 0  # optimizer steps really applied, all prepared optimizers together
    remaining: int | None = None  # batches left in the epoch, this one included (None: unknown)
    last: bool = False  # the batch just yielded is the epoch's last
    driver: object | None = None  # the prepared dataloader whose position drives the window
    peek: Callable[[int], int | None] | None = None  # the driver's look-ahead (see PreparedDataLoader)


class PreparedOptimizer(torch.optim.Optimizer):
    """Steps only at a boundary and then clears the window's gradients; ``zero_grad`` does
    nothing while a window is open (inside ``accumulate()`` or between its micro-steps).
    So both loop orders (``zero_grad`` at the top of the loop, or after ``step``), calls
    after the block, and a plain ``loss.backward()`` all accumulate correctly.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, backend: Backend, state: StepState) -> None:
        # Deliberately no super().__init__: the wrapped optimizer owns groups, state and hooks.
        self.optimizer = optimizer
        self._backend = backend
        self._state = state
        self.steps_applied = 0

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

    def __getattr__(self, name: str) -> Any:
        # Hooks and anything else of the Optimizer API: the wrapped optimizer's.
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError(
                "step(closure) is not supported under gradient accumulation; "
                "call the closure yourself inside accel.accumulate()"
            )
        if not self._state.sync:
            return
        if self._backend.step(self.optimizer):
            self.steps_applied += 1
            self._state.optimizer_steps += 1
        # The window is consumed (applied or skipped): its gradients must not leak onward.
        self._backend.zero_grad(self.optimizer, True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self._state.in_window:
            self._backend.zero_grad(self.optimizer, set_to_none)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


class PreparedScheduler:
    """Steps at most once per call, and only when its optimizer applied a step since the
    last call: once per optimizer step in a per-step loop, once per epoch in a per-epoch
    loop, never per micro-step or per skipped step. ``ReduceLROnPlateau`` (stepped with a
    metric, usually per epoch) passes straight through.
    """

    def __init__(self, scheduler: Any, steps: Callable[[], int]) -> None:
        self.scheduler = scheduler
        self._steps = steps
        self._seen = steps()

    def step(self, *args: Any, **kwargs: Any) -> None:
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.scheduler.step(*args, **kwargs)
            return
        now = self._steps()
        if now <= self._seen:
            return
        self._seen = now
        with warnings.catch_warnings():
            # The wrapped optimizer's step was called through the backend; torch cannot see that order.
            warnings.filterwarnings("ignore", message=r".*lr_scheduler\.step\(\)")
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        moved = {k: _to_device(v, device) for k, v in batch.items()}
        try:
            return type(batch)(moved)  # type: ignore[call-arg]
        except TypeError:
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_to_device(v, device) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(_to_device(v, device) for v in batch)
    if hasattr(batch, "to") and callable(batch.to):
        return batch.to(device)
    return batch


def shard_dataloader(loader: DataLoader[Any], *, rank: int, world_size: int, seed: int) -> DataLoader[Any]:
    """A DataLoader over this rank's shard: seeded, reshuffled per epoch, equal batch counts.

    Only the default samplers (sequential, random) are resharded; a DistributedSampler the
    user built is kept as it is; any other sampler is refused rather than silently replaced.
    """
    if world_size == 1 or isinstance(loader.dataset, IterableDataset):
        if world_size > 1:
            log.warning(
                "gradsync: an IterableDataset is not resharded; make each rank yield its own "
                "shard with the same number of batches"
            )
        return loader
    if isinstance(loader.sampler, DistributedSampler):
        return loader
    if loader.batch_size is None:
        raise ConfigError(
            "the dataloader has a custom batch_sampler (batch_size=None), which gradsync cannot "
            "shard over ranks; build the DataLoader with batch_size=..., or give each rank its "
            "own shard (e.g. a DistributedSampler) and the same number of batches"
        )
    if not isinstance(loader.sampler, RandomSampler | SequentialSampler):
        raise ConfigError(
            f"the dataloader's sampler is a {type(loader.sampler).__name__}, which gradsync "
            "cannot shard over ranks without changing what it samples; shard it yourself (each "
            "rank its own indices, equal batch counts, e.g. a DistributedSampler over your "
            "subset) and gradsync keeps it as it is"
        )
    sampler: DistributedSampler[Any] = DistributedSampler(
        loader.dataset, num_replicas=world_size, rank=rank,
        shuffle=isinstance(loader.sampler, RandomSampler), seed=seed, drop_last=loader.drop_last,
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
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, **kwargs)


class PreparedDataLoader:
    """Iterates the (sharded) loader and tells the window where the epoch stands.

    It always reads one batch ahead, so it knows the epoch's last batch even when ``len()``
    is wrong or absent; with a sized loader it knows how many batches remain, with an
    unsized one the Accelerator can ask it (``peek``) to read up to one window ahead, so the
    last, partial window is known when it starts. Only one prepared loader drives the
    window at a time: the outermost one iterating (a loader zipped with or nested in it
    does not).
    """

    def __init__(
        self,
        loader: Any,
        state: StepState,
        device: torch.device,
        on_epoch_start: Callable[[], None],
    ) -> None:
        self.loader = loader
        self._state = state
        self._device = device
        self._on_epoch_start = on_epoch_start
        self._epoch = 0
        self._epoch_set = False
        self._sampler_epoch = 0
        self._user_epochs = False
        self._buffer: collections.deque[Any] = collections.deque()
        self._source: Iterator[Any] | None = None
        self._exhausted = False

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next iteration (it reshuffles the shards); counted up by itself."""
        self._epoch = epoch
        self._epoch_set = True

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.set_epoch(int(state_dict["epoch"]))

    @property
    def sampler(self) -> Any:
        return getattr(self.loader, "sampler", None)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)  # dataset, batch_size, num_workers, ...

    def _fill(self, n: int) -> None:
        """Read ahead until ``n`` batches wait in the buffer or the data ends."""
        assert self._source is not None
        while not self._exhausted and len(self._buffer) < n:
            try:
                self._buffer.append(next(self._source))
            except StopIteration:
                self._exhausted = True

    def peek(self, n: int) -> int | None:
        """Batches left after the one just yielded plus one (i.e. from the current one on),
        if the data ends within ``n``; None when at least ``n`` more remain."""
        self._fill(n)
        left = len(self._buffer) + 1
        return left if self._exhausted and left <= n else None

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        if isinstance(sampler, DistributedSampler):
            if not self._epoch_set and sampler.epoch != self._sampler_epoch:
                self._user_epochs = True  # the user calls sampler.set_epoch(): leave it to them
            if self._epoch_set or not self._user_epochs:
                sampler.set_epoch(self._epoch)
            self._sampler_epoch = sampler.epoch
        self._epoch += 1
        self._epoch_set = False
        drives = self._state.driver is None
        if drives:
            self._on_epoch_start()
            self._state.driver = self
        total = self._sized_len()
        self._source, self._buffer, self._exhausted = iter(self.loader), collections.deque(), False
        try:
            i = 0
            while True:
                self._fill(2)  # the batch to yield and one more, to see the end coming
                if not self._buffer:
                    break
                batch = self._buffer.popleft()
                if drives:
                    self._publish(total, i)
                yield _to_device(batch, self._device)
                i += 1
        finally:
            if drives:
                self._state.remaining, self._state.last = None, False
                self._state.driver, self._state.peek = None, None
            self._source, self._buffer = None, collections.deque()

    def _publish(self, total: int | None, i: int) -> None:
        left_known = len(self._buffer) + 1  # this batch and the ones read ahead
        if self._exhausted:
            remaining: int | None = left_known
        elif total is not None and total - i > left_known - 1:
            remaining = total - i  # len() agrees with what was read so far
        else:
            remaining = None
        self._state.remaining = remaining
        self._state.last = self._exhausted and not self._buffer
        self._state.peek = None if remaining is not None else self.peek

    def _sized_len(self) -> int | None:
        try:
            return len(self.loader)
        except TypeError:
            return None
