"""One Config dataclass, filled from defaults, a YAML file, GRADSYNC_* variables and keywords.

Later sources win: defaults < YAML (``config_file`` / ``GRADSYNC_CONFIG``) < environment < keywords.
"""

from __future__ import annotations

import difflib
import logging
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from gradsync import schedule
from gradsync._util import check_positive_int
from gradsync.errors import ConfigError

log = logging.getLogger("gradsync")

ENV_PREFIX = "GRADSYNC_"
#: A resolved sync policy: "defer" (no gradient collective off the boundary), "every_step"
#: (reduce on every micro-step) or "native" (whatever the backend does by itself).
SyncPolicy = Literal["defer", "every_step", "native"]
#: A requested policy: a resolved one, or "auto" (the backend decides).
RequestedPolicy = Literal["auto", "defer", "every_step", "native"]
SYNC_POLICIES: tuple[RequestedPolicy, ...] = ("auto", "defer", "every_step", "native")
MIXED_PRECISION = ("no", "bf16", "fp16")
GRAD_SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass
class Config:
    """Every gradsync setting. Errors name the key, the value and the fix."""

    backend: str = "auto"
    # An int, or a schedule: "0:2 100:4", {"start": 64, "increment": 64, "samples": N} (a
    # global-batch ramp-up), or a callable optimizer_step -> k (see gradsync.schedule).
    gradient_accumulation_steps: Any = None
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    sync_policy: RequestedPolicy = "auto"
    seed: int | None = None
    audit: bool = False
    mixed_precision: str = "no"
    # fn(batch) -> int: items (tokens) per batch, for reduction="sum"/"normalized" in backward;
    # a callable, or "module:function" (e.g. "gradsync:count_label_tokens") from YAML / env.
    count_items: Any = None
    # False: windows run on across the end of a pass (no end-of-data flush, no drop).
    sync_with_dataloader: bool = True
    # GradScaler settings for fp16 (init_scale, growth_factor, backoff_factor, growth_interval).
    grad_scaler: dict[str, Any] | None = None
    # Modules whose forward is recomputed in backward: class names, classes or a callable.
    activation_checkpointing: Any = None
    # torch.compile the model where the backend wants it: True, or a dict of its kwargs.
    compile: Any = None
    # Backend options (each adapter reads its own; unknown to the others).
    deepspeed_config: Any = None
    # Bytes per rank that deferring may hold on sharded backends (FSDP2, ZeRO 2/3) under
    # sync_policy="auto"; None: a share of the free memory. fsdp_memory_budget is its old name.
    sync_memory_budget: int | None = None
    fsdp_memory_budget: int | None = None
    # FSDP2: keep the parameters gathered for the rest of a deferred window (None: auto
    # decides by the budget). fsdp_reshard_after_backward is deprecated (its False keeps
    # them only after backward).
    fsdp_keep_params_in_window: bool | None = None
    fsdp_reshard_after_backward: bool | None = None
    fsdp_wrap: Any = None
    ddp_kwargs: dict[str, Any] | None = None  # extra DistributedDataParallel(...) arguments
    # DDP finds the parameters a backward did not reach (torch's find_unused_parameters).
    find_unused_parameters: bool = False
    # With a deferring policy, count the first optimizer steps' collectives and warn when a
    # micro-step off the boundary reduced gradients, or a boundary reduced nothing.
    self_check: bool = True
    # An IterableDataset yields each rank's own shard itself: gradsync leaves it alone.
    dataset_shards_itself: bool = False
    fairscale_kwargs: dict[str, Any] | None = None  # extra ShardedDataParallel(...) arguments
    # Seconds a collective may wait for the other ranks before it fails (torch's default: 30 min).
    timeout: float | None = None
    # On SIGTERM: save a checkpoint under this folder at the next boundary, then exit.
    save_on_sigterm: str | None = None

    def validate(self) -> Config:
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError(f"backend={self.backend!r} must be a backend name such as 'ddp'")
        self.backend = self.backend.lower()
        for name in ("gradient_accumulation_steps", "micro_batch_size", "global_batch_size"):
            value = getattr(self, name)
            if name == "gradient_accumulation_steps" and schedule.is_schedule(value):
                schedule.check(value)
            elif value is not None:
                setattr(self, name, check_positive_int(name, value))
        if not isinstance(self.sync_with_dataloader, bool):
            raise ConfigError(f"sync_with_dataloader={self.sync_with_dataloader!r} must be True or False")
        if not self.sync_with_dataloader and self.count_items is not None:
            raise ConfigError(
                "count_items needs sync_with_dataloader=True: a window that runs on into the next "
                "pass cannot count its items ahead; drop one of the two"
            )
        if self.sync_policy not in SYNC_POLICIES:
            raise ConfigError(
                f"sync_policy={self.sync_policy!r} is unknown; use one of {', '.join(SYNC_POLICIES)}"
            )
        if self.mixed_precision not in MIXED_PRECISION:
            raise ConfigError(
                f"mixed_precision={self.mixed_precision!r} is unknown; "
                f"use one of {', '.join(MIXED_PRECISION)}"
            )
        if self.ddp_kwargs is not None and not isinstance(self.ddp_kwargs, dict):
            raise ConfigError(
                f"ddp_kwargs={self.ddp_kwargs!r} must be a dict of DistributedDataParallel "
                "arguments, e.g. {'find_unused_parameters': True}"
            )
        self._validate_model_options()
        if self.count_items is not None:
            self.count_items = _resolve_callable("count_items", self.count_items)
        for name in _BOOLEANS:
            value = getattr(self, name)
            if name in _OPTIONAL:
                if value is not None and not isinstance(value, bool):
                    raise ConfigError(f"{name}={value!r} must be True, False or None")
            elif not isinstance(value, bool):
                raise ConfigError(f"{name}={value!r} must be True or False")
        if self.fairscale_kwargs is not None and not isinstance(self.fairscale_kwargs, dict):
            raise ConfigError(
                f"fairscale_kwargs={self.fairscale_kwargs!r} must be a dict of ShardedDataParallel "
                "arguments, e.g. {'reduce_buffer_size': 0}"
            )
        if self.timeout is not None and (
            isinstance(self.timeout, bool) or not isinstance(self.timeout, int | float) or not self.timeout > 0
        ):
            raise ConfigError(
                f"timeout={self.timeout!r} must be a number of seconds > 0 (how long a collective "
                "waits for the other ranks), or None for torch's default"
            )
        if self.save_on_sigterm is not None and not isinstance(self.save_on_sigterm, str | os.PathLike):
            raise ConfigError(
                f"save_on_sigterm={self.save_on_sigterm!r} must be a folder path (where to save "
                "a checkpoint when the job is told to stop), or None"
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed={self.seed!r} must be an integer or None")
        for name in ("fsdp_keep_params_in_window", "fsdp_reshard_after_backward"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"{name}={value!r} must be True, False or None")
        for name in ("sync_memory_budget", "fsdp_memory_budget"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(
                    f"{name}={value!r} must be a number of bytes >= 0 (or None for a share of "
                    "the free memory)"
                )
        if (self.sync_memory_budget is not None and self.fsdp_memory_budget is not None
                and self.sync_memory_budget != self.fsdp_memory_budget):
            raise ConfigError(
                f"fsdp_memory_budget={self.fsdp_memory_budget} contradicts sync_memory_budget="
                f"{self.sync_memory_budget}; fsdp_memory_budget is the old name of "
                "sync_memory_budget: set only sync_memory_budget"
            )
        if self.fsdp_reshard_after_backward is not None:
            if (self.fsdp_keep_params_in_window is not None
                    and self.fsdp_keep_params_in_window == self.fsdp_reshard_after_backward):
                raise ConfigError(
                    f"fsdp_reshard_after_backward={self.fsdp_reshard_after_backward} contradicts "
                    f"fsdp_keep_params_in_window={self.fsdp_keep_params_in_window}; "
                    "fsdp_reshard_after_backward is deprecated: set only fsdp_keep_params_in_window"
                )
            warnings.warn(
                "fsdp_reshard_after_backward is deprecated; use fsdp_keep_params_in_window=True "
                "(keeps the parameters gathered for the whole window: no all-gather after the "
                "window's first micro-step) or False",
                DeprecationWarning, stacklevel=4,
            )
        return self

    def memory_budget(self) -> tuple[int | None, str]:
        """The deferral memory budget in bytes (None: not set) and the name it was set by."""
        if self.sync_memory_budget is not None:
            return self.sync_memory_budget, "sync_memory_budget"
        if self.fsdp_memory_budget is not None:
            return self.fsdp_memory_budget, "fsdp_memory_budget"
        return None, "sync_memory_budget"

    @property
    def accumulation_steps(self) -> int:
        """The accumulation steps to use when none was derived from batch sizes (default 1)."""
        value = self.gradient_accumulation_steps
        if schedule.is_schedule(value):
            return schedule.parse(value, micro_batch_size=self.micro_batch_size,
                                  global_batch_size=self.global_batch_size).steps_at(0)
        return int(value or 1)

    def _validate_model_options(self) -> None:
        scaler = self.grad_scaler
        if scaler is not None:
            if hasattr(scaler, "scale") and hasattr(scaler, "unscale_"):
                raise ConfigError(
                    f"grad_scaler={type(scaler).__name__}(...): gradsync runs one scaler per run "
                    "and builds it itself with mixed_precision='fp16'; pass its settings as a "
                    "dict, e.g. grad_scaler={'init_scale': 1024}, and use accel.scaler"
                )
            if not isinstance(scaler, dict) or set(scaler) - set(GRAD_SCALER_KEYS):
                raise ConfigError(
                    f"grad_scaler={scaler!r} must be a dict with keys from "
                    f"{', '.join(GRAD_SCALER_KEYS)}"
                )
            if self.mixed_precision != "fp16":
                raise ConfigError(
                    f"grad_scaler={scaler!r} with mixed_precision={self.mixed_precision!r}: a "
                    "loss scaler is used only with fp16; set mixed_precision='fp16' or drop grad_scaler"
                )
        ac = self.activation_checkpointing
        if isinstance(ac, list | tuple) and not ac:
            self.activation_checkpointing = ac = None
        if ac is not None and not (
            isinstance(ac, str | type) or callable(ac)
            or (isinstance(ac, list | tuple) and all(isinstance(a, str | type) for a in ac))
        ):
            raise ConfigError(
                f"activation_checkpointing={ac!r} must be a module class name, a class, a list "
                "of those, or a callable module -> bool"
            )
        if self.compile is not None and not isinstance(self.compile, bool | dict):
            raise ConfigError(
                f"compile={self.compile!r} must be True, False or a dict of torch.compile "
                "arguments, e.g. {'mode': 'max-autotune'}"
            )


def _resolve_callable(name: str, value: Any) -> Any:
    """A callable as given, or the one a "module:attribute" string names."""
    if callable(value):
        return value
    if isinstance(value, str) and ":" in value:
        module_name, _, attr = value.partition(":")
        import importlib

        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"{name}={value!r} cannot be loaded ({err}); give 'module:function'") from None
    raise ConfigError(
        f"{name}={value!r} must be a callable fn(batch) -> int, or 'module:function' such as "
        "'gradsync:count_label_tokens'"
    )


_FIELDS = {f.name: f for f in fields(Config)}
_BOOLEANS = ("audit", "fsdp_reshard_after_backward", "fsdp_keep_params_in_window",
             "find_unused_parameters", "self_check", "dataset_shards_itself", "sync_with_dataloader")
_OPTIONAL = ("fsdp_reshard_after_backward", "fsdp_keep_params_in_window")  # None: not given
#: GRADSYNC_* variables that are not settings (read by the launcher, the adapters, the tools).
OTHER_VARIABLES = frozenset({"CONFIG", "DEVICE", "DEEPSPEED_BUILD_OPS", "BENCHMARK", "VENV"})


def did_you_mean(name: str, cutoff: float = 0.6) -> str:
    """' (did you mean X?)' for the setting closest to ``name``, or '' when none is close."""
    close = difflib.get_close_matches(name, sorted(_FIELDS), n=1, cutoff=cutoff)
    return f" (did you mean {close[0]}?)" if close else ""


def _coerce(name: str, raw: str, source: str) -> Any:
    """Turn an environment string into the field's type."""
    if name == "gradient_accumulation_steps" and schedule.is_schedule(raw):
        return raw.strip()
    if name in _BOOLEANS:
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(f"{source}={raw!r} is not a boolean; set it to 1 or 0")
    if name in ("gradient_accumulation_steps", "micro_batch_size", "global_batch_size", "seed",
                "fsdp_memory_budget", "sync_memory_budget"):
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(
                f"{source}={raw!r} is not an integer; set it to a whole number"
                + (" >= 1" if name != "seed" else "")
            ) from None
    if name == "compile" and raw.strip().lower() in _TRUE | _FALSE:
        return raw.strip().lower() in _TRUE  # else a JSON object of torch.compile arguments
    if name == "timeout":
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{source}={raw!r} is not a number; set it to the seconds to wait, e.g. 600") from None
    if name in ("fsdp_wrap", "activation_checkpointing"):
        return [part.strip() for part in raw.split(",") if part.strip()]
    if name in ("ddp_kwargs", "grad_scaler", "compile", "fairscale_kwargs"):
        import json

        try:
            return json.loads(raw)
        except ValueError:
            raise ConfigError(f"{source}={raw!r} is not JSON; set it to a JSON object") from None
    return raw


def from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings found in GRADSYNC_* variables, as keyword arguments."""
    env = os.environ if environ is None else environ
    found: dict[str, Any] = {}
    for name in _FIELDS:
        key = ENV_PREFIX + name.upper()
        if key in env:
            found[name] = _coerce(name, env[key], key)
    _warn_unknown_variables(env)
    return found


def _warn_unknown_variables(env: Mapping[str, str]) -> None:
    """A GRADSYNC_* variable that is no setting but close to one is most likely a typo."""
    known = {ENV_PREFIX + name.upper() for name in _FIELDS}
    others = {ENV_PREFIX + name for name in OTHER_VARIABLES}
    for key in sorted(env):
        if not key.startswith(ENV_PREFIX) or key in known or key in others:
            continue
        close = difflib.get_close_matches(key[len(ENV_PREFIX):].lower(), sorted(_FIELDS), n=1, cutoff=0.75)
        if close:
            log.warning(
                "gradsync: %s=%r is not a gradsync setting and is ignored (did you mean %s%s?)",
                key, env[key], ENV_PREFIX, close[0].upper(),
            )


def from_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The settings in a YAML (or JSON) file, as keyword arguments."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {str(p)!r} is a directory; pass the path of a YAML file")
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass the path of a YAML file")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {str(p)!r} cannot be read ({err}); pass a UTF-8 YAML file") from None
    try:
        import yaml
    except ImportError:
        import json

        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            if p.suffix.lower() == ".json":
                raise ConfigError(
                    f"config file {str(p)!r} is not valid JSON: {err.msg} at line {err.lineno}, "
                    f"column {err.colno}; fix the syntax there"
                ) from None
            raise ConfigError(
                f"config file {str(p)!r} needs PyYAML to read; pip install 'gradsync[yaml]'"
            ) from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(
                f"config file {str(p)!r} is not valid YAML: {_yaml_problem(err)}; fix the syntax there"
            ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of settings, not {type(data).__name__}")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ConfigError(
            f"config file {str(p)!r} has unknown key(s) "
            f"{', '.join(f'{k}={data[k]!r}{did_you_mean(str(k))}' for k in unknown)}; "
            f"rename or remove them (known keys: {', '.join(sorted(_FIELDS))})"
        )
    return dict(data)


def _yaml_problem(err: Exception) -> str:
    """One line from a PyYAML error: the problem and where it is (1-based line, column)."""
    problem = getattr(err, "problem", None) or getattr(err, "context", None)
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    if problem is None:
        return " ".join(str(err).split())
    if mark is None:
        return str(problem)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


def load_config(
    *,
    config_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> Config:
    """Merge defaults < YAML < environment < keywords (keywords that are None are 'not given')."""
    env = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    path = config_file or env.get(ENV_PREFIX + "CONFIG")
    if path:
        merged.update(from_yaml(path))
    from_environment = from_env(env)
    merged.update(from_environment)
    extra = {}
    for key, value in kwargs.items():
        if value is None:
            continue
        if key in _FIELDS:
            if key in from_environment and from_environment[key] != value:
                log.warning(
                    "gradsync: %s=%r given in code overrides %s%s=%r (e.g. from gradsync launch); "
                    "drop the keyword to use the launcher's value",
                    key, value, ENV_PREFIX, key.upper(), from_environment[key],
                )
            merged[key] = value
        else:
            extra[key] = value
    if extra:
        raise ConfigError(
            f"unknown setting(s) {', '.join(f'{k}={extra[k]!r}{did_you_mean(k)}' for k in sorted(extra))}; "
            f"rename or remove them (known: {', '.join(sorted(_FIELDS))})"
        )
    return Config(**merged).validate()


def env_vars(settings: Mapping[str, Any]) -> dict[str, str]:
    """The GRADSYNC_* variables that carry ``settings`` (field name -> value) to worker
    processes; ``from_env`` reads them back. The one encoding of settings as text."""
    out: dict[str, str] = {}
    for name, value in settings.items():
        if name not in _FIELDS:
            raise ConfigError(f"{name!r} is not a gradsync setting; known: {', '.join(sorted(_FIELDS))}")
        if value is None:
            continue
        if isinstance(value, bool):
            text = "1" if value else "0"
        elif isinstance(value, list | tuple):
            text = ",".join(str(v) for v in value)
        elif isinstance(value, dict):
            import json

            text = json.dumps(value)
        elif callable(value):  # read back by _resolve_callable
            text = f"{value.__module__}:{value.__qualname__}"
        else:
            text = str(value)
        out[ENV_PREFIX + name.upper()] = text
    return out


def to_env(config: Config) -> dict[str, str]:
    """The GRADSYNC_* variables of the fields of ``config`` that differ from the defaults."""
    defaults = Config()
    return env_vars({
        name: getattr(config, name) for name in _FIELDS
        if getattr(config, name) != getattr(defaults, name)
    })
