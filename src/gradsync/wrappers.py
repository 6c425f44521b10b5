"""Prepared optimizer, scheduler and dataloader: thin wrappers that obey the boundary.

They share one ``StepState`` with the Accelerator that made them (never a global).
"""

from __future__ import annotations

import collections
import itertools
import logging
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
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
    yields: int = 0  # batches yielded by all prepared loaders (orders their iterations)
    iterations: list[weakref.ref[LoaderIteration]] = field(default_factory=list)

    def live_iterations(self) -> list[LoaderIteration]:
        # Runs every micro-step: keep the existing weak references, only drop finished passes.
        self.iterations = [ref for ref in self.iterations if (it := ref()) is not None and not it.done]
        return [it for it in (ref() for ref in self.iterations) if it is not None]

    def feeding_iteration(self) -> LoaderIteration | None:
        """The prepared-loader pass that fed this micro-step: of the passes that yielded since
        the previous micro-step, the one started last (an inner loop of a nested pair); among
        passes started together (``zip``), the first."""
        fed = [it for it in self.live_iterations() if it.fresh]
        for it in fed:
            it.fresh = False
        if not fed:
            return None
        return max(fed, key=lambda it: (it.started_at, -it.serial))


class PreparedOptimizer(torch.optim.Optimizer):
    """Steps only at a boundary; ``zero_grad`` does nothing while a window is open (inside
    ``accumulate()`` or between its micro-steps), and each new window starts from cleared
    gradients. So both loop orders (``zero_grad`` at the top of the loop, or after
    ``step``), calls after the block, and a plain ``loss.backward()`` all accumulate
    correctly, and the gradients stay readable after ``step()`` until the next window.
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
        # Data and hook registration of the wrapped optimizer pass through; its other methods
        # (e.g. a SAM-style first_step) would change the weights off the boundary: refused.
        if name == "optimizer":
            raise AttributeError(name)
        value = getattr(self.optimizer, name)
        if callable(value) and not name.startswith("register_"):
            raise AttributeError(
                f"{type(self.optimizer).__name__}.{name}() is not gated by gradsync's "
                "accumulation window; call it on accel-prepared optimizer.optimizer only when "
                "accel.sync_gradients is True"
            )
        return value

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
    plain_random = (
        type(loader.sampler) is RandomSampler
        and not loader.sampler.replacement
        and loader.sampler._num_samples is None
    )
    if not (plain_random or type(loader.sampler) is SequentialSampler):
        raise ConfigError(
            f"the dataloader's sampler is a {type(loader.sampler).__name__} (or a RandomSampler "
            "with replacement/num_samples), which gradsync "
            "cannot shard over ranks without changing what it samples; shard it yourself (each "
            "rank its own indices, equal batch counts, e.g. a DistributedSampler over your "
            "subset) and gradsync keeps it as it is"
        )
    sampler: DistributedSampler[Any] = DistributedSampler(
        loader.dataset, num_replicas=world_size, rank=rank,
        shuffle=plain_random, seed=seed, drop_last=loader.drop_last,
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


_SERIAL = itertools.count()


class LoaderIteration:
    """One pass over a prepared loader: reads one batch ahead (a window ahead on request),
    knows where the pass stands, and re-raises a loading error at the batch that caused it."""

    def __init__(self, owner: PreparedDataLoader, source: Iterator[Any], total: int | None) -> None:
        self.owner = owner
        self.source = source
        self.total = total
        self.buffer: collections.deque[Any] = collections.deque()
        self.exhausted = False
        self.error: BaseException | None = None
        self.done = False
        self.yielded = 0
        self.fresh = False  # yielded since the previous micro-step
        self.remaining: int | None = None  # batches left, the last yielded one included
        self.last = False
        self.started_at = owner._state.yields
        self.serial = next(_SERIAL)

    def __iter__(self) -> LoaderIteration:
        return self

    def _fill(self, n: int) -> None:
        while not self.exhausted and self.error is None and len(self.buffer) < n:
            try:
                self.buffer.append(next(self.source))
            except StopIteration:
                self.exhausted = True
            except Exception as err:  # raised when its batch's turn comes, not earlier
                self.error = err

    def peek(self, n: int) -> int | None:
        """Batches left from the last yielded one on, if the data ends within ``n``; else None."""
        self._fill(n)
        left = len(self.buffer) + 1
        return left if self.error is None and self.exhausted and left <= n else None

    def __next__(self) -> Any:
        self._fill(2)  # the batch to hand out and one more, to see the end coming
        if not self.buffer:
            self.done = True
            if self.error is not None:
                error, self.error = self.error, None
                raise error
            raise StopIteration
        batch = self.buffer.popleft()
        left = len(self.buffer) + 1
        if self.error is None and self.exhausted:
            self.remaining = left
        elif self.total is not None and self.total - self.yielded >= left:
            self.remaining = self.total - self.yielded  # len() agrees with what was read
        else:
            self.remaining = None
        self.last = self.error is None and self.exhausted and not self.buffer
        self.yielded += 1
        self.fresh = True
        self.owner._state.yields += 1
        return _to_device(batch, self.owner._device)


class PreparedDataLoader:
    """Iterates the (sharded) loader and tells the window where the epoch stands.

    Each pass reads one batch ahead, so it knows the epoch's last batch even when ``len()``
    is wrong or absent; with a sized loader it knows how many batches remain, and an unsized
    one can be asked to read up to one window ahead when a window starts. The window
    follows the pass that fed the micro-step (see ``StepState.feeding_iteration``).
    """

    def __init__(
        self,
        loader: Any,
        state: StepState,
        device: torch.device,
        on_epoch_start: Callable[[PreparedDataLoader], None],
    ) -> None:
        self.loader = loader
        self._state = state
        self._device = device
        self._on_epoch_start = on_epoch_start
        self._epoch = 0
        self._epoch_set = False
        self._sampler_epoch = 0
        self._user_epochs = False
        self._current: LoaderIteration | None = None
        self._current_epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next pass (it reshuffles the shards); counted up by itself."""
        self._epoch = epoch
        self._epoch_set = True

    def state_dict(self) -> dict[str, Any]:
        """The epoch in progress (or the next one between passes) and the batches it yielded."""
        it = self._current
        if it is not None and not it.done:
            return {"epoch": self._current_epoch, "batches_yielded": it.yielded}
        return {"epoch": self._epoch, "batches_yielded": 0}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the epoch's order (skip ``batches_yielded`` batches yourself to go on mid-epoch)."""
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

    def __iter__(self) -> LoaderIteration:
        sampler = self.sampler
        if isinstance(sampler, DistributedSampler):
            if not self._epoch_set and sampler.epoch != self._sampler_epoch:
                self._user_epochs = True  # the user calls sampler.set_epoch(): leave it to them
            if self._epoch_set or not self._user_epochs:
                sampler.set_epoch(self._epoch)
            self._sampler_epoch = sampler.epoch
        self._current_epoch = self._epoch
        self._epoch += 1
        self._epoch_set = False
        self._on_epoch_start(self)
        it = LoaderIteration(self, iter(self.loader), self._sized_len())
        self._current = it
        self._state.iterations.append(weakref.ref(it))
        return it

    def _sized_len(self) -> int | None:
        try:
            return len(self.loader)
        except TypeError:
            return None
