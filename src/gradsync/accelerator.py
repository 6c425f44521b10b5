"""The Accelerator: a facade over the window, the backend, the registry of prepared objects,
the micro-step runner and the checkpoint state. It wires them together and forwards.

Its keywords are the core settings (gradsync.settings), each declared once. The keyword list
of ``__init__`` and the setting entries of the class docstring's ``Args`` are nevertheless
plain source, written from the declarations by ``python scripts/gen_signatures.py --write``
(between its two comments; the docstring entries by their names): editors complete the
keywords, mypy checks their names and types, and ``inspect.signature``, ``help()`` and the
reference (mkdocstrings reads the source, not the running class) show them. A signature built
at import time, or ``**options: Unpack[...]``, would leave the editors, the reference and
``inspect.signature`` with no keywords to show. The unit tests run the script's ``--check``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import SimpleNamespace
from typing import IO, Any, ParamSpec, TypeVar, overload

import torch
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

from gradsync import audit as audit_mod
from gradsync import metrics, processes
from gradsync._assembly import assemble, attach, end, free_memory
from gradsync._core.microstep import Runner, SelfCheckObserver
from gradsync._core.registry import Prepared
from gradsync._core.run_state import RunState
from gradsync._core.wrappers import PreparedOptimizer, PreparedScheduler
from gradsync._plan.batch_plan import BatchPlan
from gradsync._plan.window import MicroStep, Window
from gradsync._support import dist
from gradsync.backends import kinds
from gradsync.backends._amp import WindowScaler
from gradsync.backends.base import Backend
from gradsync.backends.kinds import DistributedType
from gradsync.checkpoint import export
from gradsync.checkpoint.export import save_model
from gradsync.checkpoint.signals import SignalWatch
from gradsync.checkpoint.state import choose_folder
from gradsync.config import Config, SyncPolicy, load_config
from gradsync.data import LoaderContext, PreparedDataLoader
from gradsync.data.loader import skip_first_batches, split_for_window
from gradsync.errors import UsageError, naming_collective
from gradsync.rules import GRADSYNC, Rules
from gradsync.settings import (
    AccumulationSteps,
    CommHook,
    CommWrapper,
    CompileOption,
    ItemCounter,
    MixedPrecision,
    ModuleSelector,
    OnOom,
    RequestedPolicy,
)

REDUCTIONS = ("mean", "sum", "normalized")
P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")

log = logging.getLogger("gradsync")


def _part(name: str) -> Any:
    """A read-only view of one of an Accelerator's parts (``gradsync._assembly.Parts``)."""
    return property(lambda self: getattr(self._p, name))


