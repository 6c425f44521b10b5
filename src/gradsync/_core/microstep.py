"""One ``accumulate`` block, end to end: the window, the adapter's hooks and the observers.

The order is written once, here:

1. the window begins the micro-step; at a window start the prepared optimizers' gradients
   are cleared and the backend's ``begin_window`` runs;
2. every observer's ``begin(step)``, in order (the audit opens its record, the self-check
   attaches, the item count starts its all-reduce);
3. the user's forward and backward, inside the backend's ``micro_step`` context;
4. at a boundary the backend's ``end_window``;
5. every observer's ``end(step)``, in reverse order (the item count settles and skips an
   empty window, the self-check judges, the audit closes and reports);
6. the window ends the micro-step.

If anything in 2-5 raises, every observer that began gets ``abort()`` (in reverse order), the open window is
dropped on every layer (``drop_window``) and the error propagates. A new observer is one
class with ``begin`` / ``end`` / ``abort`` (and ``done``, True once it has nothing left to do).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from gradsync._support import dist
from gradsync.errors import naming_collective

if TYPE_CHECKING:
    from gradsync._core import selfcheck
    from gradsync._core.oom import OomSplit
    from gradsync._core.registry import Prepared
    from gradsync._plan.window import MicroStep, Window
    from gradsync.audit import Recorder
    from gradsync.backends.base import Backend
    from gradsync.data import ItemCounter

log = logging.getLogger("gradsync")


class Observer(Protocol):
    """Something that watches every micro-step (the audit, the self-check, the item count)."""

    @property
    def done(self) -> bool:
        """True once the observer has nothing left to do: the runner then drops it."""

    def begin(self, step: MicroStep) -> None:
        """The micro-step began (after the window and, at its start, the backend)."""

    def end(self, step: MicroStep) -> None:
        """The block and, at a boundary, the backend's ``end_window`` finished without error."""

    def abort(self) -> None:
        """The micro-step raised: the window is dropped right after."""


def clear_optimizer_grads(backend: Backend, prepared: Prepared) -> None:
    """Clear the gradients every prepared optimizer holds."""
    for optimizer in prepared.optimizers:
        backend.zero_grad(optimizer.optimizer, True)


def drop_window(window: Window, backend: Backend, prepared: Prepared) -> None:
    """Abandon the open window on every layer: the window's counters, the backend's
    accumulated gradients (wherever it keeps them), the optimizers' gradients."""
    window.drop()
    backend.abort_window(prepared.models)
    clear_optimizer_grads(backend, prepared)


class Runner:
    """Runs the ``accumulate`` blocks of one Accelerator."""

    def __init__(
        self, window: Window, backend: Backend, prepared: Prepared, timeout: float | None
    ) -> None:
        self.window = window
        self.backend = backend
        self.prepared = prepared
        self.timeout = timeout
        self.observers: list[Observer] = []
        #: Run before a micro-step that would open a window (the stop-signal check, verify).
        self.before_window: list[Callable[[], None]] = []
        #: Run after a window's last micro-step ended without error (the window loss).
        self.at_boundary: list[Callable[[MicroStep], None]] = []
        #: Name a hung or broken collective in the error (only where collectives run).
        self.names = dist.is_multiprocess()
        #: ``on_oom="split"``: agreement points and the re-plan (None: an OOM propagates).
        self.oom: OomSplit | None = None

    def drop(self) -> None:
        drop_window(self.window, self.backend, self.prepared)

    def run(self, models: Sequence[torch.nn.Module], force: bool | None = None) -> MicroStepBlock:
        """One micro-step over ``models`` (see the module's docstring for the order);
        ``force``: the caller decides whether it closes the window (manual control)."""
        return MicroStepBlock(self, models, force)

    def own_collective(self) -> contextlib.AbstractContextManager[None]:
        """Around a collective of gradsync's own (a metric, a count): never counted as
        gradient traffic by the audit or the self-check."""
        for observer in self.observers:
            own = getattr(observer, "own", None)
            if own is not None:
                return own()  # type: ignore[no-any-return]
        return contextlib.nullcontext()


