"""The Accelerator: prepare, accumulate, backward, clip, and what a training loop asks of it."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, overload

import torch
from torch.utils.data import DataLoader

from gradsync import audit as audit_mod
from gradsync import backends
from gradsync.accumulation import MicroStep, Window
from gradsync.backends import _dist
from gradsync.batching import BatchPlan
from gradsync.config import Config, SyncPolicy, load_config
from gradsync.data import PreparedDataLoader, shard_dataloader
from gradsync.errors import ConfigError
from gradsync.wrappers import PreparedOptimizer, PreparedScheduler

log = logging.getLogger("gradsync")


def _is_scheduler(obj: Any) -> bool:
    return hasattr(obj, "step") and hasattr(obj, "optimizer") and hasattr(obj, "state_dict")


def _is_dataloader(obj: Any) -> bool:
    return isinstance(obj, torch.utils.data.DataLoader) or (
        hasattr(obj, "__iter__") and hasattr(obj, "dataset")
    )


class Accelerator:
    """Gradient accumulation that is correct on every backend.

    Settings come from keywords, then ``GRADSYNC_*`` variables (set by ``gradsync launch``),
    then a YAML file; ``Accelerator()`` with no arguments runs what the launcher asked for.

    Args:
        backend: "auto" (ddp when the world size is above 1, else single), "single",
            "ddp", "fsdp", "deepspeed" or "fairscale" (legacy).
        gradient_accumulation_steps: micro-batches per optimizer step (default 1).
        sync_policy: "auto", "defer", "every_step" or "native" (see the docs).
        seed: seeds torch on every rank and the sharded sampler.
        micro_batch_size / global_batch_size: give two of the three sizes to derive the third.
        audit: count collectives per micro-step and print a summary per optimizer step.
        **options: backend options (``deepspeed_config``, ``fsdp_memory_budget``, ...).
    """

    def __init__(
        self,
        *,
        backend: str | None = None,
        gradient_accumulation_steps: int | None = None,
        sync_policy: str | None = None,
        seed: int | None = None,
        micro_batch_size: int | None = None,
        global_batch_size: int | None = None,
        mixed_precision: str | None = None,
        audit: bool | None = None,
        config_file: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> None:
        self.config: Config = load_config(
            config_file=config_file,
            backend=backend,
            gradient_accumulation_steps=gradient_accumulation_steps,
            sync_policy=sync_policy,
            seed=seed,
            micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size,
            mixed_precision=mixed_precision,
            audit=audit,
            **options,
        )
        _, world, _ = _dist.rank_info()
        name = backends.resolve_auto(self.config.backend, world)
        self.plan = BatchPlan.solve(
            data_parallel_size=world,
            global_batch_size=self.config.global_batch_size,
            micro_batch_size=self.config.micro_batch_size,
            gradient_accumulation_steps=self.config.gradient_accumulation_steps,
        )
        # The plan is the one source of truth for batch sizes; it reaches the backend at prepare.
        if self.config.seed is not None:
            torch.manual_seed(self.config.seed)
        self._backend = backends.create(name)
        self._backend.setup(self.config)
        self._window = Window(self.plan.gradient_accumulation_steps)
        self._view = self._window.view
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[PreparedOptimizer] = []
        self.audit: audit_mod.Recorder | None = None
        if self.config.audit:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                # None when the group was made outside gradsync: nothing is counted, and an
                # empty record would read as "no collectives" (ensure_process_group warned).
                self.audit = audit_mod.recorder_of()
            else:
                self.audit = audit_mod.Recorder()  # one process: there is nothing to count
        self._audit_window_start = len(self.audit.records) if self.audit is not None else 0

    # -- where we are -----------------------------------------------------
    @property
    def backend(self) -> str:
        """The resolved backend name."""
        return self._backend.name

    @property
    def sync_policy(self) -> SyncPolicy:
        """The resolved sync policy: "defer", "every_step" or "native"."""
        return self._backend.policy

    @property
    def sync_policy_reason(self) -> str:
        """Why the backend resolved that policy, with its numbers ("" when it says nothing)."""
        return self._backend.policy_reason

    @property
    def rank(self) -> int:
        return _dist.rank_info()[0]

    @property
    def world_size(self) -> int:
        return _dist.rank_info()[1]

    @property
    def local_rank(self) -> int:
        return _dist.rank_info()[2]

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        return self._backend.device

    @property
    def gradient_accumulation_steps(self) -> int:
        return self._window.steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        """Change the window length; it takes effect when the next window starts."""
        self._window.steps = value

    @property
    def sync_gradients(self) -> bool:
        """True when the micro-step in progress closes its window; after the block, the last
        micro-step's decision (True before the first one)."""
        return self._window.boundary

    @property
    def micro_step(self) -> MicroStep | None:
        """The micro-step in progress (its index, window size and boundary flag), or None."""
        return self._window.current

    @property
    def optimizer(self) -> PreparedOptimizer:
        """The last prepared optimizer, also one the backend built (a DeepSpeed config's)."""
        if not self._optimizers:
            raise RuntimeError(
                "accel.optimizer: no optimizer was prepared; pass one to accel.prepare(model, optimizer)"
            )
        return self._optimizers[-1]

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps really applied so far, all prepared optimizers together."""
        return sum(o.steps_applied for o in self._optimizers)

    # -- prepare ----------------------------------------------------------
    @overload
    def prepare(self, model: torch.nn.Module, /) -> torch.nn.Module: ...
    @overload
    def prepare(self, loader: DataLoader[Any], /) -> PreparedDataLoader: ...
    @overload
    def prepare(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, /
    ) -> tuple[torch.nn.Module, PreparedOptimizer]: ...
    @overload
    def prepare(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader[Any], /
    ) -> tuple[torch.nn.Module, PreparedOptimizer, PreparedDataLoader]: ...
    @overload
    def prepare(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: DataLoader[Any],
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        /,
    ) -> tuple[torch.nn.Module, PreparedOptimizer, PreparedDataLoader, PreparedScheduler]: ...
    @overload
    def prepare(self, *objects: Any) -> Any: ...

    def prepare(self, *objects: Any) -> Any:
        """Wrap a model, optimizer, dataloader and scheduler (any subset, any order).

        Returns them in the order given (a single object when one is given).
        """
        models = [o for o in objects if isinstance(o, torch.nn.Module)]
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        if len(models) > 1 or len(optimizers) > 1:
            raise ConfigError(
                f"prepare() got {len(models)} models and {len(optimizers)} optimizers; "
                "prepare one model and its optimizer per call"
            )
        if any(isinstance(o, PreparedOptimizer) for o in optimizers):
            raise ConfigError("prepare() got an optimizer that is already prepared; pass the original")
        if optimizers and not models:
            raise ConfigError(
                "prepare() got an optimizer without its model; pass both: "
                "`model, optimizer = accel.prepare(model, optimizer)`"
            )
        for obj in objects:
            batch = getattr(obj, "batch_size", None) if _is_dataloader(obj) else None
            if batch is not None and self.plan.micro_batch_size is None:
                # The first prepared dataloader fixes the micro batch size (DeepSpeed needs it).
                self.plan = BatchPlan.solve(
                    data_parallel_size=self.plan.data_parallel_size,
                    micro_batch_size=batch,
                    gradient_accumulation_steps=self.plan.gradient_accumulation_steps,
                )
        out: dict[int, Any] = {}
        new_optimizer: torch.optim.Optimizer | None = None
        old_optimizer = optimizers[0] if optimizers else None
        if models:
            model = models[0]
            if old_optimizer is not None:
                self._check_optimizer_holds(model, old_optimizer)
            wrapped, new_optimizer = self._backend.prepare(model, old_optimizer, self.plan)
            self._models.append(wrapped)
            out[id(model)] = wrapped
            if new_optimizer is not None:
                # The backend may build one itself (DeepSpeed's config optimizer): see .optimizer.
                prepared = PreparedOptimizer(new_optimizer, self._backend, self._view)
                self._optimizers.append(prepared)
                if old_optimizer is not None:
                    out[id(old_optimizer)] = prepared
        for obj in objects:
            if id(obj) in out:
                continue
            if _is_scheduler(obj):
                if old_optimizer is not None and new_optimizer is not None and obj.optimizer is old_optimizer:
                    obj.optimizer = new_optimizer
                out[id(obj)] = PreparedScheduler(obj, self._step_counter(obj.optimizer))
            elif _is_dataloader(obj):
                out[id(obj)] = self._prepare_dataloader(obj)
            else:
                raise ConfigError(
                    f"prepare() does not know what to do with a {type(obj).__name__}; pass a "
                    "torch.nn.Module, a torch.optim.Optimizer, a DataLoader or an LR scheduler"
                )
        result = tuple(out[id(o)] for o in objects)
        return result[0] if len(result) == 1 else result

    def _step_counter(self, optimizer: Any) -> Callable[[], int]:
        """The applied-step count of the prepared optimizer wrapping ``optimizer`` (all
        prepared optimizers together when it is none of them)."""
        for prepared in self._optimizers:
            if prepared.optimizer is optimizer or prepared is optimizer:
                return lambda: prepared.steps_applied
        return lambda: self.optimizer_steps

    @staticmethod
    def _check_optimizer_holds(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        own = {id(p) for p in model.parameters()}
        held = [p for group in optimizer.param_groups for p in group["params"]]
        foreign = sum(1 for p in held if id(p) not in own)
        if foreign:
            raise ConfigError(
                f"the optimizer holds {foreign} of {len(held)} parameters that are not the model's; "
                "build the optimizer over model.parameters() of the model you prepare with it"
            )

    def _prepare_dataloader(self, loader: Any) -> PreparedDataLoader:
        batch = getattr(loader, "batch_size", None)
        if self.plan.micro_batch_size is not None and batch is not None and batch != self.plan.micro_batch_size:
            raise ConfigError(
                f"the dataloader's batch_size={batch} contradicts micro_batch_size="
                f"{self.plan.micro_batch_size} ({self.plan.describe()}); build the DataLoader with "
                f"batch_size={self.plan.micro_batch_size} or change the batch plan"
            )
        seed = self.config.seed if self.config.seed is not None else 0
        sharded = shard_dataloader(loader, rank=self.rank, world_size=self.world_size, seed=seed)
        return PreparedDataLoader(sharded, self._window, self.device, self._on_epoch_start)

    def _on_epoch_start(self, loader: PreparedDataLoader) -> None:
        """A loader starts a new pass. If the open window was being fed by that loader (its
        last pass was broken off mid-window), the window cannot be completed: drop it rather
        than carry its gradients into the next window."""
        if self._window.fed_by(loader):
            log.warning(
                "gradsync: a new epoch starts inside an unfinished accumulation window (did the "
                "loop break early?); dropping its gradients so they do not leak into the next window"
            )
            self._drop_window()

    def _clear_grads(self) -> None:
        for prepared in self._optimizers:
            self._backend.zero_grad(prepared.optimizer, True)

    def _drop_window(self) -> None:
        """Abandon the open window on every layer: the window's counters, the backend's
        accumulated gradients (wherever it keeps them), the optimizers' gradients."""
        self._window.drop()
        self._backend.abort_window(self._models)
        self._clear_grads()

    # -- the micro-step ---------------------------------------------------
    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """One micro-step: forward and backward go inside; sync only when the window closes.

        Pass every prepared model trained in the micro-step. After the block,
        ``sync_gradients`` keeps this micro-step's decision, so ``optimizer.step()`` and
        friends may also follow the block. If the block raises, the open window is dropped
        (its gradients cleared on every backend) and the error propagates.
        """
        if not models:
            raise TypeError("accumulate() needs the prepared model: `with accel.accumulate(model):`")
        step = self._window.begin()
        if step.index == 0:
            try:
                self._clear_grads()  # every window starts from cleared gradients
                self._backend.begin_window(models)
            except BaseException:
                self._window.drop()
                raise
        if self.audit is not None:
            self.audit.open(step.boundary)
        backend = self._backend
        try:
            if len(models) == 1:
                with backend.micro_step(models[0], boundary=step.boundary):
                    yield
            else:
                with contextlib.ExitStack() as stack:
                    for model in models:
                        stack.enter_context(backend.micro_step(model, boundary=step.boundary))
                    yield
        except BaseException:
            if self.audit is not None:
                self.audit.close()
            self._drop_window()  # a stray step() after the error applies nothing
            raise
        self._window.end()
        if step.boundary:
            backend.end_window(models)
        if self.audit is not None:
            self.audit.close()
            if step.boundary:
                self._report_audit()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss / n``, n the number of micro-batches in this window."""
        step = self._window.current
        if step is None:
            if self._window.steps > 1:
                raise RuntimeError(
                    f"accel.backward() was called outside `with accel.accumulate(model):` while "
                    f"gradient_accumulation_steps={self._window.steps}; put the forward and the "
                    "backward inside the accumulate block, which decides when gradients sync"
                )
            scale = 1
        else:
            scale = step.size
        self._backend.backward(loss / scale if scale != 1 else loss)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor | None:
        """Clip at a boundary and return the global gradient norm; off it, do nothing (None)."""
        if not self._window.boundary:
            return None
        if not self._models:
            raise RuntimeError("clip_grad_norm_() before prepare(); prepare the model first")
        return self._backend.clip_grad_norm_(self._models[-1], parameters, max_norm, norm_type)

    # -- models and processes ----------------------------------------------
    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return self._backend.unwrap(model)

    def get_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """The full, unsharded state dict on CPU (on rank 0 at least)."""
        return self._backend.state_dict(model)

    def wait_for_everyone(self) -> None:
        self._backend.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs, flush=True)

    def end(self) -> None:
        """Destroy the process group if gradsync created it (also done at exit)."""
        if self._backend.owns_group:
            self._models.clear()
            _dist.release_process_group()

    # -- audit ------------------------------------------------------------
    def _report_audit(self) -> None:
        assert self.audit is not None
        window = self.audit.records[self._audit_window_start :]
        self._audit_window_start = len(self.audit.records)
        if self.is_main_process and window:
            print(
                f"[gradsync audit] rank {self.rank} step {self._window.completed_windows} "
                f"({self.backend}, {self.sync_policy}): {self.audit.summary(window)}",
                file=sys.stdout,
                flush=True,
            )