class Accelerator:
    """Gradient accumulation that is correct on every backend.

    Settings come from keywords, then ``GRADSYNC_*`` variables (set by ``gradsync launch``),
    then a YAML file; ``Accelerator()`` with no arguments runs what the launcher asked for.

    Args:
        backend: auto (ddp when the world size is above 1, else single), single, ddp, fsdp,
            deepspeed or fairscale (legacy).
        gradient_accumulation_steps: micro-batches per optimizer step (None: 1, or derived from the
            batch sizes), or a schedule: '0:2 100:4', a ramp-up dict, a callable optimizer_step ->
            k.
        micro_batch_size: samples per micro-batch and process (give two of the three sizes to derive
            the third).
        global_batch_size: samples per optimizer step over all processes: micro x k x processes.
        sync_policy: when gradients are reduced: auto (the backend decides), defer (only at the
            window's boundary), every_step, native, defer_replicate (fsdp on a 2-D mesh: across
            replicas only at the boundary).
        mixed_precision: no, bf16 or fp16 (autocast, and a window-aware loss scaler for fp16).
        seed: seeds torch on every rank and the sharded sampler.
        audit: count collectives per micro-step and print a summary per optimizer step.
        sync_with_dataloader: a window ends with the dataloader's pass (False: windows run on across
            passes).
        count_items: fn(batch) -> items (e.g. tokens) it holds, for backward(reduction='sum' or
            'normalized'); from text: 'module:function'.
        grad_scaler: fp16 loss-scaler settings: init_scale, growth_factor, backoff_factor,
            growth_interval.
        activation_checkpointing: modules whose forward is recomputed in backward: class names,
            classes or a callable module -> bool.
        compile: torch.compile the model where the backend wants it: True, or a dict of its
            arguments.
        self_check: with a deferring policy, check the first optimizer steps' collectives and warn
            when a micro-step off the boundary reduced gradients.
        dataset_shards_itself: an IterableDataset yields each rank's own shard itself: gradsync
            leaves it alone.
        sync_memory_budget: bytes per rank that deferring may hold on FSDP2 and ZeRO 2/3 under
            sync_policy=auto (None: a share of the free memory).
        timeout: seconds a collective waits for the other ranks before it fails, naming the
            operation (None: torch's default, 30 min).
        save_on_sigterm: the old name of save_on_signal.
        save_on_signal: a folder: on one of save_signals (a scheduler's notice of preemption), every
            rank saves a checkpoint there (step-N) when the next window starts, then exits 0.
        save_signals: the signals save_on_signal saves on (SLURM sends SIGUSR1 with
            --signal=USR1@90).
        requeue: on SLURM, requeue the job (scontrol requeue) after the save_on_signal checkpoint,
            so that it starts again and resumes from it.
        log_with: experiment trackers for accel.log: tensorboard, wandb, mlflow, csv, jsonl, all, or
            tracker objects (comma-separated from text).
        project_dir: the folder trackers write into (their logging_dir), created by the main
            process.
        track_window_loss: keep accel.window_loss: the global mean of a window's losses, weighted as
            the update (one small all-reduce per optimizer step).
        on_oom: an out-of-memory error inside accumulate: raise it, or split (every rank drops the
            window, halves the micro-batch, doubles k and runs the window again from its first
            sample: the global batch is kept); split is refused with deepspeed.
        comm_hook: compress the gradient sync: no, fp16 or bf16 (sent in that dtype: ddp hook, fsdp
            reduce dtype, deepspeed communication_data_type), power_sgd or batched_power_sgd (ddp
            only); runs at the boundary only under defer.
        comm_wrapper: with a PowerSGD comm_hook: send its matrices as fp16 or bf16 (no: as the
            gradients).
        comm_state_option: PowerSGD's options: matrix_approximation_rank, start_powerSGD_iter,
            min_compression_rate, use_error_feedback, warm_start, ... (torch's PowerSGDState; from
            text: a JSON object).
        config_file: a YAML (or JSON) file of settings (default: ``GRADSYNC_CONFIG``).
        **options: a backend's options: ``ddp_kwargs``, ``find_unused_parameters`` (ddp);
            ``fsdp_wrap``, ``fsdp_keep_params_in_window``, ``fsdp_reshard_after_backward``,
            ``fsdp_mesh``, ``parallelism``, ``tp_plan``, ``pp_split``, ``pp_schedule``,
            ``pp_microbatches``, ``pp_stages_per_rank``, ``fsdp_state_dict_type``,
            ``fsdp_memory_budget`` (fsdp); ``deepspeed_config`` (deepspeed); ``fairscale_kwargs``
            (fairscale). The settings reference lists every setting.

    Attributes:
        config: every setting after the sources were merged and checked (a ``Config``).

    Raises:
        ConfigError: an unknown setting, an invalid value, or batch sizes that contradict
            each other or the number of processes.
    """

    #: Where gradsync's and Accelerate's rules differ, this Accelerator follows gradsync's
    #: (``gradsync.accelerate.Accelerator`` follows Accelerate's): see ``gradsync.rules``.
    _rules: Rules = GRADSYNC

    def __init__(
        self,
        *,
        # -- generated by scripts/gen_signatures.py from gradsync.settings: do not edit --
        backend: str | None = None,
        gradient_accumulation_steps: AccumulationSteps | None = None,
        micro_batch_size: int | None = None,
        global_batch_size: int | None = None,
        sync_policy: RequestedPolicy | None = None,
        mixed_precision: MixedPrecision | None = None,
        seed: int | None = None,
        audit: bool | None = None,
        sync_with_dataloader: bool | None = None,
        count_items: ItemCounter | str | None = None,
        grad_scaler: dict[str, Any] | None = None,
        activation_checkpointing: ModuleSelector | None = None,
        compile: CompileOption | None = None,
        self_check: bool | None = None,
        dataset_shards_itself: bool | None = None,
        sync_memory_budget: int | None = None,
        timeout: float | None = None,
        save_on_sigterm: str | os.PathLike[str] | None = None,
        save_on_signal: str | os.PathLike[str] | None = None,
        save_signals: str | Sequence[str] | None = None,
        requeue: bool | None = None,
        log_with: str | Sequence[Any] | None = None,
        project_dir: str | os.PathLike[str] | None = None,
        track_window_loss: bool | None = None,
        on_oom: OnOom | None = None,
        comm_hook: CommHook | None = None,
        comm_wrapper: CommWrapper | None = None,
        comm_state_option: dict[str, Any] | None = None,
        # -- end of the generated part --
        config_file: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> None:
        # Every keyword above but config_file is a core setting (the generated block): they go
        # to load_config by name.
        given = {k: v for k, v in locals().items() if k not in ("self", "config_file", "options")}
        self.config: Config = load_config(config_file=config_file, **given, **options)
        self._p = assemble(self, self.config, self._rules)
        attach(self, self._p)  # the stop-on-signal check, and extensions (gradsync verify)

    @property
    def audit(self) -> audit_mod.Recorder | None:
        """The collective counter with ``audit=True``, else None (also None when the process
        group was made outside gradsync)."""
        return self._p.audit

    # -- the parts (for gradsync's own tests and tools) ----------------------
    _backend: Backend = _part("backend")
    _window: Window = _part("window")
    _prepared: Prepared = _part("prepared")
    _runner: Runner = _part("runner")
    _loaders: LoaderContext = _part("loaders")
    _signals: SignalWatch = _part("signals")

    @property
    def _self_check(self) -> SelfCheckObserver | None:
        return self._p.gradients.self_check

    # -- where we are -----------------------------------------------------
    @property
    def backend(self) -> str:
        """The resolved backend name."""
        return self._backend.name

    @property
    def sync_policy(self) -> SyncPolicy:
        """The resolved sync policy: "defer", "every_step", "native" or "defer_replicate"."""
        return self._backend.policy

    @property
    def mesh(self) -> Any:
        """The ``DeviceMesh`` FSDP2 shards over (2-D under ``fsdp_mesh``: replicate, shard), or
        under ``parallelism`` the named N-D mesh (dp_replicate, dp_shard, tp); None on a
        backend without one."""
        return getattr(self._backend, "mesh", None)

    @property
    def distributed_type(self) -> DistributedType:
        """Accelerate's name of this kind of run (``DistributedType.MULTI_CPU``, ``FSDP``...);
        equal to Accelerate's own members."""
        return kinds.distributed_type(self.backend, self.device.type, self.world_size)

    @property
    def state(self) -> RunState:
        """Where the run stands, in Accelerate's ``AcceleratorState`` names."""
        return RunState(self)

    @property
    def deepspeed_plugin(self) -> Any:
        """Under DeepSpeed, an object whose ``deepspeed_config`` is the config in use; else None."""
        config = getattr(self._backend, "ds_config", None)
        return SimpleNamespace(deepspeed_config=config) if config is not None else None

    @property
    def sync_policy_reason(self) -> str:
        """Why the backend resolved that policy, with its numbers ("" when it says nothing)."""
        return self._backend.policy_reason

    @property
    def rank(self) -> int:
        """This process's rank (0 in one process)."""
        return dist.rank_info()[0]

    @property
    def world_size(self) -> int:
        """The number of processes."""
        return dist.rank_info()[1]

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine."""
        return dist.rank_info()[2]

    @property
    def is_main_process(self) -> bool:
        """Rank 0: the process that prints and writes shared files."""
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        """The first process on this machine (e.g. to download or write local files)."""
        return self.local_rank == 0

    @property
    def process_index(self) -> int:
        """Accelerate's name for ``rank``."""
        return self.rank

    @property
    def local_process_index(self) -> int:
        """Accelerate's name for ``local_rank``."""
        return self.local_rank

    @property
    def num_processes(self) -> int:
        """Accelerate's name for ``world_size``."""
        return self.world_size

    @property
    def is_last_process(self) -> bool:
        """The process of the highest rank."""
        return self.rank == self.world_size - 1

    @property
    def mixed_precision(self) -> str:
        """ "no", "bf16" or "fp16"."""
        return self.config.mixed_precision

    @property
    def device(self) -> torch.device:
        """The device this process trains on."""
        return self._backend.device

    @property
    def plan(self) -> BatchPlan:
        """The batch plan: micro batch size, accumulation steps, data-parallel size, global
        batch size (the first prepared dataloader fixes the micro batch size when unset)."""
        return self._p.preparer.plan

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step of the window in progress (or the next one).
        Setting it replaces a schedule; it takes effect when the next window starts.

        Raises:
            ConfigError: set to something other than a whole number >= 1.
        """
        return self._window.steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
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
        """The last prepared optimizer, also one the backend built (a DeepSpeed config's).

        Raises:
            UsageError: no optimizer was prepared.
        """
        return self._prepared.last_optimizer()

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last boundary's optimizer step was skipped (an fp16 overflow on some
        rank: every rank skips, and the scheduler does not step)."""
        return any(o.step_was_skipped for o in self._prepared.optimizers)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps really applied so far (with several optimizers, each stepping once
        per window: the most any of them applied)."""
        return self._prepared.steps_applied()

    @property
    def scaler(self) -> WindowScaler | None:
        """The fp16 loss scaler (``get_scale``, ``state_dict``, ``load_state_dict`` for
        checkpoints); None without ``mixed_precision="fp16"`` and on DeepSpeed, whose own
        scaler is saved with its checkpoints."""
        return self._backend.scaler

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast ``accumulate`` runs the micro-steps under, for code outside the block
        (evaluation, a metric): ``with accel.autocast(): model(x)``.

        Returns:
            A context manager (a no-op without mixed precision)."""
        return self._backend.autocast()

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

        Args:
            *objects: a ``torch.nn.Module``, its ``torch.optim.Optimizer`` (over that model's
                parameters), dataloaders (``DataLoader``) and LR schedulers.

        Returns:
            The prepared objects in the order given (a single object when one is given).

        Raises:
            ConfigError: an object gradsync cannot prepare, several models or optimizers in
                one call, an optimizer without its model or over another model's parameters.
        """
        return self._p.preparer.prepare(objects)

    # -- the micro-step ---------------------------------------------------
    def accumulate(self, *models: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """One micro-step: forward and backward go inside; sync only when the window closes.

        After the block, ``sync_gradients`` keeps this micro-step's decision, so
        ``optimizer.step()`` and friends may also follow the block. If the block raises, the
        open window is dropped (its gradients cleared on every backend) and the error
        propagates.

        Args:
            *models: every prepared model trained in the micro-step.

        Returns:
            The context manager of the micro-step: ``with accel.accumulate(model): ...``.

        Raises:
            UsageError: no model given, or the block entered inside another one.
        """
        if not models:
            raise UsageError(
                "accumulate() needs the prepared model: `with accel.accumulate(model):`"
            )
        return self._p.runner.run(models)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """Manual control: one micro-step whose backward never synchronises, whatever the
        window says (Accelerate's ``no_sync``). Inside it ``backward`` divides the loss by
        ``gradient_accumulation_steps`` (as Accelerate does) and ``optimizer.step()`` does
        nothing; the audit and the self-check see it as a micro-step off the boundary.

        Args:
            model: a prepared model.

        Returns:
            The context manager of the micro-step.
        """
        return self._p.runner.run((model,), force=False)

    def trigger_sync_in_backward(
        self, model: torch.nn.Module
    ) -> contextlib.AbstractContextManager[None]:
        """Manual control: one micro-step that closes the window, so the next backward of
        ``model`` reduces the gradients accumulated so far, even when the forward ran inside
        ``no_sync`` (Accelerate's ``trigger_sync_in_backward``); ``optimizer.step()`` applies
        inside and after it. ``backward`` divides the loss by ``gradient_accumulation_steps``.

        Args:
            model: a prepared model.

        Returns:
            The context manager of the micro-step.
        """
        return self._p.runner.run((model,), force=True)

    def skip_first_batches(
        self, dataloader: PreparedDataLoader, num_batches: int = 0
    ) -> PreparedDataLoader:
        """The prepared ``dataloader``, whose next pass starts after its first
        ``num_batches`` batches (on this rank), for resuming by hand. ``load_state`` already
        resumes a prepared loader mid-epoch; called after it (Accelerate's resume pattern) it
        skips nothing more: the count ``load_state`` restored is a no-op, another count is
        said in one warning line (the checkpoint knows where the run stood).

        Args:
            dataloader: a loader returned by ``prepare``.
            num_batches: the batches to skip.

        Returns:
            The same loader (later passes are whole).

        Raises:
            ConfigError: a loader that was not prepared, or a negative ``num_batches``.
        """
        return skip_first_batches(dataloader, num_batches)

    def split_batch(self, batch: Any, micro_batch_size: int) -> list[Any]:
        """Cut a loader batch into micro-batches for several micro-steps per loader batch: run
        one ``accumulate()`` block per micro-batch returned. The window counts them as
        micro-steps and still closes at the end of the data with the right size.

        Args:
            batch: a batch the prepared loader just yielded (tensors, nested allowed).
            micro_batch_size: rows per micro-batch (the last may be smaller).

        Returns:
            The micro-batches, in order.

        Raises:
            ConfigError: ``micro_batch_size`` is not a whole number >= 1.
            UsageError: micro-batches of the previous split have not all run yet.
        """
        return split_for_window(self._window, batch, micro_batch_size)

    def planned_optimizer_steps(self, num_epochs: int, loader: Any = None) -> int:
        """The optimizer steps ``num_epochs`` passes over a prepared dataloader will give,
        with the accumulation schedule and the partial windows at the ends of passes; warns
        when a prepared LR scheduler was built for another number of steps.

        Args:
            num_epochs: passes over the data.
            loader: the prepared loader (default: the first one prepared).

        Returns:
            The number of optimizer steps.

        Raises:
            ConfigError: ``num_epochs`` is not a whole number >= 1.
            UsageError: no prepared dataloader, or one without a length.
        """
        return self._p.planner.planned_optimizer_steps(num_epochs, loader)

    @property
    def window_items(self) -> int:
        """Items (e.g. tokens) in the whole global window in progress: all its micro-batches on
        all ranks, counted by ``count_items`` when the window starts (the last window's count
        between windows).

        Raises:
            ConfigError: the Accelerator was built without ``count_items``.
            UsageError: no window fed by a prepared dataloader has started yet.
        """
        return self._p.gradients.window_items

    def backward(self, loss: torch.Tensor, reduction: str = "mean", **kwargs: Any) -> None:
        """Backward of the micro-batch's loss, scaled so the update is the window's mean.

        Args:
            loss: the micro-batch's loss.
            reduction: ``"mean"``: ``loss`` is the micro-batch's mean; it is divided by the
                number of micro-batches in this window (the update is the mean of
                micro-batch means). ``"sum"``: ``loss`` is summed over the micro-batch's
                items; gradsync scales it so the update is the mean over every item of the
                global window (needs ``count_items``). ``"normalized"``: ``loss`` is already
                divided by ``accel.window_items``; gradsync only undoes the data-parallel
                averaging of gradients.
            **kwargs: passed on to torch's backward (``retain_graph=True``, ``inputs=...``).

        Raises:
            UsageError: called outside ``accumulate`` while accumulating (with ``"sum"`` or
                ``"normalized"``: called outside ``accumulate`` at all).
            ConfigError: an unknown ``reduction``, or one that needs ``count_items``.
            CollectiveError: another rank stopped answering during the gradient reduction.
        """
        self._p.gradients.backward(loss, reduction, kwargs)

    def pipeline_step(
        self,
        model: torch.nn.Module,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[..., torch.Tensor],
        reduction: str = "mean",
    ) -> torch.Tensor | None:
        """One micro-step of a pipelined model: one schedule step (``pp_schedule``) that runs
        the forward and the backward of ``pp_microbatches`` parts of the micro-batch through
        every stage. It takes the place of ``model(inputs)`` and ``accel.backward(loss)``
        inside ``accumulate``; the optimizer step, clipping, the scheduler and ``zero_grad``
        stay as they are. On a model without a pipeline it runs
        ``accel.backward(loss_fn(model(inputs), targets), reduction)`` and returns that loss,
        so the same loop runs in one process (the reference a pipeline must equal).

        Args:
            model: the stage ``prepare`` returned (``parallelism`` with pp > 1).
            inputs: the micro-batch's inputs (read by the first stage; every stage of one
                pipeline is given the same micro-batch). For a Transformers decoder, a
                mapping ``{"input_ids": ids, "attention_mask": mask}`` hands the padding
                mask to every stage (without a pipeline: ``model(**inputs)``).
            targets: the micro-batch's targets (read by the last stage).
            loss_fn: ``loss_fn(outputs, targets)`` of one part; gradsync scales it so that
                the update is the window's mean, as ``backward`` does.
            reduction: ``"mean"``: ``loss_fn`` gives the part's mean, and the update is the
                mean of micro-batch means. ``"sum"``: ``loss_fn`` sums over the part's items
                (tokens), and the update is the mean over every item of the global window
                (needs ``count_items``).

        Returns:
            On the last stage the micro-batch's loss (detached: the mean of its parts'
                losses, or with ``"sum"`` their sum); None on the other stages (no
                collective is spent to send it there).

        Raises:
            UsageError: called outside ``accumulate``; an ``attention_mask`` whose shape is
                not the ``input_ids``'.
            ConfigError: ``pp_microbatches`` does not divide this micro-batch; an unknown
                ``reduction``, or ``"sum"`` without ``count_items``.
        """
        return self._p.gradients.pipeline_step(model, inputs, targets, loss_fn, reduction)

    @property
    def window_loss(self) -> float:
        """The loss the last window's update minimised: the global mean of the losses passed
        to ``backward`` in that window, weighted exactly as the update weights them (per
        micro-batch for ``reduction="mean"``, per item for ``"sum"`` and ``"normalized"``),
        over every micro-batch of every rank; equal on every rank. It is taken at the
        window's first ``optimizer.step()`` (or the end of its last micro-step) with one small
        all-reduce on every rank, waited for on the first read: reading it on one rank only
        never hangs. NaN for a window in which no backward ran.

        Raises:
            UsageError: no window has closed yet.
            ConfigError: the Accelerator was built with ``track_window_loss=False``.
        """
        return self._p.gradients.window_loss

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor | None:
        """Clip at a boundary and return the global gradient norm; off it, do nothing.

        Args:
            parameters: the parameters whose gradients are clipped.
            max_norm: the largest norm allowed.
            norm_type: the p of the p-norm.

        Returns:
            The global norm before clipping (equal on every rank), or None off the boundary.

        Raises:
            UsageError: called at a boundary before a model was prepared.
            CollectiveError: another rank stopped answering while the norm was reduced.
        """
        return self._p.gradients.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clamp each gradient element to ``[-clip_value, clip_value]`` at a boundary; off
        it, do nothing.

        Args:
            parameters: the parameters whose gradients are clamped.
            clip_value: the largest absolute value allowed.

        Raises:
            UsageError: called at a boundary before a model was prepared.
        """
        self._p.gradients.clip_grad_value_(parameters, clip_value)

    # -- checkpoints ---------------------------------------------------------
    def save_state(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        keep_last: int | None = None,
        background: bool = False,
        output_dir: str | os.PathLike[str] | None = None,
    ) -> str:
        """Save everything training needs to go on exactly: models, optimizers, schedulers,
        the window (also mid-window, with each rank's local gradients, where the backend
        can: DeepSpeed and fairscale save only at a boundary), every rank's RNG, every
        prepared loader's position and the registered objects, into the folder ``path``
        (atomically). Call it on every rank, outside the accumulate block.

        Args:
            path: the checkpoint folder to write (None: ``project_dir/checkpoints/step-N``,
                N the optimizer steps so far).
            keep_last: then keep only the newest N checkpoints in ``path``'s parent folder.
            background: return as soon as every rank has written its files; rank 0 then
                makes them durable (fsync), marks the folder complete and renames it into
                place in a thread while training goes on. Until then the folder is not there
                (``latest_checkpoint`` returns the previous one); ``wait_for_checkpoint()``
                waits for it, and the next ``save_state``, ``load_state`` and ``end()`` do so
                first. A failed commit raises from ``wait_for_checkpoint()`` or ``end()``; the
                next save or load warns about it and goes on.
            output_dir: Accelerate's name for ``path``.

        Returns:
            The folder.

        Raises:
            ConfigError: no folder given and no ``project_dir`` set, or both ``path`` and
                ``output_dir``.
            UsageError: called inside ``accumulate``.
            CheckpointError: the backend cannot save the open window, or a write failed on
                a rank (every rank raises the same line: the folder, the file, the OS error
                and the checkpoint kept; nothing else changed, and training can go on).
            CollectiveError: another rank stopped answering.
        """
        path = choose_folder(
            "save_state",
            path,
            "output_dir",
            output_dir,
            self.config.project_dir,
            self.optimizer_steps,
        )
        with naming_collective(f"save_state({os.fspath(path)!r})", self.config.timeout):
            return self._p.state.save(path, keep_last, background=background)

    def wait_for_checkpoint(self) -> str | None:
        """Wait until a ``save_state(..., background=True)`` is committed (on every rank).

        Returns:
            Its folder, or None when none was pending.

        Raises:
            CheckpointError: the commit failed (on every rank; the previous checkpoint is
                still there).
        """
        with naming_collective("wait_for_checkpoint()", self.config.timeout):
            return self._p.state.settle()

    def load_state(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        trusted: bool = False,
        input_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        """Restore a checkpoint written by ``save_state`` (on every rank, after ``prepare``).
        The next pass over each prepared loader resumes at the first batch not yet consumed;
        ``loader.epoch`` is that pass's epoch. Loading never runs code from the folder: every
        pickle in it is checked first against what the backend's format holds.

        Args:
            path: the checkpoint folder.
            trusted: skip that check and load whatever objects the files hold. Such a load
                can run code from the folder: only for checkpoints whose origin you trust.
            input_dir: Accelerate's name for ``path``.

        Raises:
            ConfigError: no folder given, or both ``path`` and ``input_dir``.
            CheckpointError: a missing, incomplete, corrupted, incompatible or unsafe
                checkpoint (one error on every rank; nothing is changed).
        """
        path = choose_folder("load_state", path, "input_dir", input_dir, None, 0)
        with naming_collective(f"load_state({os.fspath(path)!r})", self.config.timeout):
            self._p.state.load(path, trusted=trusted)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and load these objects with the checkpoint; rank 0's state is saved.

        Args:
            *objects: anything with ``state_dict`` / ``load_state_dict`` (EMA weights, counters).

        Raises:
            ConfigError: an object without ``state_dict()`` and ``load_state_dict()``.
        """
        self._prepared.register(objects)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> str:
        """The model's full weights, gathered from every rank and written by rank 0 into the
        folder ``save_directory`` in Transformers' layout, which ``from_pretrained`` reads
        (call it on every rank): ``model.safetensors``, or numbered shards and
        ``model.safetensors.index.json`` when the weights exceed ``max_shard_size``, plus
        ``config.json`` (and ``generation_config.json``) for a Transformers model. Tied
        weights are written once; earlier weights files in the folder are replaced.

        Args:
            model: a prepared model.
            save_directory: the folder to write into (created when missing).
            max_shard_size: the largest shard: bytes as an int, or a string such as
                ``"5GB"`` (5 * 10**9 bytes) or ``"5GiB"`` (5 * 2**30); a tensor larger than
                it gets a shard of its own.
            safe_serialization: safetensors files; False writes ``pytorch_model.bin``
                (``torch.save``) files instead.

        Returns:
            The folder's path.

        Raises:
            ConfigError: ``save_directory`` is an existing file, or ``max_shard_size`` is not
                a size.
            CollectiveError: another rank stopped answering while the weights were gathered.
        """
        with naming_collective("save_model() (gathering the weights)", self.config.timeout):
            return save_model(
                self._backend,
                model,
                save_directory,
                self.rank,
                max_shard_size=max_shard_size,
                safe_serialization=safe_serialization,
            )

    def save(
        self, obj: Any, f: str | os.PathLike[str] | IO[bytes], safe_serialization: bool = False
    ) -> None:
        """Save ``obj`` on the main process only, in place of ``torch.save`` (the other ranks
        write nothing and do not wait). A path is written under a temporary name, then
        renamed.

        Args:
            obj: anything ``torch.save`` takes; with ``safe_serialization``, a dict of tensors.
            f: a path, or a binary file open for writing.
            safe_serialization: write safetensors instead of ``torch.save``'s pickle.

        Raises:
            ConfigError: ``safe_serialization`` with something other than a dict of tensors.
        """
        export.save(obj, f, main=self.is_main_process, safe_serialization=safe_serialization)

    def register_save_state_pre_hook(
        self,
        hook: Callable[[list[torch.nn.Module], list[dict[str, Any]], str], None],
    ) -> RemovableHandle:
        """Call ``hook(models, weights, output_dir)`` in every ``save_state``, on every rank,
        once every rank has written its files into the folder being written (``output_dir``:
        files the hook adds there are committed with the checkpoint; when a rank's write
        failed, no hook runs).
        ``models`` are the prepared models unwrapped, ``weights`` their full state dicts
        (on rank 0 at least). Unlike Accelerate, removing entries from the lists does not
        keep a model out of the checkpoint: gradsync always saves every model it resumes.

        Args:
            hook: the function to call.

        Returns:
            A handle whose ``remove()`` unregisters it.
        """
        return self._p.state.add_save_hook(hook, self.unwrap_model, self.get_state_dict)

    def register_load_state_pre_hook(
        self, hook: Callable[[list[torch.nn.Module], str], None]
    ) -> RemovableHandle:
        """Call ``hook(models, input_dir)`` in every ``load_state``, on every rank, once the
        checkpoint is verified and before anything is loaded (``models``: the prepared
        models, unwrapped). gradsync then loads every model itself.

        Args:
            hook: the function to call.

        Returns:
            A handle whose ``remove()`` unregisters it.
        """
        return self._p.state.add_load_hook(hook, self.unwrap_model)

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget everything prepared (models, optimizers, schedulers, loaders, registered
        objects) and drop an open window, then collect garbage and empty the CUDA cache, e.g.
        between two trainings in one process. Reassign what you hold:
        ``model, optimizer = accel.free_memory(model, optimizer)``.

        Args:
            *objects: your references to prepared objects.

        Returns:
            One None per object given.
        """
        free_memory(self._p)
        return [None for _ in objects]

    @property
    def stop_requested(self) -> bool:
        """One of ``save_signals`` was received (with ``save_on_signal``): the job saves and
        exits when the next window starts."""
        return self._signals.received is not None

    # -- models and processes ----------------------------------------------
    def unwrap_model(
        self,
        model: torch.nn.Module,
        keep_fp32_wrapper: bool = True,
        keep_torch_compile: bool = True,
    ) -> torch.nn.Module:
        """The user's module inside whatever wrapper ``prepare`` put around it.

        Args:
            model: a prepared model.
            keep_fp32_wrapper: Accelerate's; gradsync puts no precision wrapper around the
                forward, so there is none to keep or drop.
            keep_torch_compile: Accelerate's; gradsync returns the module itself (not a
                compiled wrapper) either way, so its state dict keys are the model's own.

        Returns:
            The module as it was passed to ``prepare``.
        """
        return self._backend.unwrap(model)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The full, unsharded state dict on CPU (on rank 0 at least; a collective on sharded
        backends).

        Args:
            model: a prepared model.
            unwrap: Accelerate's; the keys are always the unwrapped module's.

        Returns:
            Parameter and buffer names mapped to tensors.
        """
        return self._backend.state_dict(model)

    def wait_for_everyone(self) -> None:
        """A barrier: every rank waits until all reach it.

        Raises:
            CollectiveError: another rank stopped answering.
        """
        with naming_collective("wait_for_everyone() (a barrier)", self.config.timeout):
            self._backend.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first, the others once it is done (e.g. to build
        a dataset cache once)."""
        with processes.goes_first(self.is_main_process, self._backend.barrier):
            yield

    # -- experiment tracking ------------------------------------------------
    def init_trackers(
        self,
        project_name: str,
        config: dict[str, Any] | None = None,
        init_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Start the trackers of ``log_with`` (created on the main process only) and record
        ``config`` with the run. Call it once, on every rank, before ``log``.

        Args:
            project_name: the run's name: its folder under ``project_dir`` (TensorBoard, CSV,
                JSON lines), the W&B project, the MLflow experiment.
            config: hyperparameters to record with the run.
            init_kwargs: per tracker name, the keyword arguments of that library's init,
                e.g. ``{"wandb": {"tags": ["k4"]}, "tensorboard": {"flush_secs": 30}}``.

        Raises:
            UsageError: called a second time.
            ConfigError: an empty project name, a config that is not a dict, or an
                ``init_kwargs`` entry for a name that is no tracker.
        """
        self._p.trackers.init(project_name, config, init_kwargs)

    def log(
        self,
        values: dict[str, Any],
        step: int | None = None,
        log_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Record ``values`` with every tracker, on the main process only; on the other
        processes it returns at once and never waits for another rank. One-element tensors
        (any device) and NumPy scalars are recorded as Python numbers; what each tracker
        does with strings, dicts and other values: the tracking guide.

        Args:
            values: name -> value, e.g. ``{"loss": accel.window_loss}``.
            step: the step to record them at (None: ``optimizer_steps``, the optimizer
                steps applied so far).
            log_kwargs: per tracker name, keyword arguments for that tracker's ``log``,
                e.g. ``{"wandb": {"commit": False}}``.

        Raises:
            UsageError: before ``init_trackers`` (with ``log_with`` set), or after
                ``end_training``.
            ConfigError: ``values`` is not a dict with str keys, holds a key the csv or
                jsonl tracker writes itself ("step", "wall_time"), or a ``log_kwargs``
                entry names no tracker.
        """
        self._p.trackers.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """A started tracker: gradsync's wrapper, or with ``unwrap=True`` the library's own
        object (TensorBoard's ``SummaryWriter``, the wandb ``Run``, the ``MlflowClient``,
        the CSV or JSON-lines file's path). On the other processes a tracker that does
        nothing: every method called on it returns None.

        Args:
            name: the tracker's name ("tensorboard", "wandb", "mlflow", "csv", "jsonl", or a
                tracker object's ``name``).
            unwrap: return the library's object instead of gradsync's wrapper.

        Returns:
            The tracker, or its library object.

        Raises:
            UsageError: before ``init_trackers``.
            ConfigError: no tracker of that name (the message lists the started ones).
        """
        return self._p.trackers.get(name, unwrap)

    @property
    def trackers(self) -> list[Any]:
        """The started trackers (gradsync's wrappers and the tracker objects given in
        ``log_with``) on the main process after ``init_trackers``; an empty list on the
        other processes."""
        return self._p.trackers.started

    def end_training(self) -> None:
        """Finish every tracker on the main process (flush and close its files, finish the
        wandb run, end the MLflow run), then ``end()``. Call it on every rank when training
        is over.

        Raises:
            CheckpointError: a background checkpoint commit failed (from ``end()``).
            Exception: the first error a tracker raised while finishing (``end()`` has run).
        """
        try:
            self._p.trackers.finish()
        finally:
            self.end()

    # -- metrics across ranks (collectives: call them on every rank) --------
    def gather(self, data: Any) -> Any:
        """Each tensor of ``data`` from every rank, concatenated along the first dimension in
        rank order.

        Args:
            data: a tensor, or dicts / lists / tuples of tensors.

        Returns:
            The same structure with gathered tensors.
        """
        with self._p.runner.own_collective():
            return metrics.gather(data)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """``gather`` for evaluation: when ``input_data`` holds one row per sample of the
        batch a prepared loader just yielded, the rows come back in the sampler's order (the
        dataset's order without shuffling) and the duplicates that the sampler padded in at
        the end of the pass are dropped, so each sample is counted exactly once.

        Only the loader being iterated counts (as in Accelerate): after its pass ended, or
        over a loader that was never prepared (which duplicates nothing), everything
        gathered comes back.

        Objects are gathered instead of tensors with ``use_gather_object``, or when
        ``input_data`` holds anything but tensors (a list of generated strings, say): a list
        with one entry per sample of that batch comes back in the sampler's order with the
        padding dropped, like the rows; any other object as ``gradsync.gather_object``
        gives it (a list, one entry per rank; lists concatenated).

        Args:
            input_data: a tensor, dicts / lists / tuples of tensors, or any picklable
                object.
            use_gather_object: gather as objects even when ``input_data`` holds only tensors
                (tensors of different shapes per sample, which ``gather`` would have to pad);
                they travel pickled through the CPU.

        Returns:
            The same structure with gathered tensors, or on the object path a list.
        """
        it = self._loaders.iterating()
        with self._p.runner.own_collective():  # over the ranks that read distinct batches
            return metrics.gather_for_metrics(
                input_data, it, self._backend.data_parallel, use_gather_object=use_gather_object
            )

    def reduce(
        self, tensor: Any, reduction: str = "sum", scale: float = 1.0, op: str | None = None
    ) -> Any:
        """Each tensor of ``tensor`` reduced over ranks (on an N-D mesh: the data-parallel
        ranks of this rank's tensor-parallel coordinate), then multiplied by ``scale``, as
        Accelerate's ``Accelerator.reduce`` documents it. Where Accelerate's code differs
        from its documentation, gradsync follows the documentation: ``scale`` applies on
        every backend (Accelerate: XLA only) and ``"none"`` reduces nothing (Accelerate's
        code sums).

        Args:
            tensor: a tensor, or dicts / lists / tuples of tensors.
            reduction: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` (every rank gets the
                result; integers are averaged as float64), or ``"none"`` (no collective:
                this rank's own values).
            scale: a factor every result is multiplied by (integers scaled by a factor other
                than 1 become float64).
            op: the former name of ``reduction``, kept as an alias; with a ``reduction``
                other than the default ``"sum"`` the two must agree.

        Returns:
            The same structure with reduced tensors.

        Raises:
            ConfigError: an unknown reduction, or ``op`` and ``reduction`` that disagree.
        """
        with self._p.runner.own_collective():
            return metrics.reduce(
                tensor, reduction, scale, op, group=self._backend.data_parallel.group
            )

    # -- where code runs (no collectives, except the *_process_first barriers) --
    @contextlib.contextmanager
    def split_between_processes(self, inputs: S, apply_padding: bool = False) -> Iterator[S]:
        """This rank's contiguous share of ``inputs`` (e.g. prompts for distributed
        inference)::

            with accel.split_between_processes(["A", "B", "C"]) as prompts:
                ...  # rank 0 of 2: ["A", "B"]; rank 1: ["C"] (["C", "C"] with apply_padding)

        The first ``len(inputs) % world_size`` ranks get one entry more. Not a collective.

        Args:
            inputs: a list, a tuple, a tensor (split along its first dimension), a dataset
                with ``select`` (a Hugging Face ``datasets.Dataset``), or a dict of them
                with one length.
            apply_padding: repeat the last entry of ``inputs`` at the end of the shorter
                shares so every rank gets as many, which ``gather`` needs (drop the repeats
                after gathering).

        Yields:
            The share (``inputs`` itself in one process).

        Raises:
            ConfigError: an input that cannot be split, or a dict whose values differ in
                length.
        """
        with processes.split_between_processes(
            inputs, self.rank, self.world_size, apply_padding
        ) as share:
            yield share

    def on_main_process(self, function: Callable[P, R]) -> Callable[P, R | None]:
        """A decorator: ``function`` runs on the main process (rank 0) only; elsewhere a
        call returns None. The rank is read at each call.

        Args:
            function: the function to decorate.

        Returns:
            The decorated function.
        """
        return processes.on_main_process(function, ranks=self)

    def on_local_main_process(self, function: Callable[P, R]) -> Callable[P, R | None]:
        """A decorator: ``function`` runs on the first process of each machine only;
        elsewhere a call returns None.

        Args:
            function: the function to decorate.

        Returns:
            The decorated function.
        """
        return processes.on_local_main_process(function, ranks=self)

    def on_last_process(self, function: Callable[P, R]) -> Callable[P, R | None]:
        """A decorator: ``function`` runs on the last process (rank ``world_size - 1``)
        only; elsewhere a call returns None.

        Args:
            function: the function to decorate.

        Returns:
            The decorated function.
        """
        return processes.on_last_process(function, ranks=self)

    @overload
    def on_process(
        self, function: Callable[P, R], process_index: int | None = None
    ) -> Callable[P, R | None]: ...
    @overload
    def on_process(
        self, function: None = None, process_index: int | None = None
    ) -> processes.Decorator: ...
    def on_process(
        self, function: Callable[..., Any] | None = None, process_index: int | None = None
    ) -> Callable[..., Any] | processes.Decorator:
        """A decorator: ``function`` runs on the process of rank ``process_index`` only;
        elsewhere a call returns None. Written ``@accel.on_process(process_index=1)``. In
        one process it runs whatever the index (as in Accelerate).

        Args:
            function: the function to decorate (None: return the decorator).
            process_index: the rank that runs it.

        Returns:
            The decorated function, or without ``function`` the decorator.

        Raises:
            ConfigError: no ``process_index`` or a negative one; at a call, an index that
                no process has (with more than one process).
        """
        if function is None:
            return processes.on_process(process_index=process_index, ranks=self)
        return processes.on_process(function, process_index=process_index, ranks=self)

    @overload
    def on_local_process(
        self, function: Callable[P, R], local_process_index: int | None = None
    ) -> Callable[P, R | None]: ...
    @overload
    def on_local_process(
        self, function: None = None, local_process_index: int | None = None
    ) -> processes.Decorator: ...
    def on_local_process(
        self, function: Callable[..., Any] | None = None, local_process_index: int | None = None
    ) -> Callable[..., Any] | processes.Decorator:
        """A decorator: ``function`` runs on the process of local rank
        ``local_process_index`` of each machine only; elsewhere a call returns None.
        Written ``@accel.on_local_process(local_process_index=1)``. In one process it runs
        whatever the index.

        Args:
            function: the function to decorate (None: return the decorator).
            local_process_index: the local rank that runs it, on every machine.

        Returns:
            The decorated function, or without ``function`` the decorator.

        Raises:
            ConfigError: no ``local_process_index`` or a negative one; at a call, an index
                not below the number of processes (with more than one process).
        """
        if function is None:
            return processes.on_local_process(local_process_index=local_process_index, ranks=self)
        return processes.on_local_process(
            function, local_process_index=local_process_index, ranks=self
        )

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """The first process of each machine runs the block first, the others on that
        machine once it is done (e.g. to build a cache on each machine's disk once). Call
        it on every rank."""
        with processes.goes_first(self.is_local_main_process, self._backend.barrier):
            yield

    def pad_across_processes(
        self, data: Any, dim: int = 0, pad_index: float = 0, pad_first: bool = False
    ) -> Any:
        """Each tensor of ``data`` padded along ``dim`` to the largest size on any rank.

        Args:
            data: a tensor, or dicts / lists / tuples of tensors.
            dim: the dimension to pad.
            pad_index: the value padded in.
            pad_first: pad at the start instead of the end.

        Returns:
            The same structure with padded tensors.
        """
        with self._p.runner.own_collective():
            return metrics.pad_across_processes(data, dim, pad_index, pad_first)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print()`` on the main process only (flushed).

        Args:
            *args: what ``print`` takes.
            **kwargs: what ``print`` takes.
        """
        if self.is_main_process:
            print(*args, **kwargs, flush=True)

    def end(self) -> None:
        """Wait for a background checkpoint commit, finish the trackers (as ``end_training``
        does), then destroy the process group if gradsync created it (also done at exit).

        Raises:
            CheckpointError: a background commit failed (on rank 0, which committed).
            Exception: the first error a tracker raised while finishing.
        """
        end(self._p)
