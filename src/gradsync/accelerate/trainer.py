"""Transformers' ``Trainer`` on gradsync: ``from gradsync.accelerate.trainer import Trainer,
TrainingArguments`` in place of ``from transformers import Trainer, TrainingArguments``, and
nothing else changes.

The Trainer builds ``gradsync.accelerate.Accelerator`` where it would build Accelerate's, and
resumes mid-epoch through gradsync's ``skip_first_batches``; everything else is the Trainer's
own code. The Trainer accumulates by itself: it declares each micro-batch's place in the
window (``gradient_state._set_sync_gradients``), runs all but the last inside
``accelerator.no_sync(model)`` and the last one outside it, scales the loss itself and calls
``optimizer.step()`` at the boundary. gradsync takes that declaration as its window: every
micro-batch is a micro-step of it (off the boundary inside ``no_sync``, the boundary at the
last backward), so the sync policy (FSDP2's ``auto``, HSDP's ``defer_replicate``), the audit
(one gradient sync per window) and the self-check apply to the Trainer's windows.

A trainer built on Transformers' (TRL's ``SFTTrainer``, ...) runs on gradsync as
``on_gradsync(SFTTrainer)``, its arguments class as ``on_gradsync(SFTConfig)``. In
``gradsync verify``'s one-process reference the Trainer's window holds the N launched ranks'
micro-batches. Where the model is sharded (FSDP2), the Trainer's checkpoint holds the whole
weights and optimizer state, gathered on every rank.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from gradsync.accelerate.accelerator import Accelerator
from gradsync.accelerate.data_loader import skip_first_batches

T = TypeVar("T", bound=type)

__all__ = ["Trainer", "TrainingArguments", "on_gradsync"]

if TYPE_CHECKING:  # made when first imported (``__getattr__``): importing gradsync needs no
    Trainer: Any  # Transformers
    TrainingArguments: Any


@contextlib.contextmanager
def _names_in(module: Any, **names: Any) -> Iterator[None]:
    """``module``'s global ``names`` replaced while the block runs, then put back."""
    before = {name: getattr(module, name) for name in names}
    for name, value in names.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(module, name, value)


def _trainer_module() -> Any:
    """The module Transformers' ``Trainer`` is defined in (its global names are what it calls)."""
    import transformers

    return sys.modules[transformers.Trainer.__module__]


def _form_group() -> None:
    """Form the process group the way a gradsync Accelerator does, before Transformers'
    argument setup forms one through Accelerate (which the audit could not count)."""
    from gradsync._support import dist
    from gradsync.backends._group import ensure_process_group
    from gradsync.config import from_env

    if dist.rank_info()[1] > 1 and not dist.is_distributed():
        settings = from_env()
        ensure_process_group(
            str(settings.get("backend") or "ddp"),
            want_audit=bool(settings.get("audit")),
            self_check=bool(settings.get("self_check", True)),
            timeout=settings.get("timeout"),
        )


def _launched_world() -> int | None:
    """In ``gradsync verify``'s one-process reference, the launched run's data-parallel size
    (its Trainer's windows held that many times the micro-batches); None otherwise."""
    from gradsync.verify.records import ENV_REPLAY, read_meta

    folder = os.environ.get(ENV_REPLAY)
    return None if folder is None else int(read_meta(folder).get("world", 1))


class _OnGradsync:
    """What ``on_gradsync`` adds to a Trainer class: gradsync's Accelerator and loader; a
    sharded model's weights and optimizer state gathered on every rank when the Trainer
    saves them, and its optimizer state sharded again when it resumes."""

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        with _whole_optimizer(self, gather=True):
            super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        with _whole_optimizer(self, gather=False):
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]

    def create_accelerator_and_postprocess(self) -> None:
        with _names_in(_trainer_module(), Accelerator=Accelerator):
            super().create_accelerator_and_postprocess()  # type: ignore[misc]
        accelerator: Accelerator = self.accelerator  # type: ignore[attr-defined]
        accelerator.declared_steps = int(self.args.gradient_accumulation_steps)  # type: ignore[attr-defined]
        if _launched_world() is not None:
            # gradsync verify's reference: the Trainer's window holds the N ranks' micro-batches
            # (see _ArgumentsOnGradsync) and the Trainer scales the loss itself, as launched
            accelerator.gradient_accumulation_steps = 1

    def train(self, *args: Any, **kwargs: Any) -> Any:
        with _names_in(_trainer_module(), skip_first_batches=skip_first_batches):
            return super().train(*args, **kwargs)  # type: ignore[misc]

    def _save(
        self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None
    ) -> None:
        accelerator: Accelerator = self.accelerator  # type: ignore[attr-defined]
        if state_dict is None and accelerator._models:  # every rank takes part in the gather
            state_dict = accelerator.get_state_dict(self.model)  # type: ignore[attr-defined]
        super()._save(output_dir, state_dict=state_dict)  # type: ignore[misc]


