"""Config -> the typed parts of one Accelerator, wired together: the one place that wires.

The Accelerator (``gradsync.accelerator``) only forwards to these parts.
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gradsync import audit as audit_mod
from gradsync import backends, extensions, tracking
from gradsync import mesh as nd_mesh
from gradsync._core import selfcheck
from gradsync._core.gradients import Gradients
from gradsync._core.microstep import AuditObserver, ItemCount, Runner, SelfCheckObserver
from gradsync._core.oom import OomSplit, check_at_prepare
from gradsync._core.preparer import Preparer
from gradsync._core.registry import Prepared
from gradsync._core.window_loss import WindowLoss
from gradsync._plan.accumulation_schedule import is_schedule
from gradsync._plan.batch_plan import solve_with_schedule
from gradsync._plan.planned_steps import Planner, warn_unfinished
from gradsync._plan.window import Window
from gradsync._support import dist, environment
from gradsync.backends import _group
from gradsync.backends.base import Backend
from gradsync.checkpoint.signals import SignalWatch, requeue_command, stop_if_told
from gradsync.checkpoint.state import CheckpointState
from gradsync.config import Config
from gradsync.data import LoaderContext, PreparedDataLoader
from gradsync.errors import UsageError
from gradsync.rules import Rules

log = logging.getLogger("gradsync")


@dataclass
class Parts:
    """Everything one Accelerator is made of."""

    config: Config
    rules: Rules
    backend: Backend
    window: Window
    prepared: Prepared
    runner: Runner
    loaders: LoaderContext
    state: CheckpointState
    preparer: Preparer
    gradients: Gradients
    planner: Planner
    trackers: tracking.Trackers
    signals: SignalWatch
    audit: audit_mod.Recorder | None
    #: at the end of the run (``end()``, or at exit): a schedule sized for the other rule
    ended: Callable[[], Any]
    attached: list[object] = field(default_factory=list)


def _audit(config: Config) -> audit_mod.Recorder | None:
    if not config.audit:
        return None
    if not dist.is_distributed():
        return audit_mod.Recorder()  # one process: there is nothing to count
    # None when the group was made outside gradsync: nothing is counted, and an empty record
    # would read as "no collectives" (ensure_process_group warned).
    recorder = audit_mod.recorder_of()
    if recorder is not None:
        recorder.enabled = True  # a group made for the self-check records nothing
    return recorder


def assemble(owner: Any, config: Config, rules: Rules) -> Parts:
    """The parts of ``owner`` (the Accelerator being built, for the callbacks that name it)."""
    where = environment.detect()
    if where.problem is not None and not dist.is_distributed():
        raise UsageError(where.problem)  # never N silent single-process runs
    rank, world, _ = dist.rank_info()
    name = backends.resolve_auto(config.backend, world)
    if name == "single" and world > 1 and not dist.is_distributed():
        log.warning(
            "gradsync: backend='single' while %s reports %d processes: each trains a "
            "model of its own; use backend='ddp' (or 'auto') to train one",
            where.scheduler,
            world,
        )
    plan, schedule = solve_with_schedule(  # R x S of an N-D mesh's ranks read distinct data
        data_parallel_size=nd_mesh.data_parallel_size(config.parallelism, world),
        global_batch_size=config.global_batch_size,
        micro_batch_size=config.micro_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
    )  # the one source of truth for batch sizes; it reaches the backend at prepare
    if config.seed is not None:
        torch.manual_seed(config.seed)
    backend = backends.create(name)
    backend.setup(config)
    rank, world, _ = dist.rank_info()  # the backend may have made the group
    window = Window(schedule, follow_data=config.sync_with_dataloader)
    prepared = Prepared()
    runner = Runner(window, backend, prepared, config.timeout)

    def on_epoch_start(loader: PreparedDataLoader) -> None:
        # A new pass of the loader that fed an unfinished window (its last pass was broken
        # off mid-window): the window cannot be completed; drop it, never carry it over.
        if window.fed_by(loader):
            log.warning(
                "gradsync: a new epoch starts inside an unfinished accumulation window (did "
                "the loop break early?); dropping its gradients so they do not leak into "
                "the next window"
            )
            runner.drop()

    loaders = LoaderContext(window, backend.device, on_epoch_start, config.count_items)
    loss = None
    data = backend.data_parallel
    if config.track_window_loss:
        loss = WindowLoss(backend.device, data.size, runner.own_collective, data.group)
        runner.at_boundary.append(loss.at_boundary)
    recorder = _audit(config)
    if recorder is not None:
        runner.observers.append(
            AuditObserver(
                recorder,
                window,
                main_process=rank == 0,
                describe=lambda n: f"rank {rank} step {n} ({backend.name}, {backend.policy})",
            )
        )
    count = None
    if config.count_items is not None:
        count = ItemCount(
            config.count_items,
            window,
            backend,
            prepared,
            plan.data_parallel_size,
            runner.own_collective,
            data.group,
        )
        runner.observers.append(count)
    gradients = Gradients(
        window=window,
        backend=backend,
        runner=runner,
        prepared=prepared,
        rules=rules,
        data_parallel_size=plan.data_parallel_size,
        timeout=config.timeout,
        count=count,
        loss=loss,
        self_check=None,
    )
    check = selfcheck.start(
        enabled=config.self_check,
        audit=recorder,
        policy=lambda: backend.policy,
        rank=rank,
        world_size=plan.data_parallel_size,  # the ranks whose gradients are averaged
        backend=backend.name,
        paused=lambda: any(backend.user_paused_sync(m) for m in prepared.models),
    )
    if check is not None:
        gradients.self_check = SelfCheckObserver(check, gradients.self_check_over)
        runner.observers.append(gradients.self_check)
    planner = Planner(window, prepared, follow_data=config.sync_with_dataloader)
    preparer = Preparer(
        config,
        plan,
        backend,
        window.view,
        prepared,
        loaders,
        planner.check_length,
        gradients.before_step if loss is not None else None,
        rules=rules,
    )
    oom = _split_on_oom(config, backend, window, prepared, runner, preparer)
    ended = weakref.finalize(
        owner,
        warn_unfinished,
        prepared.schedulers,
        prepared.steps_applied,
        1 if rules.scheduler_per_process else world,
        rank == 0,
        log.warning,
    )
    if config.requeue and requeue_command() is None:
        log.warning(
            "gradsync: requeue=True outside a SLURM job (no SLURM_JOB_ID): the job "
            "will not be requeued"
        )
    state = CheckpointState(prepared, window, backend, loaders)
    if not rules.resume_mid_epoch:  # Accelerate's rules: the script skips what it consumed

        def rewind() -> None:
            for loader in prepared.loaders:
                loader.rewind_to_pass_start()

        state.after_load.append(rewind)
    if oom is not None:
        state.after_load.append(oom.after_load)
    parts = Parts(
        config=config,
        rules=rules,
        backend=backend,
        window=window,
        prepared=prepared,
        runner=runner,
        loaders=loaders,
        state=state,
        preparer=preparer,
        gradients=gradients,
        planner=planner,
        trackers=tracking.Trackers(
            config.log_with, config.project_dir, step=prepared.steps_applied
        ),
        signals=SignalWatch(config.signal_folder(), config.save_signals),
        audit=recorder,
        ended=ended,
    )
    return parts


def _split_on_oom(
    config: Config,
    backend: Backend,
    window: Window,
    prepared: Prepared,
    runner: Runner,
    preparer: Preparer,
) -> OomSplit | None:
    """``on_oom="split"``: the agreement points in every micro-step, checked and armed at
    each prepare (the training loader keeps its window's batches)."""
    if config.on_oom != "split":
        return None

    def set_plan(plan: Any) -> None:
        preparer.plan = plan

    oom = OomSplit(
        window=window,
        backend=backend,
        plan=lambda: preparer.plan,
        set_plan=set_plan,
        own=runner.own_collective,
    )
    steps = config.gradient_accumulation_steps
    schedule = str(steps) if is_schedule(steps) else None

    def after_prepare(models: list[torch.nn.Module]) -> None:
        if not prepared.models:
            return
        check_at_prepare(preparer.plan, backend, bool(prepared.loaders), schedule)
        oom.arm(prepared.loaders[0], models)  # the first loader prepared: the training loader

    preparer.after_prepare.append(after_prepare)
    runner.oom = oom
    return oom


def attach(owner: Any, parts: Parts) -> None:
    """Once ``owner`` (the Accelerator) holds its parts: the stop-on-signal check before each
    window, and the extensions ``GRADSYNC_EXTENSIONS`` names (``gradsync verify``)."""
    if parts.signals.enabled:
        parts.runner.before_window.append(lambda: stop_if_told(parts, owner.end))
    parts.attached = [a for e in extensions.named() if (a := e.attach(owner, parts)) is not None]


def free_memory(parts: Parts) -> None:
    """``accel.free_memory``: drop an open window, forget everything prepared, collect
    garbage and empty the CUDA cache."""
    if parts.window.is_open:
        parts.runner.drop()
    parts.prepared.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def end(parts: Parts) -> None:
    """``accel.end``: say a schedule sized for the other rule, wait for a background commit,
    finish the trackers, release the process group gradsync made."""
    parts.ended()
    failed = parts.state.finish()
    try:
        parts.trackers.finish()
    finally:
        if parts.backend.owns_group:
            parts.prepared.clear_models()
            _group.release_process_group()
    if failed is not None:
        raise failed
