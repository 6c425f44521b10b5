"""The registry of what an Accelerator prepared: the one owner of those objects.

Models (and whether they train), optimizers, schedulers, dataloaders and the objects
registered for checkpointing are kept here, in the order they were prepared. Which
optimizer holds which model's parameters is a many-to-many relation (one optimizer over
several models, several optimizers for one model), recorded from the parameters'
identity; the Accelerator, the micro-step runner and the checkpoint state read it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from gradsync.backends.base import Held
from gradsync.errors import ConfigError, UsageError

if TYPE_CHECKING:
    import torch

    from gradsync._core.wrappers import PreparedOptimizer, PreparedScheduler
    from gradsync.data import PreparedDataLoader


class Prepared:
    """Everything one Accelerator prepared or registered, and how the pieces relate."""

    def __init__(self) -> None:
        self.models: list[torch.nn.Module] = []  # as wrapped by the backend
        self.trained: list[torch.nn.Module] = []  # the models with trainable parameters
        self.optimizers: list[PreparedOptimizer] = []
        self.schedulers: list[PreparedScheduler] = []
        self.loaders: list[PreparedDataLoader] = []
        self.objects: list[Any] = []  # registered for checkpointing
        self._links: set[tuple[int, int]] = set()  # (id of a model, id of an optimizer)

    # -- adding ---------------------------------------------------------------------
    def add_model(self, model: torch.nn.Module) -> None:
        self.models.append(model)
        if any(p.requires_grad for p in model.parameters()):
            self.trained.append(model)

    def add_optimizer(
        self, optimizer: PreparedOptimizer, models: Iterable[torch.nn.Module] = ()
    ) -> None:
        """``optimizer``, linked to each of ``models`` (those whose parameters it holds)."""
        self.optimizers.append(optimizer)
        for model in models:
            self._links.add((id(model), id(optimizer)))

    def add_scheduler(self, scheduler: PreparedScheduler) -> None:
        self.schedulers.append(scheduler)

    def add_loader(self, loader: PreparedDataLoader) -> None:
        self.loaders.append(loader)

    def add_object(self, obj: Any) -> None:
        self.objects.append(obj)

    def register(self, objects: Sequence[Any]) -> None:
        """``register_for_checkpointing``: objects with ``state_dict`` / ``load_state_dict``."""
        for obj in objects:
            if not (
                callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))
            ):
                raise ConfigError(
                    f"register_for_checkpointing() got a {type(obj).__name__}, which has no "
                    "state_dict()/load_state_dict(); register objects that have both"
                )
            self.add_object(obj)

    def last_optimizer(self) -> PreparedOptimizer:
        """The last prepared optimizer (``accel.optimizer``)."""
        if not self.optimizers:
            raise UsageError(
                "accel.optimizer: no optimizer was prepared; pass one to accel.prepare(model, optimizer)"
            )
        return self.optimizers[-1]

    # -- relations ------------------------------------------------------------------
    def optimizers_of(self, model: torch.nn.Module) -> list[PreparedOptimizer]:
        """The prepared optimizers that hold ``model``'s parameters, in prepare order."""
        return [o for o in self.optimizers if (id(model), id(o)) in self._links]

    def model_indices(self, optimizer: PreparedOptimizer) -> tuple[int, ...]:
        """The positions of the models whose parameters ``optimizer`` holds."""
        return tuple(i for i, m in enumerate(self.models) if (id(m), id(optimizer)) in self._links)

    def held(self) -> list[Held]:
        """Every prepared optimizer as the checkpoint hooks see it (numbered in prepare order)."""
        return [Held(j, o.optimizer, self.model_indices(o)) for j, o in enumerate(self.optimizers)]

    def held_by_model(self) -> list[Held]:
        """The optimizers as gradsync 0.1 saved them: one per model, numbered by the model
        (an optimizer that holds several models, or a model with several optimizers, has
        no such layout: a ValueError)."""
        out = []
        for j, o in enumerate(self.optimizers):
            mine = self.model_indices(o)
            if len(mine) != 1 or len(self.optimizers_of(self.models[mine[0]])) != 1:
                raise ValueError(f"optimizer {j} holds models {list(mine)}")
            out.append(Held(mine[0], o.optimizer, mine, legacy=True))
        return out

    def holding(self, parameters: Iterable[torch.Tensor]) -> list[PreparedOptimizer]:
        """The prepared optimizers that hold any of ``parameters``."""
        wanted = {id(p) for p in parameters}
        return [
            o
            for o in self.optimizers
            if any(id(p) in wanted for group in o.param_groups for p in group["params"])
        ]

    def step_counter(self, optimizer: Any) -> Callable[[], int]:
        """The applied-step count of the prepared optimizer wrapping ``optimizer`` (the
        training's, ``steps_applied``, when it is none of them)."""
        for prepared in self.optimizers:
            if prepared.optimizer is optimizer or prepared is optimizer:
                return lambda: prepared.steps_applied
        return self.steps_applied

    # -- reading ------------------------------------------------------------------
    @property
    def clipping_model(self) -> torch.nn.Module | None:
        """The most recently prepared model with trainable parameters (the one whose
        backend wrapper computes the global gradient norm)."""
        return self.trained[-1] if self.trained else None

    def steps_applied(self) -> int:
        """Optimizer steps really applied: the most any prepared optimizer applied (with an
        optimizer per model, each steps once per window: the training's step count)."""
        return max((o.steps_applied for o in self.optimizers), default=0)

    def counts(self) -> dict[str, int]:
        """How many of each kind were prepared (a checkpoint must match them)."""
        return {
            "models": len(self.models),
            "schedulers": len(self.schedulers),
            "objects": len(self.objects),
            "loaders": len(self.loaders),
            "optimizers": len(self.optimizers),
        }

    def clear(self) -> None:
        """Forget everything (``accel.free_memory``)."""
        self.clear_models()
        for kind in (self.optimizers, self.schedulers, self.loaders, self.objects):
            kind.clear()
        self._links.clear()

    def clear_models(self) -> None:
        """Forget the models (at the end of training: they may hold the process group)."""
        self.models.clear()
        self.trained.clear()
