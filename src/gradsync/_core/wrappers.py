"""The prepared optimizer and scheduler: gates that read the accumulation window.

They read the window of the Accelerator that made them through its read-only view
(never a global) and change nothing in it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from gradsync.errors import ConfigError, naming_collective

if TYPE_CHECKING:
    from gradsync._plan.window import WindowView
    from gradsync.backends.base import Backend


class PreparedOptimizer(torch.optim.Optimizer):
    """Steps only at a boundary; ``zero_grad`` does nothing while a window is open (inside
    ``accumulate()`` or between its micro-steps), and each new window starts from cleared
    gradients. So both loop orders (``zero_grad`` at the top of the loop, or after
    ``step``), calls after the block, and a plain ``loss.backward()`` all accumulate
    correctly, and the gradients stay readable after ``step()`` until the next window.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        backend: Backend,
        window: WindowView,
        timeout: float | None = None,
    ) -> None:
        # Deliberately no super().__init__: the wrapped optimizer owns groups, state and hooks.
        self.optimizer = optimizer
        self._backend = backend
        self._window = window
        self._timeout = timeout
        self.steps_applied = 0
        self.step_was_skipped = False  # the last boundary's step was skipped (fp16 overflow)
        #: Called before a step at a boundary (the window loss is taken there), or None.
        self.before_step: Callable[[], None] | None = None
        #: Name a hung collective of the step in the error (where collectives run).
        self.names = True

    @property
    def param_groups(self) -> list[dict[str, Any]]:
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
            raise ConfigError(
                "step(closure) is not supported under gradient accumulation; "
                "call the closure yourself inside accel.accumulate()"
            )
        if not self._window.boundary:
            return
        if self.before_step is not None:
            self.before_step()
        if self._window.skips_step:
            return
        if self.names:
            with naming_collective("optimizer.step()", self._timeout):
                applied = self._backend.step(self.optimizer)
        else:
            applied = self._backend.step(self.optimizer)
        self.step_was_skipped = not applied
        if applied:
            self.steps_applied += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self._window.is_open:
            self._backend.zero_grad(self.optimizer, set_to_none)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


class PreparedScheduler:
    """Steps at most once per call, and only when its optimizer applied a step since the
    last call: once per optimizer step in a per-step loop, once per epoch in a per-epoch
    loop, never per micro-step or per skipped step. ``ReduceLROnPlateau`` (stepped with a
    metric, usually per epoch) passes straight through.

    ``repeat``: the scheduler's own steps per optimizer step (Accelerate's rule: one per
    process, for a schedule sized in one process's batches); a scheduler with
    ``total_steps`` (OneCycleLR) is never stepped past them.
    """

    def __init__(self, scheduler: Any, steps: Callable[[], int], repeat: int = 1) -> None:
        self.scheduler = scheduler
        self._steps = steps
        self._seen = steps()
        self.repeat = repeat

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
            if self.repeat == 1:
                self.scheduler.step(*args, **kwargs)
                return
            total = getattr(self.scheduler, "total_steps", None)
            for _ in range(self.repeat):
                if total is None or self.scheduler._step_count <= total:
                    self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)
        # The steps seen so far are those of the (restored) optimizer: step only after new ones.
        self._seen = self._steps()

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