class MicroStepBlock:
    """One ``accumulate`` block: ``Runner.run``'s order as a plain context manager (it runs
    around every micro-step, where a generator-based one costs several microseconds)."""

    __slots__ = ("_began", "_force", "_inner", "_models", "_runner", "_step")

    def __init__(
        self, runner: Runner, models: Sequence[torch.nn.Module], force: bool | None
    ) -> None:
        self._runner = runner
        self._models = models
        self._force = force
        self._began = 0
        self._inner: contextlib.AbstractContextManager[Any] | None = None
        self._step: MicroStep | None = None

    def __enter__(self) -> None:
        runner, models, force = self._runner, self._models, self._force
        window, backend = runner.window, runner.backend
        if runner.before_window and not window.is_open:
            for before in runner.before_window:
                before()
        step = self._step = window.begin(force=force)
        if runner.oom is not None:
            runner.oom.begin()
        if step.index == 0:
            try:
                # Every window starts from cleared gradients: the prepared optimizers' here,
                # the models' (also where no optimizer was prepared) in begin_window.
                clear_optimizer_grads(backend, runner.prepared)
                backend.begin_window(models)
            except BaseException:
                window.drop()
                raise
        try:
            for observer in runner.observers:
                observer.begin(step)
                self._began += 1
            if len(models) == 1 and not force:
                inner = backend.micro_step(models[0], boundary=step.boundary)
                if type(inner) is not contextlib.nullcontext:  # nothing to enter: skip the calls
                    inner.__enter__()
                self._inner = inner
            else:
                stack = contextlib.ExitStack()
                try:
                    for model in models:
                        stack.enter_context(backend.micro_step(model, boundary=step.boundary))
                        if force:  # its forward may have run off the boundary (no_sync)
                            backend.sync_next_backward(model)
                except BaseException:
                    stack.close()
                    raise
                self._inner = stack
        except BaseException:
            self._fail()
            raise

    def _describe(self) -> str:
        step = self._step
        assert step is not None
        return (
            f"the forward/backward of micro-step {step.index + 1} of {step.size} "
            f"(window {self._runner.window.completed_windows + 1})"
        )

    def _fail(self) -> None:
        """The micro-step raised: every observer that began aborts (in reverse order) and the
        open window is dropped on every layer, so a stray step() after the error applies
        nothing."""
        observers = self._runner.observers
        for observer in reversed(observers[: self._began]):
            with contextlib.suppress(Exception):  # the block's own error is the one to raise
                observer.abort()
        self._runner.drop()

    def _oom_exit(self, oom: OomSplit, err: BaseException | None, boundary: bool) -> bool | None:
        """``on_oom="split"`` at the end of the micro-step: True when every rank dropped the
        window to run it again, smaller; False when this rank's failure waits for the next
        agreement point (``err`` is swallowed); None otherwise."""
        failed = oom.at_exit(err, boundary)
        if failed is not None:
            feed = self._runner.window.feed
            self._fail()
            oom.replan(failed, feed)
            return True
        return False if oom.swallows(err) else None

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: Any
    ) -> bool:
        runner, step, inner = self._runner, self._step, self._inner
        assert step is not None and inner is not None
        naming = naming_collective(self._describe, runner.timeout) if runner.names else None
        try:
            try:
                swallowed = type(inner) is not contextlib.nullcontext and inner.__exit__(
                    kind, err, tb
                )
            except BaseException as new:  # the backend's exit raised (e.g. DDP's unused parameters)
                if naming is not None:
                    naming.__exit__(type(new), new, new.__traceback__)
                raise
            if err is not None and not swallowed and naming is not None:
                naming.__exit__(kind, err, tb)  # a hung collective becomes a CollectiveError
        except BaseException:
            self._fail()
            raise
        if runner.oom is not None:
            outcome = self._oom_exit(runner.oom, None if swallowed else err, step.boundary)
            if outcome:
                return True
            swallowed = swallowed or outcome is False
        if err is not None and not swallowed:
            self._fail()
            return False
        window, observers = runner.window, runner.observers
        try:
            if step.boundary:
                if runner.names:
                    with naming_collective("the end of the accumulation window", runner.timeout):
                        runner.backend.end_window(self._models)
                else:
                    runner.backend.end_window(self._models)
            for observer in reversed(observers):
                observer.end(step)
            if step.boundary:
                for hook in runner.at_boundary:
                    hook(step)
        except BaseException:
            self._fail()
            raise
        window.end()
        if step.boundary and observers and any(o.done for o in observers):
            runner.observers = [o for o in observers if not o.done]
        return bool(swallowed)


