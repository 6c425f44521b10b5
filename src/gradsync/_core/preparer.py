"""``accel.prepare``: what each object becomes, and the checks before anything is wrapped.

Models go through the backend's ``prepare`` (DDP / FSDP2 / an engine); optimizers become
gates on the window (``PreparedOptimizer``), schedulers step once per applied optimizer step
(``PreparedScheduler``), dataloaders are sharded and prepared (``PreparedDataLoader``).
Everything prepared is recorded in the registry (``gradsync._core.registry``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from gradsync._core.wrappers import PreparedOptimizer, PreparedScheduler
from gradsync._plan.batch_plan import BatchPlan
from gradsync._support import dist
from gradsync._support import torch_range as _torch_range
from gradsync.backends.base import is_frozen
from gradsync.data import LoaderContext, PreparedDataLoader, shard_dataloader
from gradsync.data.dealing import deal_batches, split_size
from gradsync.errors import ConfigError
from gradsync.rules import GRADSYNC, Rules

if TYPE_CHECKING:
    from gradsync._core.registry import Prepared
    from gradsync._plan.window import WindowView
    from gradsync.backends.base import Backend
    from gradsync.config import Config


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

    def __init__(
        self,
        config: Config,
        plan: BatchPlan,
        backend: Backend,
        view: WindowView,
        registry: Prepared,
        loaders: LoaderContext,
        on_scheduler: Callable[[PreparedScheduler], None],
        before_step: Callable[[], None] | None = None,
        rules: Rules = GRADSYNC,
    ) -> None:
        self._config = config
        self._rules = rules
        self.plan = plan
        self._backend = backend
        self._view = view
        self._registry = registry
        self._loaders = loaders
        self._on_scheduler = on_scheduler
        self._sized_by_settings = (
            plan.micro_batch_size is not None
        )  # else the first loader sizes it
        self._before_step = before_step
        #: ``gradsync verify``: replaces each loader's sharded source (records or replays it).
        self.loader_hook: Callable[[Any], Any] | None = None
        #: The processes a per-process scheduler rule counts (None: this run's data-parallel
        #: size); ``gradsync verify``'s one-process reference sets the launched run's.
        self.scheduler_processes: int | None = None
        #: Called at the end of each prepare call with the models it prepared (wrapped).
        self.after_prepare: list[Callable[[list[torch.nn.Module]], None]] = []
        self._untested_torch = _torch_range.above(torch.__version__)  # warned at the first model

    def prepare(self, objects: Sequence[Any]) -> Any:
        """The prepared ``objects``, in order (one object when one was given)."""
        self._refuse(objects)
        models = [o for o in objects if isinstance(o, torch.nn.Module)]
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        self._size_from_loaders(objects)
        if models and self._untested_torch:
            self._untested_torch = False
            if dist.rank() == 0:
                warnings.warn(_torch_range.warning(torch.__version__), stacklevel=3)
        out, now = self._prepare_models(models, optimizers)
        for obj in objects:
            if id(obj) not in out:
                out[id(obj)] = self._prepare_other(obj, now)
        for hook in self.after_prepare:
            hook([out[id(m)] for m in models])
        result = tuple(out[id(o)] for o in objects)
        return result[0] if len(result) == 1 else result

    def _size_from_loaders(self, objects: Sequence[Any]) -> None:
        """The first prepared dataloader fixes the micro batch size (DeepSpeed needs it)."""
        for obj in objects:
            batch = getattr(obj, "batch_size", None) if is_dataloader(obj) else None
            if batch is not None and self._rules.split_batches:
                batch = split_size(batch, self.plan.data_parallel_size)  # each rank's slice
            if batch is not None and self.plan.micro_batch_size is None:
                self.plan = BatchPlan.solve(
                    data_parallel_size=self.plan.data_parallel_size,
                    micro_batch_size=batch,
                    gradient_accumulation_steps=self.plan.gradient_accumulation_steps,
                )

    def _prepare_models(
        self, models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]
    ) -> tuple[dict[int, Any], dict[int, torch.optim.Optimizer]]:
        """Each model wrapped by the backend and each optimizer prepared (by ``id`` of the
        given object), and the optimizers the backend made of the given ones."""
        owners = {id(opt): self._owners(opt, models) for opt in optimizers}
        out: dict[int, Any] = {}
        now: dict[int, torch.optim.Optimizer] = {id(o): o for o in optimizers}  # after the backend
        built: list[tuple[torch.nn.Module, torch.optim.Optimizer]] = []
        for model in models:
            mine = [o for o in optimizers if any(m is model for m in owners[id(o)])]
            wrapped, given = self._backend.prepare(model, [now[id(o)] for o in mine], self.plan)
            if mine:
                now.update((id(o), new) for o, new in zip(mine, given))
            else:
                built.extend((wrapped, new) for new in given)  # e.g. DeepSpeed's config optimizer
            self._registry.add_model(wrapped)
            out[id(model)] = wrapped
        for opt in optimizers:
            for earlier in (m for m in owners[id(opt)] if id(m) not in out):  # prepared before
                now[id(opt)] = self._backend.attach(earlier, now[id(opt)])
            out[id(opt)] = self._add_optimizer(
                now[id(opt)], [out.get(id(m), m) for m in owners[id(opt)]]
            )
        for wrapped, new in built:
            self._add_optimizer(new, [wrapped])
        return out, now

    def _prepare_other(self, obj: Any, now: dict[int, torch.optim.Optimizer]) -> Any:
        """A scheduler (of an optimizer the backend may have replaced, in ``now``) or a
        dataloader, prepared; a ConfigError for anything else."""
        if is_scheduler(obj):
            replaced = now.get(id(obj.optimizer))
            if replaced is not None and replaced is not obj.optimizer:
                obj.optimizer = replaced
            scheduler = PreparedScheduler(
                obj,
                self._registry.step_counter(obj.optimizer),
                self._rules.scheduler_steps(
                    self.scheduler_processes or self.plan.data_parallel_size
                ),
            )
            self._registry.add_scheduler(scheduler)
            self._on_scheduler(scheduler)
            return scheduler
        if is_dataloader(obj):
            return self._prepare_dataloader(obj)
        raise ConfigError(
            f"prepare() does not know what to do with a {type(obj).__name__}; pass "
            "torch.nn.Modules, torch.optim.Optimizers, DataLoaders or LR schedulers"
        )

    def _add_optimizer(
        self, optimizer: torch.optim.Optimizer, models: Sequence[torch.nn.Module]
    ) -> PreparedOptimizer:
        prepared = PreparedOptimizer(optimizer, self._backend, self._view, self._config.timeout)
        prepared.before_step = self._before_step
        prepared.names = dist.is_multiprocess()
        self._registry.add_optimizer(prepared, models)
        return prepared

    def _owners(
        self, optimizer: torch.optim.Optimizer, models: Sequence[torch.nn.Module]
    ) -> list[torch.nn.Module]:
        """The models (of this call, or prepared before) whose parameters ``optimizer``
        holds, matched by identity; a ConfigError for a parameter of no model, or of a frozen one."""
        candidates = [*models, *self._registry.models]
        owner: dict[int, int] = {}
        for n, model in enumerate(candidates):
            for p in model.parameters():
                owner.setdefault(id(p), n)
        held = [p for group in optimizer.param_groups for p in group["params"]]
        found = sorted({owner[id(p)] for p in held if id(p) in owner})
        orphans = sum(1 for p in held if id(p) not in owner)
        name = type(optimizer).__name__
        if orphans:
            raise ConfigError(
                f"the {name} holds {orphans} of its {len(held)} parameters that belong to no model "
                "prepared in this call or before; prepare the models it trains together with it: "
                "`model, optimizer = accel.prepare(model, optimizer)` (on FSDP, an optimizer built "
                "over a model's parameters before prepare(model) must be prepared with it)"
            )
        frozen = [candidates[n] for n in found if is_frozen(candidates[n])]
        if frozen:
            raise ConfigError(
                f"the {name} holds parameters of a frozen {type(frozen[0]).__name__} (no parameter "
                "requires grad): it would never train them; build the optimizer over the trained "
                "models' parameters, or unfreeze that model before prepare()"
            )
        return [candidates[n] for n in found]

    def _refuse(self, objects: Sequence[Any]) -> None:
        scalers = [o for o in objects if hasattr(o, "scale") and hasattr(o, "unscale_")]
        if scalers:
            raise ConfigError(
                f"prepare() got a {type(scalers[0]).__name__}: gradsync runs one loss scaler per "
                f"run (mixed_precision={self._config.mixed_precision!r}); drop yours, set "
                "mixed_precision='fp16' and use accel.backward(loss) (accel.scaler holds its state)"
            )
        if any(isinstance(o, PreparedOptimizer) for o in objects):
            raise ConfigError(
                "prepare() got an optimizer that is already prepared; pass the original"
            )
        seen: set[int] = set()
        for obj in objects:
            if id(obj) in seen:
                raise ConfigError(
                    f"prepare() got the same {type(obj).__name__} twice; pass it once"
                )
            seen.add(id(obj))

    def _prepare_dataloader(self, loader: Any) -> PreparedDataLoader:
        batch = getattr(loader, "batch_size", None)
        if batch is not None and self._rules.split_batches:
            batch = split_size(batch, self.plan.data_parallel_size)
        # The first loader must fit batch sizes the settings fixed; a later one (an
        # evaluation loader, say) may batch as it likes: it does not define the plan.
        first = not self._registry.loaders
        if (
            first
            and self._sized_by_settings
            and batch is not None
            and batch != self.plan.micro_batch_size
        ):
            raise ConfigError(
                f"the dataloader's batch_size={batch} contradicts micro_batch_size="
                f"{self.plan.micro_batch_size} ({self.plan.describe()}); build the DataLoader with "
                f"batch_size={self.plan.micro_batch_size} or change the batch plan"
            )
        seed = self._config.seed if self._config.seed is not None else 0
        data = self._backend.data_parallel  # the ranks of a tensor-parallel group read alike
        rank, world = data.rank, data.size
        rules = self._rules
        if rules.dealing == "batches" and not self._config.dataset_shards_itself:
            sharded = deal_batches(
                loader,
                rank=rank,
                world_size=world,
                split=rules.split_batches,
                even=rules.even_batches,
                seedable=rules.seedable_sampler,
                data_seed=rules.data_seed,
            )
        else:
            sharded = shard_dataloader(
                loader,
                rank=rank,
                world_size=world,
                seed=seed,
                dataset_shards_itself=self._config.dataset_shards_itself,
            )
        if self.loader_hook is not None:  # gradsync verify (gradsync.verify.recorder)
            sharded = self.loader_hook(sharded)
        prepared = PreparedDataLoader(sharded, self._loaders)
        self._registry.add_loader(prepared)
        return prepared