class _WholeOptimizer:
    """The prepared optimizer as the Trainer's checkpoint sees it where the model is sharded:
    ``state_dict`` gives the whole state (gathered on every rank when built, so the writer
    alone may ask), ``load_state_dict`` takes a whole state and keeps this rank's shards.
    The state is keyed by parameter name (``torch.distributed.checkpoint``'s full state)."""

    def __init__(self, model: Any, optimizer: Any, gather: bool) -> None:
        self._model, self._optimizer = model, optimizer
        self._whole = self._read() if gather else None

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True)

    def _read(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self._model, self._optimizer, options=self._options())

    def state_dict(self) -> dict[str, Any]:
        assert self._whole is not None
        return self._whole

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        set_optimizer_state_dict(
            self._model, self._optimizer, state, options=StateDictOptions(full_state_dict=True)
        )


@contextlib.contextmanager
def _whole_optimizer(trainer: Any, gather: bool) -> Iterator[None]:
    """``trainer.optimizer`` seen whole while the block runs, where the model is sharded."""
    from torch.distributed.tensor import DTensor

    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    prepared = trainer.optimizer
    if prepared is None or not any(isinstance(p, DTensor) for p in model.parameters()):
        yield
        return
    trainer.optimizer = _WholeOptimizer(model, getattr(prepared, "optimizer", prepared), gather)
    try:
        yield
    finally:
        trainer.optimizer = prepared


class _ArgumentsOnGradsync:
    """What ``on_gradsync`` adds to a TrainingArguments class: gradsync forms the process
    group (so ``--audit`` and the self-check can count its collectives)."""

    def __post_init__(self) -> None:
        _form_group()
        super().__post_init__()  # type: ignore[misc]
        world = _launched_world()
        if world is not None:  # gradsync verify's reference: one window of the N ranks' batches
            self.gradient_accumulation_steps: int = self.gradient_accumulation_steps * world


def on_gradsync(trainer_class: T) -> T:
    """A subclass of ``trainer_class`` that trains on gradsync.

    For Transformers' ``Trainer`` or a trainer built on it, the subclass builds
    ``gradsync.accelerate.Accelerator``, whose settings come from ``gradsync launch``
    (``--backend``, ``--sync-policy``, ``--audit``, ...) as for any script. For
    ``TrainingArguments`` (or a subclass, such as TRL's ``SFTConfig``), gradsync forms the
    process group when the arguments are built.

    Args:
        trainer_class: ``transformers.Trainer``, ``transformers.TrainingArguments``, or a
            subclass of either.

    Returns:
        The subclass, of the same name.

    Raises:
        TypeError: ``trainer_class`` is neither.
    """
    import transformers

    if issubclass(trainer_class, transformers.Trainer):
        extra: type = _OnGradsync
    elif issubclass(trainer_class, transformers.TrainingArguments):
        extra = _ArgumentsOnGradsync
    else:
        raise TypeError(
            f"on_gradsync() takes transformers.Trainer or TrainingArguments (or a subclass), "
            f"not {trainer_class.__name__}"
        )
    made = type(trainer_class.__name__, (extra, trainer_class), {})
    made.__module__ = __name__
    made.__qualname__ = trainer_class.__qualname__
    return made  # type: ignore[return-value]


def __getattr__(name: str) -> Any:
    if name in ("Trainer", "TrainingArguments"):
        import transformers

        made = on_gradsync(getattr(transformers, name))
        globals()[name] = made
        return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
