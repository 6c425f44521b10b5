"""Settings from every source, merged into one ``Config``.

Later sources win: defaults < YAML (``config_file`` / ``GRADSYNC_CONFIG``) < environment <
keywords; under ``gradsync verify`` the settings it forces win over all of them
(an extension's ``overrides``: ``gradsync.extensions``). The settings themselves (names, types, defaults,
checks) are declared once in gradsync.settings; this module reads them from the sources.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from gradsync import extensions
from gradsync._support import environment
from gradsync._support import util as _util
from gradsync._support.declaration import to_text
from gradsync.accelerate import _compat as accelerate
from gradsync.compat.files import read_yaml
from gradsync.errors import ConfigError
from gradsync.settings import (
    BY_NAME,
    ENV_PREFIX,
    GRAD_SCALER_KEYS,
    MIXED_PRECISION,
    OTHER_VARIABLES,
    SETTINGS,
    SYNC_POLICIES,
    Config,
    MixedPrecision,
    RequestedPolicy,
    SyncPolicy,
    reference_markdown,
)

__all__ = [
    "ENV_PREFIX",
    "GRAD_SCALER_KEYS",
    "MIXED_PRECISION",
    "OTHER_VARIABLES",
    "SYNC_POLICIES",
    "Config",
    "MixedPrecision",
    "RequestedPolicy",
    "SyncPolicy",
    "did_you_mean",
    "env_vars",
    "from_env",
    "from_yaml",
    "load_config",
    "read_yaml",
    "reference_markdown",
    "to_env",
]

log = logging.getLogger("gradsync")

_KNOWN = ", ".join(sorted(BY_NAME))
_BY_KEY = {s.yaml_key: s for s in SETTINGS}
_BY_ENV = {s.env: s for s in SETTINGS}


def did_you_mean(name: str, cutoff: float = 0.6) -> str:
    """' (did you mean X?)' for the setting closest to ``name``, or '' when none is close.

    Args:
        name: the unknown name.
        cutoff: how close a setting must be (difflib's ratio, 0 to 1).

    Returns:
        The suggestion, with a leading space, or ''.
    """
    return _util.did_you_mean(name, BY_NAME, cutoff)


def from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings found in GRADSYNC_* variables, as keyword arguments.

    Args:
        environ: the variables (default: ``os.environ``).

    Returns:
        Setting name -> value, read from text by each setting's type.

    Raises:
        ConfigError: a variable's text is not a value of its setting's type.
    """
    env = os.environ if environ is None else environ
    found = {s.name: s.from_text(env[s.env], s.env) for s in SETTINGS if s.env in env}
    _warn_unknown_variables(env)
    return found


def _warn_unknown_variables(env: Mapping[str, str]) -> None:
    """A GRADSYNC_* variable that is no setting but close to one is most likely a typo."""
    others = {ENV_PREFIX + name for name in OTHER_VARIABLES}
    for key in sorted(env):
        if not key.startswith(ENV_PREFIX) or key in _BY_ENV or key in others:
            continue
        close = _util.closest(key[len(ENV_PREFIX) :].lower(), BY_NAME, cutoff=0.75)
        if close:
            log.warning(
                "gradsync: %s=%r is not a gradsync setting and is ignored (did you mean %s?)",
                key,
                env[key],
                BY_NAME[close].env,
            )


def from_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The settings in a YAML (or JSON) file, as keyword arguments.

    The file holds gradsync's keys, or is Accelerate's (as ``accelerate config`` writes it:
    told apart by keys such as ``distributed_type`` and ``num_processes``), translated by
    ``gradsync.accelerate._compat``: its keys that only say how to start the processes
    are for ``gradsync launch``, and a key that is ignored is one warning (on rank 0).

    Args:
        path: the file.

    Returns:
        Setting name -> value.

    Raises:
        ConfigError: the file is missing, unreadable, malformed, or has an unknown key (or an
            Accelerate key gradsync cannot honour).
    """
    data = read_yaml(path)
    if accelerate.is_accelerate(data):
        translated = accelerate.translate(data, accelerate.Source(repr(str(path))))
        if translated.notes and environment.detect().rank == 0:  # the same file on every rank
            for note in translated.notes:
                log.warning("gradsync: %s", note)
        return translated.settings
    unknown = sorted((k for k in data if k not in _BY_KEY), key=str)
    if unknown:
        raise ConfigError(
            f"config file {str(path)!r} has unknown key(s) "
            f"{', '.join(f'{k}={data[k]!r}{did_you_mean(str(k))}' for k in unknown)}; "
            f"rename or remove them (known keys: {', '.join(sorted(_BY_KEY))})"
        )
    return {_BY_KEY[key].name: value for key, value in data.items()}


def load_config(
    *,
    config_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> Config:
    """Merge defaults < YAML < environment < keywords (keywords that are None are 'not given').

    Args:
        config_file: a YAML (or JSON) file of settings (default: ``GRADSYNC_CONFIG``).
        environ: the variables to read ``GRADSYNC_*`` from (default: ``os.environ``).
        **kwargs: settings by name.

    Returns:
        The validated Config.

    Raises:
        ConfigError: an unknown setting (with the closest known one) or an invalid value.
    """
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
        if key in BY_NAME:
            if key in from_environment and from_environment[key] != value:
                log.warning(
                    "gradsync: %s=%r given in code overrides %s=%r (e.g. from gradsync launch); "
                    "drop the keyword to use the launcher's value",
                    key,
                    value,
                    BY_NAME[key].env,
                    from_environment[key],
                )
            merged[key] = value
        else:
            extra[key] = value
    if extra:
        raise ConfigError(
            f"unknown setting(s) {', '.join(f'{k}={extra[k]!r}{did_you_mean(k)}' for k in sorted(extra))}; "
            f"rename or remove them (known: {_KNOWN})"
        )
    for extension in extensions.named(env):  # the one exception to "keywords last": gradsync verify
        merged.update(extension.overrides(env))
    return Config(**merged).validate()


def env_vars(settings: Mapping[str, Any]) -> dict[str, str]:
    """The GRADSYNC_* variables that carry ``settings`` to worker processes; ``from_env``
    reads them back. The one encoding of settings as text.

    Args:
        settings: setting name -> value (None: not set, no variable).

    Returns:
        Variable -> text.

    Raises:
        ConfigError: a name is no setting.
    """
    out: dict[str, str] = {}
    for name, value in settings.items():
        if name not in BY_NAME:
            raise ConfigError(
                f"{name!r} is not a gradsync setting{did_you_mean(name)}; known: {_KNOWN}"
            )
        if value is not None:
            out[BY_NAME[name].env] = to_text(value)
    return out


def to_env(config: Config) -> dict[str, str]:
    """The GRADSYNC_* variables of the settings of ``config`` that differ from the defaults.

    Args:
        config: the settings.

    Returns:
        Variable -> text.
    """
    return env_vars(
        {s.name: getattr(config, s.name) for s in SETTINGS if getattr(config, s.name) != s.default}
    )
