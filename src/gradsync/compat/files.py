"""The one reader of config files (YAML, or JSON) and the one loader of DeepSpeed configs.

Every problem with a file is one ``ConfigError`` line naming the file (or value), what is
wrong with it and the fix. Imports no torch; PyYAML only when a file is YAML.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from gradsync.errors import ConfigError

__all__ = ["load_deepspeed_config", "parse", "read_yaml"]

_NEEDS_YAML = "pip install 'gradsync[yaml]'"


def parse(text: str, label: str, *, syntax: Literal["yaml", "json"]) -> Any:
    """What ``text`` holds.

    Args:
        text: the text.
        label: how messages name it (``config file 'a.yaml'``).
        syntax: "json", or "yaml" (read as JSON where PyYAML is not installed).

    Returns:
        The parsed value.

    Raises:
        ConfigError: the text is malformed (where: line and column), or is YAML without PyYAML.
    """
    if syntax == "yaml":
        try:
            import yaml
        except ImportError:
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                raise ConfigError(f"{label} needs PyYAML to read; {_NEEDS_YAML}") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(
                f"{label} is not valid YAML: {_yaml_problem(err)}; fix the syntax there"
            ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{label} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}; "
            "fix the syntax there"
        ) from None


def _yaml_problem(err: Exception) -> str:
    """One line from a PyYAML error: the problem and where it is (1-based line, column)."""
    problem = getattr(err, "problem", None) or getattr(err, "context", None)
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    if problem is None:
        return " ".join(str(err).split())
    if mark is None:
        return str(problem)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


def _syntax(path: Path, default: Literal["yaml", "json"]) -> Literal["yaml", "json"]:
    suffix = path.suffix.lower()
    return "json" if suffix == ".json" else "yaml" if suffix in (".yaml", ".yml") else default


def _read_text(path: Path, label: str, kind: str) -> str:
    """The text of the file ``path``; ``kind`` names what to pass instead (``a YAML file``)."""
    if path.is_dir():
        raise ConfigError(f"{label} is a directory; pass the path of {kind}")
    if not path.is_file():
        raise ConfigError(f"{label} does not exist; pass the path of {kind}")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{label} cannot be read ({err}); pass a readable UTF-8 file") from None


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping a YAML (or JSON) config file holds, as it is written (gradsync's keys or
    Accelerate's). A ``.json`` file is read as JSON; any other as YAML (as JSON where PyYAML
    is not installed).

    Args:
        path: the file.

    Returns:
        Its top-level mapping ({} for an empty file).

    Raises:
        ConfigError: the file is missing, unreadable, malformed, or holds no mapping.
    """
    p = Path(path)
    label = f"config file {str(p)!r}"
    data = parse(_read_text(p, label, "a YAML file"), label, syntax=_syntax(p, "yaml"))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{label} must hold a mapping of settings, not {type(data).__name__}")
    return data


def load_deepspeed_config(value: Any, label: str | None = None) -> dict[str, Any]:
    """A DeepSpeed config from a mapping, the path of a JSON or YAML file (``.yaml`` /
    ``.yml``), or JSON text: always a copy.

    Args:
        value: the config (None: an empty one).
        label: how messages name it (default: ``deepspeed_config=<value>``).

    Returns:
        The config.

    Raises:
        ConfigError: a value of another type, a missing or unreadable file, malformed JSON or
            YAML, or one that holds no mapping.
    """
    if value is None:
        return {}
    if isinstance(value, Mapping):
        copy: dict[str, Any] = json.loads(json.dumps(value))
        return copy
    name = label or f"deepspeed_config={value!r}"
    if not isinstance(value, str | os.PathLike):
        raise ConfigError(f"{name} must be a dict, a JSON/YAML path or JSON text")
    text = os.fspath(value)
    path = Path(text).expanduser()
    if not text.lstrip().startswith("{") and path.is_file():
        data = parse(
            _read_text(path, name, "a DeepSpeed JSON or YAML file"),
            name,
            syntax=_syntax(path, "json"),
        )
    elif text.lstrip().startswith(("{", "[")):
        data = parse(text, name, syntax="json")
    else:
        raise ConfigError(
            f"{name} is neither an existing file nor JSON text; pass a dict, the path of a "
            ".json/.yaml file, or a JSON string"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"{name} must hold a mapping of DeepSpeed settings, not {type(data).__name__}; "
            'write it as one, e.g. {"zero_optimization": {"stage": 2}}'
        )
    return data
