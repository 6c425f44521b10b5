"""Accelerate's configuration objects, as plain dataclasses gradsync reads.

``ProjectConfiguration``, ``DataLoaderConfiguration``, ``GradientAccumulationPlugin`` and the
kwargs handlers (``DistributedDataParallelKwargs``, ``InitProcessGroupKwargs``,
``GradScalerKwargs``, ``AutocastKwargs``): the same fields and defaults, turned into
gradsync settings by ``translate``. ``DDPCommunicationHookType`` names the hooks of
``DistributedDataParallelKwargs(comm_hook=...)``: gradsync's ``comm_hook`` setting.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from dataclasses import dataclass, field
from typing import Any

from gradsync.accelerate.rules import accelerate_rules
from gradsync.errors import ConfigError
from gradsync.rules import Rules


@dataclass
class ProjectConfiguration:
    """Where a run writes: ``project_dir`` (trackers and checkpoints), ``logging_dir``; with
    ``automatic_checkpoint_naming``, ``save_state()`` writes
    ``project_dir/checkpoints/checkpoint_{iteration}`` and keeps ``total_limit`` of them."""

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: str | None = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir


@dataclass
class DataLoaderConfiguration:
    """How prepared dataloaders deal batches (``gradsync.rules.Rules``)."""

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclass
class GradientAccumulationPlugin:
    """Accumulation: ``num_steps`` micro-batches per update; ``sync_each_batch`` reduces
    gradients on every micro-step (gradsync's ``sync_policy="every_step"``)."""

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


class KwargsHandler:
    """A kwargs handler: the fields that differ from their defaults (``to_kwargs``)."""

    def to_kwargs(self) -> dict[str, Any]:
        default = type(self)()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if getattr(self, f.name) != getattr(default, f.name)
        }


class DDPCommunicationHookType(str, enum.Enum):
    """The values of ``comm_hook`` and ``comm_wrapper`` (gradsync's settings of those names)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        """Every value, as text."""
        return [member.value for member in cls]


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """DDP's constructor arguments (gradsync's ``ddp_kwargs``), and its communication hook:
    ``comm_hook``, ``comm_wrapper`` and ``comm_state_option`` are gradsync's settings of those
    names (a hook of "no" registers nothing, as in Accelerate, whatever the other two say;
    the state options reach only a PowerSGD hook)."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_state_option: dict[str, Any] = field(default_factory=dict)

    def comm_settings(self) -> dict[str, Any]:
        """The communication hook as gradsync settings (none for a hook of "no")."""
        hook = str(getattr(self.comm_hook, "value", self.comm_hook))
        if hook == "no":
            return {}
        out: dict[str, Any] = {"comm_hook": hook}
        wrapper = str(getattr(self.comm_wrapper, "value", self.comm_wrapper))
        if wrapper != "no":
            out["comm_wrapper"] = wrapper
        if self.comm_state_option and hook in ("power_sgd", "batched_power_sgd"):
            out["comm_state_option"] = dict(self.comm_state_option)
        return out


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """The process group's ``timeout`` (gradsync's ``timeout``); its backend follows the device."""

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: datetime.timedelta | None = None


@dataclass
class GradScalerKwargs(KwargsHandler):
    """fp16 loss-scaler settings (gradsync's ``grad_scaler``)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class AutocastKwargs(KwargsHandler):
    """Autocast settings: gradsync's autocast follows ``mixed_precision``."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class Translated:
    """Accelerate's keywords as gradsync settings, the rule book and the project."""

    settings: dict[str, Any] = field(default_factory=dict)
    rules: Rules = field(default_factory=accelerate_rules)
    project: ProjectConfiguration = field(default_factory=ProjectConfiguration)


HANDLERS: tuple[type[KwargsHandler], ...] = (
    DistributedDataParallelKwargs,
    InitProcessGroupKwargs,
    GradScalerKwargs,
    AutocastKwargs,
)


def own_handler(handler: Any) -> Any:
    """``handler`` as gradsync's kwargs handler of its name: Accelerate's own
    (``accelerate.utils.DistributedDataParallelKwargs``, ...), which Transformers' Trainer
    passes, is read field by field; a field gradsync does not know, set to something other
    than its default, is refused in one line."""
    if isinstance(handler, HANDLERS) or not dataclasses.is_dataclass(handler):
        return handler
    ours = next((c for c in HANDLERS if c.__name__ == type(handler).__name__), None)
    if ours is None:
        return handler
    known = {f.name for f in dataclasses.fields(ours)}  # type: ignore[arg-type]
    theirs = {f.name: f for f in dataclasses.fields(handler)}
    for name, f in theirs.items():
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if name not in known and getattr(handler, name) != default:
            raise ConfigError(
                f"kwargs_handlers: {ours.__name__}({name}=...) is not taken by gradsync; "
                f"it reads {', '.join(sorted(known))}"
            )
    return ours(**{name: getattr(handler, name) for name in known if name in theirs})


