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
from gradsync import backends, checkpoint_state, metrics, selfcheck
from gradsync._util import check_positive_int
from gradsync.accumulation import MicroStep, Window
from gradsync.backends import _group as _dist
from gradsync.backends._amp import WindowScaler
from gradsync.batching import BatchPlan, solve_with_schedule
from gradsync.checkpoint_state import CheckpointState
from gradsync.config import Config, SyncPolicy, load_config
from gradsync.data import LoaderContext, PreparedDataLoader, shard_dataloader
from gradsync.data import split_batch as _split_batch
from gradsync.errors import ConfigError, naming_collective
from gradsync.planning import length_mismatch, plan_steps
from gradsync.wrappers import PreparedOptimizer, PreparedScheduler

REDUCTIONS = ("mean", "sum", "normalized")

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
        mixed_precision: "no", "bf16" or "fp16" (autocast plus a loss scaler, see ``scaler``).
        activation_checkpointing: module class names, classes or a callable ``module -> bool``
            picking the modules whose forward is recomputed in backward.
        compile: True or a dict of ``torch.compile`` arguments: compile where the backend wants it.
        audit: count collectives per micro-step and print a summary per optimizer step.
        timeout: seconds a collective waits for the other ranks before it fails with an
            error naming the operation (``GRADSYNC_TIMEOUT``; torch's default is 30 min).
        save_on_sigterm: a folder; on SIGTERM (preemption) every rank saves a checkpoint
            there (``step-N``) when the next window starts, then exits with status 0.
        **options: the other settings: ``count_items``, ``sync_with_dataloader``, ``self_check``
            (default on), ``find_unused_parameters``, ``dataset_shards_itself``, backend options
            (``deepspeed_config``, ``sync_memory_budget``, ``fsdp_keep_params_in_window``, ...);
            see docs/guide.md.
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
        activation_checkpointing: Any = None,
        compile: bool | dict[str, Any] | None = None,
        audit: bool | None = None,
        timeout: float | None = None,
        save_on_sigterm: str | os.PathLike[str] | None = None,
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
            activation_checkpointing=activation_checkpointing,
            compile=compile,
            audit=audit,
            timeout=timeout,
            save_on_sigterm=None if save_on_sigterm is None else os.fspath(save_on_sigterm),
            **options,
        )
        _, world, _ = _dist.rank_info()
        name = backends.resolve_auto(self.config.backend, world)
        self.plan, schedule = solve_with_schedule(
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
        self._window = Window(schedule, follow_data=self.config.sync_with_dataloader)
        self._view = self._window.view
        self._models: list[torch.nn.Module] = []
        self._model_optimizers: list[PreparedOptimizer | None] = []  # parallel to _models
        self._registered: list[Any] = []
        self._state = CheckpointState(self)
        self._trained: list[torch.nn.Module] = []  # prepared models with trainable parameters
        self._optimizers: list[PreparedOptimizer] = []
        self._count_items = self.config.count_items
        self._pending_count: tuple[Any, torch.Tensor, BaseException | None] | None = None
        self._schedulers: list[PreparedScheduler] = []
        self._prepared_loaders: list[PreparedDataLoader] = []
        self._planned_steps: int | None = None
        self._length_warned: set[int] = set()
        self._loaders = LoaderContext(self._window, self._backend.device, self._on_epoch_start,
                                      self._count_items)
        self.audit: audit_mod.Recorder | None = None
        if self.config.audit:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                # None when the group was made outside gradsync: nothing is counted, and an
                # empty record would read as "no collectives" (ensure_process_group warned).
                self.audit = audit_mod.recorder_of()
                if self.audit is not None:
                    self.audit.enabled = True  # a group made for the self-check records nothing
            else:
                self.audit = audit_mod.Recorder()  # one process: there is nothing to count
        self._audit_window_start = len(self.audit.records) if self.audit is not None else 0
        self._self_check = selfcheck.start(
            enabled=self.config.self_check, audit=self.audit, policy=lambda: self._backend.policy,
            rank=self.rank, world_size=self.world_size, backend=self.backend,
        )
        self._sigterm = checkpoint_state.SigtermWatch(self.config.save_on_sigterm)

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
    def gradient_accumulation_steps(self, value: int) -> None:  # replaces a schedule
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
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last boundary's optimizer step was skipped (an fp16 overflow on some
        rank: every rank skips, and the scheduler does not step)."""
        return any(o.step_was_skipped for o in self._optimizers)

    @property
    def scaler(self) -> WindowScaler | None:
        """The fp16 loss scaler (``get_scale``, ``state_dict``, ``load_state_dict`` for
        checkpoints); None without ``mixed_precision="fp16"`` and on DeepSpeed, whose own
        scaler is saved with its checkpoints."""
        return self._backend.scaler

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast ``accumulate`` runs the micro-steps under, for code outside the block
        (evaluation, a metric): ``with accel.autocast(): model(x)``."""
        return self._backend.autocast()

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
        scalers = [o for o in objects if hasattr(o, "scale") and hasattr(o, "unscale_")]
        if scalers:
            raise ConfigError(
                f"prepare() got a {type(scalers[0]).__name__}: gradsync runs one loss scaler per "
                f"run (mixed_precision={self.config.mixed_precision!r}); drop yours, set "
                "mixed_precision='fp16' and use accel.backward(loss) (accel.scaler holds its state)"
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
            self._model_optimizers.append(None)
            if any(p.requires_grad for p in wrapped.parameters()):
                self._trained.append(wrapped)
            out[id(model)] = wrapped
            if new_optimizer is not None:
                # The backend may build one itself (DeepSpeed's config optimizer): see .optimizer.
                prepared = PreparedOptimizer(new_optimizer, self._backend, self._view, self._timeout)
                self._optimizers.append(prepared)
                self._model_optimizers[-1] = prepared
                if old_optimizer is not None:
                    out[id(old_optimizer)] = prepared
        for obj in objects:
            if id(obj) in out:
                continue
            if _is_scheduler(obj):
                if old_optimizer is not None and new_optimizer is not None and obj.optimizer is old_optimizer:
                    obj.optimizer = new_optimizer
                prepared_scheduler = PreparedScheduler(obj, self._step_counter(obj.optimizer))
                self._schedulers.append(prepared_scheduler)
                self._check_length(prepared_scheduler)
                out[id(obj)] = prepared_scheduler
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
        sharded = shard_dataloader(loader, rank=self.rank, world_size=self.world_size, seed=seed,
                                   dataset_shards_itself=self.config.dataset_shards_itself)
        prepared = PreparedDataLoader(sharded, self._loaders)
        self._prepared_loaders.append(prepared)
        return prepared

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
        if self._sigterm.enabled and not self._window.is_open:
            self._stop_if_told()
        step = self._window.begin()
        if step.index == 0:
            try:
                # Every window starts from cleared gradients: the prepared optimizers' here,
                # the models' (also where no optimizer was prepared) in begin_window.
                self._clear_grads()
                self._backend.begin_window(models)
            except BaseException:
                self._window.drop()
                raise
        if self.audit is not None:
            self.audit.open(step.boundary)
        check = self._self_check
        if check is not None:
            check.begin(step.boundary)
        backend = self._backend
        try:
            if step.index == 0 and self._count_items is not None:
                self._count_window_items(step.size)
            with naming_collective(lambda: f"the forward/backward of micro-step {step.index + 1} of "
                                   f"{step.size} (window {self._window.completed_windows + 1})", self._timeout):
                if len(models) == 1:
                    with backend.micro_step(models[0], boundary=step.boundary):
                        yield
                else:
                    with contextlib.ExitStack() as stack:
                        for model in models:
                            stack.enter_context(backend.micro_step(model, boundary=step.boundary))
                        yield
                self._settle_count()
        except BaseException:
            with contextlib.suppress(Exception):  # the block's own error is the one to raise
                self._settle_count()
            if check is not None:
                check.abort()
            if self.audit is not None:
                self.audit.close()
            self._drop_window()  # a stray step() after the error applies nothing
            raise
        self._window.end()
        if step.boundary:
            with naming_collective("the end of the accumulation window", self._timeout):
                backend.end_window(models)
            if self._window.skips_step:
                log.warning(
                    "gradsync: window %d holds no item (count_items gave 0 on every rank); its "
                    "optimizer and scheduler steps are skipped", self._window.completed_windows,
                )
                backend.abort_window(self._models)  # drop whatever its backward left behind
        if check is not None:
            check.end(step.boundary)
            if check.done:
                self._self_check = None
        if self.audit is not None:
            self.audit.close()
            if step.boundary:
                self._report_audit()

    def split_batch(self, batch: Any, micro_batch_size: int) -> list[Any]:
        """Cut a loader batch into micro-batches of ``micro_batch_size`` rows (the last may be
        smaller), for several micro-steps per loader batch: run one ``accumulate()`` block per
        micro-batch returned. The window counts them as micro-steps and still closes at the
        end of the data with the right size."""
        size = check_positive_int("micro_batch_size", micro_batch_size)
        pieces = _split_batch(batch, size)
        self._window.split(len(pieces), size)
        return pieces

    def planned_optimizer_steps(self, num_epochs: int, loader: Any = None) -> int:
        """The optimizer steps ``num_epochs`` passes over the prepared dataloader will give
        (``loader``, or the first one prepared), with the accumulation schedule and the
        partial windows at the ends of passes; warns when a prepared LR scheduler was built
        for another number of steps."""
        check_positive_int("num_epochs", num_epochs)
        loader = loader if loader is not None else (self._prepared_loaders[0] if self._prepared_loaders else None)
        if loader is None:
            raise RuntimeError("planned_optimizer_steps() needs a prepared dataloader: "
                               "accel.prepare(loader) first, or pass loader=...")
        try:
            per_epoch = len(loader)
        except TypeError:
            raise RuntimeError(
                "planned_optimizer_steps() needs a dataloader with a length; this one has none "
                "(an IterableDataset without __len__): count the steps yourself"
            ) from None
        schedule, done = self._window.schedule, self._window.completed_windows
        steps = plan_steps(schedule, per_epoch, num_epochs, start=done,
                           follow_data=self.config.sync_with_dataloader)
        self._planned_steps = steps
        for scheduler in self._schedulers:
            self._check_length(scheduler)
        return steps

    def _check_length(self, scheduler: PreparedScheduler) -> None:
        """Warn once per scheduler built for another number of steps than planned."""
        if self._planned_steps is None or id(scheduler) in self._length_warned:
            return
        message = length_mismatch(scheduler, self._planned_steps)
        if message is not None:
            self._length_warned.add(id(scheduler))
            log.warning(message)

    def _count_window_items(self, size: int) -> None:
        """Count the window's items on this rank (its batches, read ahead) and sum them over
        ranks with one small all-reduce (recorded by the audit as gradsync's own)."""
        feed = self._window.feed
        if feed is None:
            return  # no prepared loader feeds the window: window_items stays unknown
        local, error = 0, None
        try:
            local = feed.count_items(size, self._count_items)
        except Exception as err:  # the other ranks must not wait for this one's count forever
            error = err
        if self.plan.data_parallel_size > 1:
            # Started now, waited for when the count is first needed (the first backward, or
            # window_items): the forward runs meanwhile, so the ranks do not wait for each
            # other at every window start.
            t = torch.tensor([local, int(error is not None)], dtype=torch.int64, device=self.device)
            with self._own_collective():
                work = torch.distributed.all_reduce(t, async_op=True)
            self._pending_count = (work, t, error)
            return
        if error is not None:
            raise error
        self._window.set_items(local)

    def _settle_count(self) -> None:
        """Wait for the window's count all-reduce, if one is in flight, and record the total."""
        pending, self._pending_count = self._pending_count, None
        if pending is None:
            return
        work, t, error = pending
        work.wait()
        total, failed = int(t[0].item()), int(t[1].item())
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(
                f"count_items failed on {failed} other rank(s) for this window; see their error"
            )
        self._window.set_items(total)

    def _own_collective(self) -> contextlib.AbstractContextManager[None]:
        if self.audit is not None:
            return self.audit.own()
        if self._self_check is not None:  # never judged as gradient traffic
            return self._self_check.recorder.own()
        return contextlib.nullcontext()

    @property
    def window_items(self) -> int:
        """Items (e.g. tokens) in the whole global window in progress: all its micro-batches on
        all ranks, counted by ``count_items`` when the window starts (the last window's count
        between windows)."""
        if self._count_items is None:
            raise ConfigError(
                "accel.window_items needs count_items; build the Accelerator with "
                "count_items=gradsync.count_label_tokens (or your own fn(batch) -> int)"
            )
        self._settle_count()
        items = self._window.items
        if items is None:
            raise RuntimeError(
                "accel.window_items is known once a window fed by a prepared dataloader has "
                "started; read it inside `with accel.accumulate(model):` and iterate a loader "
                "returned by accel.prepare(...)"
            )
        return items

    def backward(self, loss: torch.Tensor, reduction: str = "mean") -> None:
        """Backward of the micro-batch's loss, scaled so the update is the window's mean.

        ``reduction="mean"``: ``loss`` is the micro-batch's mean; it is divided by the number
        of micro-batches in this window (the update is the mean of micro-batch means).
        ``"sum"``: ``loss`` is summed over the micro-batch's items; gradsync scales it so the
        update is the mean over every item of the global window (needs ``count_items``).
        ``"normalized"``: ``loss`` is already divided by ``accel.window_items``; gradsync only
        undoes the data-parallel averaging of gradients.
        """
        step = self._window.current
        if reduction == "mean":
            if step is None and self._window.steps > 1:
                raise RuntimeError(
                    f"accel.backward() was called outside `with accel.accumulate(model):` while "
                    f"gradient_accumulation_steps={self._window.steps}; put the forward and the "
                    "backward inside the accumulate block, which decides when gradients sync"
                )
            scale = 1 if step is None else step.size
            with naming_collective(self._backward_name, self._timeout):
                self._run_backward(loss / scale if scale != 1 else loss)
            return
        if reduction not in REDUCTIONS:
            raise ConfigError(f"backward(reduction={reduction!r}) is unknown; use one of {', '.join(REDUCTIONS)}")
        if self._count_items is None:
            raise ConfigError(
                f"backward(reduction={reduction!r}) needs count_items to know the window's items; "
                "build the Accelerator with count_items=gradsync.count_label_tokens (or your own "
                "fn(batch) -> int), or use reduction='mean'"
            )
        if step is None:
            raise RuntimeError(
                f"accel.backward(reduction={reduction!r}) was called outside `with "
                "accel.accumulate(model):`; the window's item count is known only inside it"
            )
        items = self.window_items
        if items == 0:
            return  # nothing to learn from; the boundary skips the step
        world = self.plan.data_parallel_size  # every backend averages gradients over it
        factor = world / items if reduction == "sum" else float(world)
        with naming_collective(self._backward_name, self._timeout):
            self._run_backward(loss * factor if factor != 1 else loss)

    def _backward_name(self) -> str:
        step = self._window.current
        if step is not None and step.boundary:
            return "backward() at the window boundary (the gradient reduction)"
        return "backward()"

    @property
    def _timeout(self) -> float | None:
        return self.config.timeout

    def _run_backward(self, loss: torch.Tensor) -> None:
        self._backend.backward(loss)
        if self._self_check is not None:
            self._self_check.saw_backward()

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor | None:
        """Clip at a boundary and return the global gradient norm; off it, do nothing (None)."""
        params = self._unscaled(parameters, "clip_grad_norm_")
        if params is None:
            return None
        with naming_collective("clip_grad_norm_() (the global gradient norm)", self._timeout):
            return self._backend.clip_grad_norm_(self._trained[-1], params, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clamp each gradient element to ``[-clip_value, clip_value]`` at a boundary; off
        it, do nothing."""
        params = self._unscaled(parameters, "clip_grad_value_")
        if params is not None:
            self._backend.clip_grad_value_(self._trained[-1], params, clip_value)

    def _unscaled(self, parameters: Iterable[torch.Tensor], what: str) -> list[torch.Tensor] | None:
        """At a boundary: the parameters, with the gradients of the optimizers holding them
        unscaled (fp16: once per window, the step then does not unscale again); else None."""
        if not self._window.boundary:
            return None
        if not self._trained:
            raise RuntimeError(f"{what}() before prepare(); prepare the model first")
        params = list(parameters)
        wanted = {id(p) for p in params}
        for prepared in self._optimizers:
            held = (p for group in prepared.param_groups for p in group["params"])
            if any(id(p) in wanted for p in held):
                self._backend.unscale_(prepared.optimizer)
        return params

    # -- checkpoints ---------------------------------------------------------
    def save_state(self, path: str | os.PathLike[str], *, keep_last: int | None = None,
                   background: bool = False) -> str:
        """Save everything training needs to go on exactly: models, optimizers, schedulers,
        the window (also mid-window, with each rank's local gradients, where the backend
        can), every rank's RNG, every prepared loader's position and the registered
        objects, into the folder ``path`` (atomically). Call it on every rank, outside the
        accumulate block. ``keep_last=N`` then keeps only the newest N checkpoints in
        ``path``'s parent folder. Returns the folder.

        ``background=True`` returns as soon as every rank has written its files; rank 0
        then makes them durable (fsync), marks the folder complete and renames it into place
        in a thread while training goes on. Until then the folder is not there
        (``latest_checkpoint`` returns the previous one); ``wait_for_checkpoint()`` waits
        for it, and the next ``save_state``, ``load_state`` and ``end()`` do so first. A
        failed commit raises from ``wait_for_checkpoint()`` or ``end()``; the next save or
        load warns about it and goes on."""
        with naming_collective(f"save_state({os.fspath(path)!r})", self._timeout):
            return self._state.save(path, keep_last, background=background)

    def wait_for_checkpoint(self) -> str | None:
        """Wait until a ``save_state(..., background=True)`` is committed (on every rank);
        returns its folder, or None when none was pending. A commit that failed raises
        CheckpointError here, on every rank (the previous checkpoint is still there)."""
        with naming_collective("wait_for_checkpoint()", self._timeout):
            return self._state.settle()

    def load_state(self, path: str | os.PathLike[str]) -> None:
        """Restore a checkpoint written by ``save_state`` (on every rank, after ``prepare``).
        The next pass over each prepared loader resumes at the first batch not yet consumed;
        ``loader.epoch`` is that pass's epoch. A missing, incomplete, corrupted or
        incompatible checkpoint raises one error on every rank and changes nothing."""
        with naming_collective(f"load_state({os.fspath(path)!r})", self._timeout):
            self._state.load(path)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and load these objects (anything with ``state_dict`` / ``load_state_dict``:
        EMA weights, counters) with the checkpoint; rank 0's state is saved."""
        for obj in objects:
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise ConfigError(
                    f"register_for_checkpointing() got a {type(obj).__name__}, which has no "
                    "state_dict()/load_state_dict(); register objects that have both"
                )
            self._registered.append(obj)

    def save_model(self, model: torch.nn.Module, directory: str | os.PathLike[str]) -> str:
        """The model's full weights as one safetensors file ``model.safetensors`` in
        ``directory``, gathered from every rank and written by rank 0 (call on every rank).
        Tied weights are written once. Returns the file's path."""
        with naming_collective("save_model() (gathering the weights)", self._timeout):
            return checkpoint_state.save_model(self._backend, model, directory, self.rank)

    @property
    def stop_requested(self) -> bool:
        """SIGTERM was received (with ``save_on_sigterm``): the job saves and exits when the
        next window starts."""
        return self._sigterm.received

    def _stop_if_told(self) -> None:
        told = self._sigterm.received
        if self.world_size > 1:
            flag = torch.tensor([int(told)], dtype=torch.int64, device=self.device)
            with self._own_collective(), naming_collective("the SIGTERM check", self._timeout):
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            told = bool(flag.item())
        if not told:
            return
        root = self.config.save_on_sigterm
        assert root is not None
        path = os.path.join(root, f"step-{self.optimizer_steps}")
        with naming_collective(f"save_state({path!r})", self._timeout):
            self._state.save(path, None, pending=1)  # the batch just yielded is not trained on yet
        if self.is_main_process:
            print(f"gradsync: SIGTERM received; saved {path}, exiting", file=sys.stderr, flush=True)
        self.end()
        raise SystemExit(0)

    # -- models and processes ----------------------------------------------
    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return self._backend.unwrap(model)

    def get_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """The full, unsharded state dict on CPU (on rank 0 at least)."""
        return self._backend.state_dict(model)

    def wait_for_everyone(self) -> None:
        with naming_collective("wait_for_everyone() (a barrier)", self._timeout):
            self._backend.barrier()

    @property
    def is_local_main_process(self) -> bool:
        """The first process on this machine (e.g. to download or write local files)."""
        return self.local_rank == 0

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first, the others once it is done (e.g. to build
        a dataset cache once)."""
        if not self.is_main_process:
            self._backend.barrier()
        try:
            yield
        finally:
            if self.is_main_process:
                self._backend.barrier()

    # -- metrics across ranks (collectives: call them on every rank) --------
    def gather(self, data: Any) -> Any:
        """Each tensor of ``data`` (nested dicts / lists allowed) from every rank,
        concatenated along the first dimension in rank order."""
        with self._own_collective():
            return metrics.gather(data)

    def gather_for_metrics(self, data: Any) -> Any:
        """``gather`` for evaluation: when ``data`` holds one row per sample of the batch a
        prepared loader just yielded, the rows come back in the sampler's order (the dataset's
        order without shuffling) and the duplicates that the sampler padded in at the end of
        the pass are dropped, so each sample is counted exactly once."""
        it = self._loaders.last_pass() if self._loaders.last_pass is not None else None
        layout = it.owner.sample_layout(self.world_size) if it is not None else None
        with self._own_collective():
            if it is None or layout is None or self.world_size == 1:
                return metrics.gather(data)
            batch_size, total = layout
            index = it.yielded - 1

            def one(t: torch.Tensor) -> torch.Tensor:
                pieces = metrics.gather_pieces(t)
                return metrics.sampler_order(pieces, batch_index=index, batch_size=batch_size, total=total)

            return metrics.apply(one, data, "gather_for_metrics")

    def reduce(self, data: Any, op: str = "sum") -> Any:
        """Each tensor of ``data`` summed (``"sum"``) or averaged (``"mean"``) over ranks."""
        with self._own_collective():
            return metrics.reduce(data, op)

    def pad_across_processes(self, data: Any, dim: int = 0, pad_index: float = 0,
                             pad_first: bool = False) -> Any:
        """Each tensor of ``data`` padded along ``dim`` to the largest size on any rank."""
        with self._own_collective():
            return metrics.pad_across_processes(data, dim, pad_index, pad_first)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs, flush=True)

    def end(self) -> None:
        """Wait for a background checkpoint commit, then destroy the process group if
        gradsync created it (also done at exit). A background commit that failed raises
        CheckpointError here (on rank 0, which committed)."""
        failed = self._state.finish()
        if self._backend.owns_group:
            self._models.clear()
            _dist.release_process_group()
        if failed is not None:
            raise failed

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
