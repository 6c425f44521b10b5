"""``accel.prepare``: what each object becomes, and the checks before anything is wrapped.

Models go through the backend's ``prepare`` (DDP / FSDP2 / an engine); optimizers become
gates on the window (``PreparedOptimizer``), schedulers step once per applied optimizer step
(``PreparedScheduler``), dataloaders are sharded and prepared (``PreparedDataLoader``).
Everything prepared is recorded in the registry (``gradsync.prepared``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from gradsync import dist
from gradsync.batching import BatchPlan
from gradsync.data import LoaderContext, PreparedDataLoader, shard_dataloader
from gradsync.errors import ConfigError
from gradsync.wrappers import PreparedOptimizer, PreparedScheduler

if TYPE_CHECKING:
    from gradsync.accumulation import WindowView
    from gradsync.backends.base import Backend
    from gradsync.config import Config
    from gradsync.prepared import Prepared


def is_scheduler(obj: Any) -> bool:
    """An LR scheduler (anything with ``step``, ``optimizer`` and ``state_dict``)."""
    return hasattr(obj, "step") and hasattr(obj, "optimizer") and hasattr(obj, "state_dict")


def is_dataloader(obj: Any) -> bool:
    """A DataLoader, or anything iterable with a ``dataset``."""
    return isinstance(obj, torch.utils.data.DataLoader) or (
        hasattr(obj, "__iter__") and hasattr(obj, "dataset")
    )


class Preparer:
    """Prepares objects for one Accelerator; ``plan`` is its batch plan (the first prepared
    dataloader fixes the micro batch size when no setting did)."""

    def __init__(self, config: Config, plan: BatchPlan, backend: Backend, view: WindowView,
                 registry: Prepared, loaders: LoaderContext,
                 on_scheduler: Callable[[PreparedScheduler], None]) -> None:
        self._config = config
        self.plan = plan
        self._backend = backend
        self._view = view
        self._registry = registry
        self._loaders = loaders
        self._on_scheduler = on_scheduler

    def prepare(self, objects: Sequence[Any]) -> Any:
        """The prepared ``objects``, in order (one object when one was given)."""
        models = [o for o in objects if isinstance(o, torch.nn.Module)]
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        self._refuse(objects, models, optimizers)
        for obj in objects:
            batch = getattr(obj, "batch_size", None) if is_dataloader(obj) else None
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
                _check_optimizer_holds(model, old_optimizer)
            wrapped, new_optimizer = self._backend.prepare(model, old_optimizer, self.plan)
            self._registry.add_model(wrapped)
            out[id(model)] = wrapped
            if new_optimizer is not None:
                # The backend may build one itself (DeepSpeed's config optimizer): see .optimizer.
                prepared = PreparedOptimizer(new_optimizer, self._backend, self._view, self._config.timeout)
                self._registry.add_optimizer(prepared, [wrapped])
                if old_optimizer is not None:
                    out[id(old_optimizer)] = prepared
        for obj in objects:
            if id(obj) in out:
                continue
            if is_scheduler(obj):
                if old_optimizer is not None and new_optimizer is not None and obj.optimizer is old_optimizer:
                    obj.optimizer = new_optimizer
                scheduler = PreparedScheduler(obj, self._registry.step_counter(obj.optimizer))
                self._registry.add_scheduler(scheduler)
                self._on_scheduler(scheduler)
                out[id(obj)] = scheduler
            elif is_dataloader(obj):
                out[id(obj)] = self._prepare_dataloader(obj)
            else:
                raise ConfigError(
                    f"prepare() does not know what to do with a {type(obj).__name__}; pass a "
                    "torch.nn.Module, a torch.optim.Optimizer, a DataLoader or an LR scheduler"
                )
        result = tuple(out[id(o)] for o in objects)
        return result[0] if len(result) == 1 else result

    def _refuse(self, objects: Sequence[Any], models: list[Any], optimizers: list[Any]) -> None:
        if len(models) > 1 or len(optimizers) > 1:
            raise ConfigError(
                f"prepare() got {len(models)} models and {len(optimizers)} optimizers; "
                "prepare one model and its optimizer per call"
            )
        scalers = [o for o in objects if hasattr(o, "scale") and hasattr(o, "unscale_")]
        if scalers:
            raise ConfigError(
                f"prepare() got a {type(scalers[0]).__name__}: gradsync runs one loss scaler per "
                f"run (mixed_precision={self._config.mixed_precision!r}); drop yours, set "
                "mixed_precision='fp16' and use accel.backward(loss) (accel.scaler holds its state)"
            )
        if any(isinstance(o, PreparedOptimizer) for o in optimizers):
            raise ConfigError("prepare() got an optimizer that is already prepared; pass the original")
        if optimizers and not models:
            raise ConfigError(
                "prepare() got an optimizer without its model; pass both: "
                "`model, optimizer = accel.prepare(model, optimizer)`"
            )

    def _prepare_dataloader(self, loader: Any) -> PreparedDataLoader:
        batch = getattr(loader, "batch_size", None)
        if self.plan.micro_batch_size is not None and batch is not None and batch != self.plan.micro_batch_size:
            raise ConfigError(
                f"the dataloader's batch_size={batch} contradicts micro_batch_size="
                f"{self.plan.micro_batch_size} ({self.plan.describe()}); build the DataLoader with "
                f"batch_size={self.plan.micro_batch_size} or change the batch plan"
            )
        seed = self._config.seed if self._config.seed is not None else 0
        rank, world, _ = dist.rank_info()
        sharded = shard_dataloader(loader, rank=rank, world_size=world, seed=seed,
                                   dataset_shards_itself=self._config.dataset_shards_itself)
        prepared = PreparedDataLoader(sharded, self._loaders)
        self._registry.add_loader(prepared)
        return prepared


def _check_optimizer_holds(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    own = {id(p) for p in model.parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = sum(1 for p in held if id(p) not in own)
    if foreign:
        raise ConfigError(
            f"the optimizer holds {foreign} of {len(held)} parameters that are not the model's; "
            "build the optimizer over model.parameters() of the model you prepare with it"
        )
