"""What happens to gradients between the user's ``backward`` and the optimizer step:
backward's scaling (``loss / n`` for ``"mean"``, ``world / window_items`` for ``"sum"``),
the window's item count, and clipping with fp16 unscaling at the boundary.

The Accelerator forwards ``backward``, ``window_items``, ``clip_grad_norm_`` and
``clip_grad_value_`` here; this module owns their arithmetic and their errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from gradsync.errors import ConfigError, UsageError, naming_collective
from gradsync.rules import Rules

if TYPE_CHECKING:
    from gradsync._core.microstep import ItemCount, Runner, SelfCheckObserver
    from gradsync._core.registry import Prepared
    from gradsync._core.window_loss import WindowLoss
    from gradsync._plan.window import Window
    from gradsync.backends.base import Backend

REDUCTIONS = ("mean", "sum", "normalized")


class Gradients:
    """Backward's scaling, the window's items and clipping, for one Accelerator."""

    def __init__(
        self,
        *,
        window: Window,
        backend: Backend,
        runner: Runner,
        prepared: Prepared,
        rules: Rules,
        data_parallel_size: int,
        timeout: float | None,
        count: ItemCount | None,
        loss: WindowLoss | None,
        self_check: SelfCheckObserver | None,
    ) -> None:
        self._window = window
        self._backend = backend
        self._runner = runner
        self._prepared = prepared
        self._rules = rules
        self._world = data_parallel_size
        self._timeout = timeout
        self.count = count
        self.loss = loss
        #: the deferral self-check while it runs (None once it is over)
        self.self_check = self_check

    @property
    def window_items(self) -> int:
        """Items in the whole global window in progress (see ``Accelerator.window_items``)."""
        if self.count is None:
            raise ConfigError(
                "accel.window_items needs count_items; build the Accelerator with "
                "count_items=gradsync.count_label_tokens (or your own fn(batch) -> int)"
            )
        self.count.settle()
        items = self._window.items
        if items is None:
            raise UsageError(
                "accel.window_items is known once a window fed by a prepared dataloader has "
                "started; read it inside `with accel.accumulate(model):` and iterate a loader "
                "returned by accel.prepare(...)"
            )
        return items

    def backward(self, loss: torch.Tensor, reduction: str, kwargs: dict[str, Any]) -> None:
        """Backward of ``loss`` scaled so the update is the window's mean (see
        ``Accelerator.backward``)."""
        step = self._window.current
        if step is None and self._window.is_open and self._window.steps == 1:
            # After no_sync() micro-steps, a plain backward closes their window (Accelerate's
            # manual loop): it runs as the window's last micro-step, seen by every observer.
            with self._runner.run(tuple(self._prepared.trained), force=True):
                self.backward(loss, reduction, kwargs)
            return
        if step is not None and self._runner.oom is not None:
            self._runner.oom.before_backward(step)  # on_oom="split": agree before it syncs
        keeps_graph = bool(kwargs.get("retain_graph"))
        if reduction == "mean":
            if step is None and self._window.steps > 1:
                raise UsageError(
                    f"accel.backward() was called outside `with accel.accumulate(model):` while "
                    f"gradient_accumulation_steps={self._window.steps}; put the forward and the "
                    "backward inside the accumulate block, which decides when gradients sync"
                )
            scale = (
                1
                if step is None
                else (step.size if self._rules.loss_divisor == "window" else self._window.steps)
            )
            if self.loss is not None:
                self.loss.add(loss, 1.0 / (scale * self.loss.world), step, keeps_graph=keeps_graph)
            if not self._runner.names:  # no collective to name: the common one-process path
                if kwargs:
                    self._backend.backward(loss, 1.0 / scale, **kwargs)
                else:
                    self._backend.backward(loss, 1.0 / scale)
                if self.self_check is not None:
                    self.self_check.check.saw_backward()
                return
            with naming_collective(self._name, self._timeout):
                self._run(loss, 1.0 / scale, kwargs)
            return
        if reduction not in REDUCTIONS:
            raise ConfigError(
                f"backward(reduction={reduction!r}) is unknown; use one of {', '.join(REDUCTIONS)}"
            )
        if self.count is None:
            raise ConfigError(
                f"backward(reduction={reduction!r}) needs count_items to know the window's items; "
                "build the Accelerator with count_items=gradsync.count_label_tokens (or your own "
                "fn(batch) -> int), or use reduction='mean'"
            )
        if step is None:
            raise UsageError(
                f"accel.backward(reduction={reduction!r}) was called outside `with "
                "accel.accumulate(model):`; the window's item count is known only inside it"
            )
        items = self.window_items
        if items == 0:
            return  # nothing to learn from; the boundary skips the step
        factor = self._world / items if reduction == "sum" else float(self._world)
        if self.loss is not None:
            self.loss.add(
                loss, 1.0 / items if reduction == "sum" else 1.0, step, keeps_graph=keeps_graph
            )
        with naming_collective(self._name, self._timeout):
            self._run(loss, factor, kwargs)

    def pipeline_step(
        self,
        model: torch.nn.Module,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[..., torch.Tensor],
        reduction: str,
    ) -> torch.Tensor | None:
        """One schedule step of a pipelined model (see ``Accelerator.pipeline_step``); on a
        model without a pipeline, the forward and ``backward`` of the whole micro-batch."""
        from gradsync.backends import _pipeline, _pipeline_decoder

        if not _pipeline.is_stage(model):  # the same loop in one process, or without pp
            if isinstance(inputs, Mapping):  # a decoder's ids and padding mask
                _pipeline_decoder.check_mask(inputs)
                out = model(**inputs)
            else:
                out = model(inputs)
            if not isinstance(out, torch.Tensor) and hasattr(out, "logits"):
                out = out.logits  # a Transformers decoder's, as its last stage returns them
            whole = loss_fn(out, targets)
            self.backward(whole, reduction, {})
            return whole.detach()
        pipeline = _pipeline.of(model)
        step = self._window.current
        if step is None:
            raise UsageError(
                "accel.pipeline_step() runs one micro-step: call it inside `with "
                "accel.accumulate(model):`, which decides when gradients sync"
            )
        if reduction not in ("mean", "sum"):
            raise ConfigError(
                f"pipeline_step(reduction={reduction!r}) is unknown; use 'mean' or 'sum'"
            )
        if reduction == "sum":  # each part's summed loss, over the global window's items
            items = self.window_items
            factor, weight = (self._world / items, 1.0 / items) if items else (0.0, 0.0)
        else:  # each part's mean, a micro-batch the mean of its parts
            scale = step.size if self._rules.loss_divisor == "window" else self._window.steps
            factor, weight = 1.0 / (scale * pipeline.microbatches), 1.0 / (scale * self._world)
        with naming_collective(self._name, self._timeout):
            loss = pipeline.step(inputs, targets, loss_fn, factor, mean=reduction == "mean")
        if loss is not None and self.loss is not None:  # the last stage's ranks
            self.loss.add(loss, weight, step)
        if self.self_check is not None:
            self.self_check.check.saw_backward()
        return loss

    def _name(self) -> str:
        step = self._window.current
        if step is not None and step.boundary:
            return "backward() at the window boundary (the gradient reduction)"
        return "backward()"

    def _run(self, loss: torch.Tensor, factor: float, kwargs: dict[str, Any]) -> None:
        if kwargs:
            self._backend.backward(loss, factor, **kwargs)
        else:
            self._backend.backward(loss, factor)
        if self.self_check is not None:
            self.self_check.check.saw_backward()

    def self_check_over(self) -> None:
        self.self_check = None

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor | None:
        """The global norm, clipped at a boundary; None off it."""
        params = self._unscaled(parameters, "clip_grad_norm_")
        if params is None:
            return None
        model = self._prepared.clipping_model
        assert model is not None
        with naming_collective("clip_grad_norm_() (the global gradient norm)", self._timeout):
            return self._backend.clip_grad_norm_(model, params, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Each gradient element clamped at a boundary; nothing off it."""
        params = self._unscaled(parameters, "clip_grad_value_")
        if params is not None:
            model = self._prepared.clipping_model
            assert model is not None
            self._backend.clip_grad_value_(model, params, clip_value)

    def _unscaled(self, parameters: Iterable[torch.Tensor], what: str) -> list[torch.Tensor] | None:
        """At a boundary: the parameters, with the gradients of the optimizers holding them
        unscaled (fp16: once per window, the step then does not unscale again); else None."""
        if not self._window.boundary:
            return None
        if self._prepared.clipping_model is None:
            raise UsageError(f"{what}() before prepare(); prepare the model first")
        params = list(parameters)
        for prepared in self._prepared.holding(params):
            self._backend.unscale_(prepared.optimizer)
        return params

    @property
    def window_loss(self) -> float:
        """The last window's loss (see ``Accelerator.window_loss``)."""
        if self.loss is None:
            raise ConfigError(
                "accel.window_loss is off (track_window_loss=False); build the "
                "Accelerator without it to read the window's loss"
            )
        return self.loss.value

    def before_step(self) -> None:
        """The window loss is taken at the window's first optimizer step."""
        assert self.loss is not None
        self.loss.before_step(self._window.current)
