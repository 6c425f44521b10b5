"""Every gradsync setting, declared once.

Each setting is one dataclass field (name, type, default) whose metadata (``setting(...)``,
see gradsync._support.declaration) holds its one-line doc, its ``gradsync launch`` flag and the backend
it belongs to. The core settings are declared here (the compression ones, which every backend
maps onto its own mechanism, in ``gradsync/options/compression.py``); each backend's options
next to its adapter (``gradsync/options/<backend>.py``). ``Config`` joins them, and everything
else is derived from ``SETTINGS``: ``Config.validate``, the ``GRADSYNC_*`` variables and YAML
keys (gradsync.config), the launcher's flags (gradsync.launch) and the reference table
(``reference_markdown()``); ``scripts/gen_signatures.py --write`` writes from it the keywords
of both Accelerators, their docstring entries and ``LaunchConfig``'s fields. No torch here.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gradsync._plan import accumulation_schedule as schedule
from gradsync._support.declaration import (
    ENV_PREFIX,
    ModuleSelector,
    Setting,
    check_bytes,
    declared,
    setting,
    type_text,
)
from gradsync._support.util import check_positive_int
from gradsync.errors import ConfigError
from gradsync.options.compression import CommHook, CommWrapper, CompressionSettings
from gradsync.options.ddp import DDPOptions
from gradsync.options.deepspeed import DeepSpeedOptions
from gradsync.options.fairscale import FairscaleOptions
from gradsync.options.fsdp import FSDPOptions, MeshSpec, ParallelismSpec, check_replicate_policy
from gradsync.options.pipeline import PPSplit
from gradsync.tracking._names import check_log_with

__all__ = [
    "BY_NAME",
    "CORE_SETTINGS",
    "ENV_PREFIX",
    "GRAD_SCALER_KEYS",
    "LAUNCH_SETTINGS",
    "MIXED_PRECISION",
    "OTHER_VARIABLES",
    "SETTINGS",
    "SYNC_POLICIES",
    "AccumulationSteps",
    "CommHook",
    "CommWrapper",
    "CompileOption",
    "Config",
    "CoreSettings",
    "ItemCounter",
    "MeshSpec",
    "MixedPrecision",
    "ModuleSelector",
    "OnOom",
    "PPSplit",
    "ParallelismSpec",
    "RequestedPolicy",
    "Setting",
    "SyncPolicy",
    "reference_markdown",
    "type_text",
]

#: A resolved sync policy: "defer" (no gradient collective off the boundary), "every_step"
#: (reduce on every micro-step), "native" (whatever the backend does by itself) or
#: "defer_replicate" (FSDP2 on a 2-D mesh: reduce-scatter inside the shard group every
#: micro-step, all-reduce across the replicas only at the boundary).
SyncPolicy = Literal["defer", "every_step", "native", "defer_replicate"]
#: A requested policy: a resolved one, or "auto" (the backend decides).
RequestedPolicy = Literal["auto", "defer", "every_step", "native", "defer_replicate"]
SYNC_POLICIES: tuple[RequestedPolicy, ...] = (
    "auto",
    "defer",
    "every_step",
    "native",
    "defer_replicate",
)
#: What an out-of-memory error inside ``accumulate`` does (see gradsync._core.oom).
OnOom = Literal["raise", "split"]
MixedPrecision = Literal["no", "bf16", "fp16"]
MIXED_PRECISION: tuple[MixedPrecision, ...] = ("no", "bf16", "fp16")
GRAD_SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
#: Micro-batches per optimizer step: a number, or a schedule (see gradsync._plan.accumulation_schedule): text such
#: as "0:2 100:4", a mapping (step -> k, or a ramp-up {"start", "increment", "samples"}), or a
#: callable optimizer_step -> k.
AccumulationSteps = (
    int | str | Mapping[int, int] | Mapping[str, int] | Mapping[str, Any] | Callable[[int], int]
)
#: fn(batch) -> the items (e.g. tokens) it holds.
ItemCounter = Callable[[Any], int]
#: True, or a dict of torch.compile arguments.
CompileOption = bool | dict[str, Any]
#: GRADSYNC_* variables that are not settings (read by the launcher, the adapters, the tools).
OTHER_VARIABLES = frozenset(
    {"CONFIG", "DEVICE", "DEEPSPEED_BUILD_OPS", "BENCHMARK", "VENV", "EXTENSIONS", "ERRORS"}
)


# -- the checks of the core settings that the type alone does not give -----------------
def _check_backend(name: str, value: Any, config: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"backend={value!r} must be a backend name such as 'ddp'")
    return value.lower()


def _check_policy(name: str, value: Any, config: Any) -> Any:
    if value not in SYNC_POLICIES:
        raise ConfigError(f"{name}={value!r} is unknown; use one of {', '.join(SYNC_POLICIES)}")
    check_replicate_policy(name, value, config)  # the backends' own limits on a policy
    return value


def _check_steps(name: str, value: Any, config: Any) -> Any:
    if schedule.is_schedule(value):
        schedule.check(value)
        return value
    return check_positive_int(name, value)


def _steps_from_text(raw: str, source: str) -> int | str:
    text = raw.strip()
    if text.lstrip("+-").isdigit():
        return int(text)
    if schedule.is_schedule(text):
        return text
    raise ConfigError(
        f"{source}={raw!r} is not an integer; set it to a whole number >= 1, or a schedule "
        "such as '0:2 100:4'"
    )


def _check_count_items(name: str, value: Any, config: Any) -> ItemCounter:
    if not config.sync_with_dataloader:
        raise ConfigError(
            "count_items needs sync_with_dataloader=True: a window that runs on into the next "
            "pass cannot count its items ahead; drop one of the two"
        )
    if callable(value):
        counter: ItemCounter = value
        return counter
    if isinstance(value, str) and ":" in value:
        module_name, _, attr = value.partition(":")
        try:
            loaded: ItemCounter = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ConfigError(
                f"{name}={value!r} cannot be loaded ({err}); give 'module:function'"
            ) from None
        return loaded
    raise ConfigError(
        f"{name}={value!r} must be a callable fn(batch) -> int, or 'module:function' such as "
        "'gradsync:count_label_tokens'"
    )


def _check_grad_scaler(name: str, value: Any, config: Any) -> Any:
    if hasattr(value, "scale") and hasattr(value, "unscale_"):
        raise ConfigError(
            f"grad_scaler={type(value).__name__}(...): gradsync runs one scaler per run "
            "and builds it itself with mixed_precision='fp16'; pass its settings as a "
            "dict, e.g. grad_scaler={'init_scale': 1024}, and use accel.scaler"
        )
    if not isinstance(value, dict) or set(value) - set(GRAD_SCALER_KEYS):
        raise ConfigError(
            f"grad_scaler={value!r} must be a dict with keys from {', '.join(GRAD_SCALER_KEYS)}"
        )
    if config.mixed_precision != "fp16":
        raise ConfigError(
            f"grad_scaler={value!r} with mixed_precision={config.mixed_precision!r}: a "
            "loss scaler is used only with fp16; set mixed_precision='fp16' or drop grad_scaler"
        )
    return value


def _check_checkpointing(name: str, value: Any, config: Any) -> Any:
    if isinstance(value, list | tuple) and not value:
        return None
    if not (
        isinstance(value, str | type)
        or callable(value)
        or (isinstance(value, list | tuple) and all(isinstance(a, str | type) for a in value))
    ):
        raise ConfigError(
            f"activation_checkpointing={value!r} must be a module class name, a class, a list "
            "of those, or a callable module -> bool"
        )
    return value


def _check_compile(name: str, value: Any, config: Any) -> Any:
    if not isinstance(value, bool | dict):
        raise ConfigError(
            f"compile={value!r} must be True, False or a dict of torch.compile "
            "arguments, e.g. {'mode': 'max-autotune'}"
        )
    return value


def _check_timeout(name: str, value: Any, config: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(
            f"timeout={value!r} must be a number of seconds > 0 (how long a collective "
            "waits for the other ranks), or None for torch's default"
        )
    return value


def _check_folder(name: str, value: Any, config: Any) -> str:
    if not isinstance(value, str | os.PathLike):
        raise ConfigError(
            f"{name}={value!r} must be a folder path (where to save "
            "a checkpoint when the job is told to stop), or None"
        )
    return os.fspath(value)


def _check_signal_folder(name: str, value: Any, config: Any) -> str:
    folder = _check_folder(name, value, config)
    old = config.save_on_sigterm
    if old is not None and old != folder:
        raise ConfigError(
            f"save_on_signal={folder!r} contradicts save_on_sigterm={old!r}; save_on_sigterm is "
            "the old name of save_on_signal: set only save_on_signal"
        )
    return folder


#: The signals ``save_signals`` may name: a scheduler's notice that the job will be stopped.
SIGNAL_NAMES = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGCONT", "SIGXCPU")


def _check_signals(name: str, value: Any, config: Any) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else value
    if (
        not isinstance(names, list | tuple)
        or not names
        or not all(isinstance(n, str) for n in names)
    ):
        raise ConfigError(f"{name}={value!r} must be signal names, e.g. ('SIGTERM', 'SIGUSR1')")
    out = []
    for raw in names:
        signame = raw.strip().upper()
        signame = signame if signame.startswith("SIG") else "SIG" + signame
        if signame not in SIGNAL_NAMES:
            raise ConfigError(
                f"{name}: {raw!r} is not a signal gradsync saves on; use some of {', '.join(SIGNAL_NAMES)}"
            )
        out.append(signame)
    return tuple(dict.fromkeys(out))


def _check_project_dir(name: str, value: Any, config: Any) -> str:
    if not isinstance(value, str | os.PathLike) or not os.fspath(value):
        raise ConfigError(
            f"{name}={value!r} must be a folder path for the trackers' files, or None"
        )
    return os.fspath(value)


@dataclass
class CoreSettings:
    """The settings every backend reads. The order is the order of validation: a check may
    read the settings above it (already validated)."""

    backend: str = field(
        default="auto",
        metadata=setting(
            "auto (ddp when the world size is above 1, else single), single, ddp, fsdp, deepspeed "
            "or fairscale (legacy)",
            flag=True,
            check=_check_backend,
            metavar="B",
        ),
    )
    gradient_accumulation_steps: AccumulationSteps | None = field(
        default=None,
        metadata=setting(
            "micro-batches per optimizer step (None: 1, or derived from the batch sizes), or a "
            "schedule: '0:2 100:4', a ramp-up dict, a callable optimizer_step -> k",
            flag=True,
            check=_check_steps,
            parse=_steps_from_text,
            metavar="K",
            hint="a number of steps, or a schedule such as '0:2 100:4'",
        ),
    )
    micro_batch_size: int | None = field(
        default=None,
        metadata=setting(
            "samples per micro-batch and process (give two of the three sizes to derive the third)",
            flag=True,
            minimum=1,
            metavar="M",
        ),
    )
    global_batch_size: int | None = field(
        default=None,
        metadata=setting(
            "samples per optimizer step over all processes: micro x k x processes",
            flag=True,
            minimum=1,
            metavar="G",
        ),
    )
    sync_policy: RequestedPolicy = field(
        default="auto",
        metadata=setting(
            "when gradients are reduced: auto (the backend decides), defer (only at the window's "
            "boundary), every_step, native, defer_replicate (fsdp on a 2-D mesh: across replicas "
            "only at the boundary)",
            flag=True,
            check=_check_policy,
            metavar="P",
        ),
    )
    mixed_precision: MixedPrecision = field(
        default="no",
        metadata=setting(
            "no, bf16 or fp16 (autocast, and a window-aware loss scaler for fp16)",
            flag=True,
            metavar="MP",
        ),
    )
    seed: int | None = field(
        default=None,
        metadata=setting(
            "seeds torch on every rank and the sharded sampler", flag=True, metavar="N"
        ),
    )
    audit: bool = field(
        default=False,
        metadata=setting(
            "count collectives per micro-step and print a summary per optimizer step", flag=True
        ),
    )
    sync_with_dataloader: bool = field(
        default=True,
        metadata=setting(
            "a window ends with the dataloader's pass (False: windows run on across passes)"
        ),
    )
    count_items: ItemCounter | None = field(
        default=None,
        metadata=setting(
            "fn(batch) -> items (e.g. tokens) it holds, for backward(reduction='sum' or "
            "'normalized'); from text: 'module:function'",
            accepts=ItemCounter | str | None,
            check=_check_count_items,
        ),
    )
    grad_scaler: dict[str, Any] | None = field(
        default=None,
        metadata=setting(
            "fp16 loss-scaler settings: init_scale, growth_factor, backoff_factor, growth_interval",
            check=_check_grad_scaler,
        ),
    )
    activation_checkpointing: ModuleSelector | None = field(
        default=None,
        metadata=setting(
            "modules whose forward is recomputed in backward: class names, classes or a callable "
            "module -> bool",
            check=_check_checkpointing,
        ),
    )
    compile: CompileOption | None = field(
        default=None,
        metadata=setting(
            "torch.compile the model where the backend wants it: True, or a dict of its arguments",
            check=_check_compile,
        ),
    )
    self_check: bool = field(
        default=True,
        metadata=setting(
            "with a deferring policy, check the first optimizer steps' collectives and warn when "
            "a micro-step off the boundary reduced gradients"
        ),
    )
    dataset_shards_itself: bool = field(
        default=False,
        metadata=setting(
            "an IterableDataset yields each rank's own shard itself: gradsync leaves it alone"
        ),
    )
    sync_memory_budget: int | None = field(
        default=None,
        metadata=setting(
            "bytes per rank that deferring may hold on FSDP2 and ZeRO 2/3 under sync_policy=auto "
            "(None: a share of the free memory)",
            check=check_bytes,
            minimum=0,
        ),
    )
    timeout: float | None = field(
        default=None,
        metadata=setting(
            "seconds a collective waits for the other ranks before it fails, naming the operation "
            "(None: torch's default, 30 min)",
            check=_check_timeout,
            hint="the seconds to wait, e.g. 600",
        ),
    )
    save_on_sigterm: str | None = field(
        default=None,
        metadata=setting(
            "the old name of save_on_signal",
            accepts=str | os.PathLike[str] | None,
            check=_check_folder,
        ),
    )
    save_on_signal: str | None = field(
        default=None,
        metadata=setting(
            "a folder: on one of save_signals (a scheduler's notice of preemption), every rank "
            "saves a checkpoint there (step-N) when the next window starts, then exits 0",
            accepts=str | os.PathLike[str] | None,
            check=_check_signal_folder,
        ),
    )
    save_signals: Sequence[str] = field(
        default=("SIGTERM", "SIGUSR1"),
        metadata=setting(
            "the signals save_on_signal saves on (SLURM sends SIGUSR1 with --signal=USR1@90)",
            accepts=str | Sequence[str],
            check=_check_signals,
        ),
    )
    requeue: bool = field(
        default=False,
        metadata=setting(
            "on SLURM, requeue the job (scontrol requeue) after the save_on_signal checkpoint, "
            "so that it starts again and resumes from it"
        ),
    )
    log_with: Sequence[Any] | None = field(
        default=None,
        metadata=setting(
            "experiment trackers for accel.log: tensorboard, wandb, mlflow, csv, jsonl, all, or "
            "tracker objects (comma-separated from text)",
            accepts=str | Sequence[Any] | None,
            check=check_log_with,
            metavar="T",
        ),
    )
    project_dir: str | None = field(
        default=None,
        metadata=setting(
            "the folder trackers write into (their logging_dir), created by the main process",
            accepts=str | os.PathLike[str] | None,
            check=_check_project_dir,
        ),
    )
    track_window_loss: bool = field(
        default=True,
        metadata=setting(
            "keep accel.window_loss: the global mean of a window's losses, weighted as the update "
            "(one small all-reduce per optimizer step)"
        ),
    )
    on_oom: OnOom = field(
        default="raise",
        metadata=setting(
            "an out-of-memory error inside accumulate: raise it, or split (every rank drops the "
            "window, halves the micro-batch, doubles k and runs the window again from its first "
            "sample: the global batch is kept); split is refused with deepspeed",
            flag=True,
            metavar="MODE",
        ),
    )


# Core first: the backend options' checks may read the core settings.
@dataclass
class Config(
    FairscaleOptions, DeepSpeedOptions, FSDPOptions, DDPOptions, CompressionSettings, CoreSettings
):
    """Every gradsync setting (see ``SETTINGS``). Errors name the key, the value and the fix."""

    def validate(self) -> Config:
        """Check every setting in declaration order, normalizing values in place.

        Returns:
            self.

        Raises:
            ConfigError: naming the setting, its value and the fix.
        """
        for s in SETTINGS:
            setattr(self, s.name, s.validate(getattr(self, s.name), self))
        return self

    def signal_folder(self) -> str | None:
        """Where to save when told to stop: ``save_on_signal``, or its old name
        ``save_on_sigterm``; None when neither is set.

        Returns:
            The folder, or None.
        """
        return self.save_on_signal if self.save_on_signal is not None else self.save_on_sigterm

    def memory_budget(self) -> tuple[int | None, str]:
        """The deferral memory budget and the setting that gave it.

        Returns:
            budget: the bytes, from ``sync_memory_budget`` when set, else from
                ``fsdp_memory_budget``; None when neither is set.
            name: the setting that gave it (``"sync_memory_budget"`` when neither is set).
        """
        if self.sync_memory_budget is not None:
            return self.sync_memory_budget, "sync_memory_budget"
        if self.fsdp_memory_budget is not None:
            return self.fsdp_memory_budget, "fsdp_memory_budget"
        return None, "sync_memory_budget"


#: Every setting, core first, then each backend's options.
SETTINGS: tuple[Setting, ...] = declared(Config)
#: The core settings (no backend): the keywords of ``Accelerator.__init__``.
CORE_SETTINGS: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.backend is None)
#: The settings ``gradsync launch`` has a flag for.
LAUNCH_SETTINGS: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.flag)
BY_NAME: Mapping[str, Setting] = {s.name: s for s in SETTINGS}


def reference_markdown() -> str:
    """The settings reference: one Markdown table row per setting.

    Returns:
        A Markdown table (name, type, default, ``GRADSYNC_*`` variable, YAML key,
        ``gradsync launch`` flag, backend, meaning), in declaration order.
    """
    rows = [
        "| setting | type | default | variable | YAML key | `gradsync launch` flag | backend | meaning |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        flag = f"`{s.flag}`" if s.flag else "—"
        rows.append(
            f"| `{s.name}` | `{s.type_text}` | `{s.default!r}` | `{s.env}` | `{s.yaml_key}` "
            f"| {flag} | {s.backend or 'all'} | {_cell(s.doc)} |"
        )
    return "\n".join(rows) + "\n"


def _cell(text: str) -> str:
    """Text safe in a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")