def _handlers(handlers: list[Any], out: dict[str, Any]) -> None:
    for handler in map(own_handler, handlers):
        if isinstance(handler, DistributedDataParallelKwargs):
            kwargs = handler.to_kwargs()
            for name in ("comm_hook", "comm_wrapper", "comm_state_option"):
                kwargs.pop(name, None)
            out["ddp_kwargs"] = kwargs
            out.update(handler.comm_settings())
        elif isinstance(handler, InitProcessGroupKwargs):
            if handler.timeout is not None:
                out["timeout"] = handler.timeout.total_seconds()
        elif isinstance(handler, GradScalerKwargs):
            kwargs = handler.to_kwargs()
            if not kwargs.pop("enabled", True):
                raise ConfigError(
                    "GradScalerKwargs(enabled=False): use mixed_precision='bf16' or "
                    "'no' instead of fp16 without a scaler"
                )
            out["grad_scaler"] = kwargs
        elif isinstance(handler, AutocastKwargs):
            if not handler.enabled:
                raise ConfigError(
                    "AutocastKwargs(enabled=False): use mixed_precision='no' for a "
                    "run without autocast"
                )
        else:
            kind = type(handler)
            raise ConfigError(
                f"kwargs_handlers got a {kind.__module__}.{kind.__qualname__}, which gradsync "
                "does not take; it takes DistributedDataParallelKwargs, InitProcessGroupKwargs, "
                "GradScalerKwargs and AutocastKwargs (gradsync.accelerate.utils' or Accelerate's)"
            )


def _dynamo(dynamo_backend: Any, dynamo_plugin: Any) -> dict[str, Any] | None:
    """``dynamo_backend`` / ``dynamo_plugin`` (Accelerate's ``TorchDynamoPlugin``: backend,
    mode, fullgraph, dynamic, options) as the ``compile`` setting; None when the backend is
    ``NO`` (Transformers' Trainer passes such a plugin when nothing is compiled)."""

    def name(backend: Any) -> str:
        return str(getattr(backend, "value", backend) or "no").lower()

    if dynamo_plugin is None:
        return None if name(dynamo_backend) == "no" else {"backend": name(dynamo_backend)}
    if name(dynamo_backend) != "no":
        raise ConfigError("Accelerator got dynamo_backend and dynamo_plugin; give one of them")
    if name(getattr(dynamo_plugin, "backend", None)) == "no" or getattr(
        dynamo_plugin, "disable", False
    ):
        return None
    if getattr(dynamo_plugin, "use_regional_compilation", False):
        raise ConfigError(
            "TorchDynamoPlugin(use_regional_compilation=True) is not taken by gradsync; "
            "compile the whole model (leave it False)"
        )
    found = {"backend": name(dynamo_plugin.backend)}
    for key in ("mode", "fullgraph", "dynamic", "options"):
        value = getattr(dynamo_plugin, key, None)
        if value is not None:
            found[key] = value
    return found


def translate(
    *,
    split_batches: bool | None,
    cpu: bool,
    dataloader_config: DataLoaderConfiguration | None,
    project_dir: str | None,
    project_config: ProjectConfiguration | None,
    gradient_accumulation_steps: int,
    gradient_accumulation_plugin: GradientAccumulationPlugin | None,
    kwargs_handlers: list[Any] | None,
    dynamo_backend: Any,
    dynamo_plugin: Any = None,
) -> Translated:
    """Accelerate's ``Accelerator`` keywords as gradsync settings (one ConfigError line
    for a contradiction or for what gradsync does not take)."""
    out: dict[str, Any] = {}
    loaders = dataloader_config or DataLoaderConfiguration()
    if split_batches is not None:
        loaders = dataclasses.replace(loaders, split_batches=split_batches)
    if loaders.dispatch_batches:
        raise ConfigError(
            "DataLoaderConfiguration(dispatch_batches=True) is not supported: every "
            "rank reads its own batches; leave dispatch_batches unset"
        )
    if loaders.use_stateful_dataloader:
        raise ConfigError(
            "DataLoaderConfiguration(use_stateful_dataloader=True) is not needed: "
            "save_state/load_state resume a prepared loader mid-epoch by themselves"
        )
    project = project_config or ProjectConfiguration()
    if project_dir is not None:
        project.set_directories(str(project_dir))
    if project.project_dir is not None:
        out["project_dir"] = project.project_dir
    if gradient_accumulation_plugin is not None:
        if gradient_accumulation_steps != 1:
            raise ConfigError(
                "Accelerator got gradient_accumulation_steps and a "
                "gradient_accumulation_plugin; give the steps in the plugin only"
            )
        plugin = gradient_accumulation_plugin
        out["gradient_accumulation_steps"] = plugin.num_steps or 1
        out["sync_with_dataloader"] = plugin.sync_with_dataloader
        if plugin.sync_each_batch:
            out["sync_policy"] = "every_step"
    elif gradient_accumulation_steps != 1:
        out["gradient_accumulation_steps"] = gradient_accumulation_steps
    _handlers(list(kwargs_handlers or []), out)
    compiled = _dynamo(dynamo_backend, dynamo_plugin)
    if compiled is not None:
        out["compile"] = compiled
    if cpu:
        out["device"] = "cpu"
    rules = accelerate_rules(
        split_batches=loaders.split_batches,
        even_batches=loaders.even_batches,
        seedable_sampler=loaders.use_seedable_sampler,
        data_seed=loaders.data_seed,
    )
    return Translated(out, rules, project)


def accelerate_trackers(log_with: Any) -> Any:
    """Accelerate's ``"all"``: every installed tracker library (TensorBoard, W&B, MLflow),
    not gradsync's own CSV and JSON-lines files; other names are kept."""
    items = list(log_with) if isinstance(log_with, list | tuple) else [log_with]
    if not any(isinstance(i, str) and str(i).lower() == "all" for i in items):
        return log_with
    from gradsync.tracking import tracker_available

    chosen: list[Any] = [t for t in ("tensorboard", "wandb", "mlflow") if tracker_available(t)]
    chosen += [
        i for i in items if not (isinstance(i, str) and str(i).lower() == "all") and i not in chosen
    ]
    return chosen or None
