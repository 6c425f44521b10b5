"""One Config dataclass, filled from defaults, a YAML file, GRADSYNC_* variables and keywords.

Later sources win: defaults < YAML (``config_file`` / ``GRADSYNC_CONFIG``) < environment < keywords.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

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

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass
class Config:
    """Every gradsync setting. Errors name the key, the value and the fix."""

    backend: str = "auto"
    gradient_accumulation_steps: int | None = None
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    sync_policy: RequestedPolicy = "auto"
    seed: int | None = None
    audit: bool = False
    mixed_precision: str = "no"
    # Backend options (each adapter reads its own; unknown to the others).
    deepspeed_config: Any = None
    fsdp_memory_budget: int | None = None
    fsdp_reshard_after_backward: bool | None = None
    fsdp_wrap: Any = None
    ddp_kwargs: dict[str, Any] | None = None  # extra DistributedDataParallel(...) arguments
    fairscale_kwargs: dict[str, Any] | None = None  # extra ShardedDataParallel(...) arguments

    def validate(self) -> Config:
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError(f"backend={self.backend!r} must be a backend name such as 'ddp'")
        self.backend = self.backend.lower()
        for name in ("gradient_accumulation_steps", "micro_batch_size", "global_batch_size"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, check_positive_int(name, value))
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
        if self.fairscale_kwargs is not None and not isinstance(self.fairscale_kwargs, dict):
            raise ConfigError(
                f"fairscale_kwargs={self.fairscale_kwargs!r} must be a dict of ShardedDataParallel "
                "arguments, e.g. {'reduce_buffer_size': 0}"
            )
        if not isinstance(self.audit, bool):
            raise ConfigError(f"audit={self.audit!r} must be True or False")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed={self.seed!r} must be an integer or None")
        return self


_FIELDS = {f.name: f for f in fields(Config)}


def _coerce(name: str, raw: str, source: str) -> Any:
    """Turn an environment string into the field's type."""
    if name in ("audit", "fsdp_reshard_after_backward"):
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(f"{source}={raw!r} is not a boolean; set it to 1 or 0")
    if name in ("gradient_accumulation_steps", "micro_batch_size", "global_batch_size", "seed",
                "fsdp_memory_budget"):
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(
                f"{source}={raw!r} is not an integer; set it to a whole number"
                + (" >= 1" if name != "seed" else "")
            ) from None
    if name == "fsdp_wrap":
        return [part.strip() for part in raw.split(",") if part.strip()]
    if name in ("ddp_kwargs", "fairscale_kwargs"):
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
    return found


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
            f"config file {str(p)!r} has unknown key(s) {', '.join(unknown)}; "
            f"known keys: {', '.join(sorted(_FIELDS))}"
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
            f"unknown setting(s) {', '.join(sorted(extra))}; known: {', '.join(sorted(_FIELDS))}"
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