# -- the observers -------------------------------------------------------------------
class AuditObserver:
    """Opens the audit's record of each micro-step and, at a boundary, prints the window's
    summary on the main process."""

    done = False

    def __init__(
        self, recorder: Recorder, window: Window, describe: Callable[[int], str], main_process: bool
    ) -> None:
        self.recorder = recorder
        self._window = window
        self._describe = describe  # window number -> "rank R step N (backend, policy)"
        self._main = main_process
        self._window_start = len(recorder.records)

    def own(self) -> contextlib.AbstractContextManager[None]:
        return self.recorder.own()

    def begin(self, step: MicroStep) -> None:
        self.recorder.open(step.boundary)

    def end(self, step: MicroStep) -> None:
        self.recorder.close()
        if step.boundary:
            self._report()

    def abort(self) -> None:
        self.recorder.close()

    def _report(self) -> None:
        window = self.recorder.records[self._window_start :]
        self._window_start = len(self.recorder.records)
        if self._main and window:
            number = self._window.completed_windows + 1  # the window closing now
            print(
                f"[gradsync audit] {self._describe(number)}: {self.recorder.summary(window)}",
                file=sys.stdout,
                flush=True,
            )


class SelfCheckObserver:
    """The deferral self-check of the first optimizer steps (see ``gradsync._core.selfcheck``)."""

    def __init__(self, check: selfcheck.SelfCheck, on_done: Callable[[], None]) -> None:
        self.check = check
        self._on_done = on_done  # told once the check is over

    @property
    def done(self) -> bool:
        return self.check.done

    def own(self) -> contextlib.AbstractContextManager[None]:
        return self.check.recorder.own()

    def begin(self, step: MicroStep) -> None:
        self.check.begin(step.boundary)

    def end(self, step: MicroStep) -> None:
        self.check.end(step.boundary)
        if self.check.done:
            self._on_done()

    def abort(self) -> None:
        self.check.abort()


class ItemCount:
    """Counts the items (tokens) of each global window when it starts: this rank's batches,
    read ahead by the prepared loader, summed over ranks with one small all-reduce that runs
    while the first forward does (waited for at the first backward, ``window_items`` or the
    end of the micro-step). A window with no item on any rank skips its step."""

    done = False

    def __init__(
        self,
        count: ItemCounter,
        window: Window,
        backend: Backend,
        prepared: Prepared,
        world_size: int,
        own: Callable[[], contextlib.AbstractContextManager[None]],
        group: Any = None,
    ) -> None:
        self.count = count
        self._window = window
        self._backend = backend
        self._prepared = prepared
        self._world = world_size  # the data-parallel ranks, whose items are summed
        self._group = group  # their process group (None: the world's)
        self._own = own
        self._pending: tuple[Any, torch.Tensor, BaseException | None] | None = None

    def begin(self, step: MicroStep) -> None:
        if step.index != 0:
            return
        feed = self._window.feed
        if feed is None:
            return  # no prepared loader feeds the window: window_items stays unknown
        local, error = 0, None
        try:
            local = feed.count_items(step.size, self.count)
        except Exception as err:  # the other ranks must not wait for this one's count forever
            error = err
        if self._world > 1:
            t = torch.tensor(
                [local, int(error is not None)], dtype=torch.int64, device=self._backend.device
            )
            with self._own():
                work = torch.distributed.all_reduce(t, group=self._group, async_op=True)
            self._pending = (work, t, error)
            return
        if error is not None:
            raise error
        self._window.set_items(local)

    def settle(self) -> None:
        """Wait for the window's count all-reduce, if one is in flight, and record the total."""
        pending, self._pending = self._pending, None
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

    def end(self, step: MicroStep) -> None:
        self.settle()
        if step.boundary and self._window.skips_step:
            log.warning(
                "gradsync: window %d holds no item (count_items gave 0 on every rank); its "
                "optimizer and scheduler steps are skipped",
                self._window.completed_windows + 1,
            )
            self._backend.abort_window(self._prepared.models)  # drop what its backward left

    def abort(self) -> None:
        self.settle()
