"""Small helpers shared by several modules (no torch here)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from gradsync.errors import ConfigError


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` as an int >= 1, or raise a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.strip().lstrip("+").isdigit():
            value = int(value)
        else:
            raise ConfigError(f"{name}={value!r} is not an integer; set it to a whole number >= 1")
    if value < 1:
        raise ConfigError(f"{name}={value} must be >= 1; set it to a whole number >= 1")
    return value


def check_non_negative_int(name: str, value: object) -> int:
    """Return ``value`` as an int >= 0, or raise a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name}={value!r} must be a whole number >= 0")
    return value


def closest(name: str, choices: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The choice closest to ``name`` (difflib's ratio at least ``cutoff``), or None."""
    close = difflib.get_close_matches(name, sorted(choices), n=1, cutoff=cutoff)
    return close[0] if close else None


def did_you_mean(name: str, choices: Iterable[str], cutoff: float = 0.6) -> str:
    """' (did you mean X?)' for the choice closest to ``name``, or '' when none is close
    (difflib's ratio at least ``cutoff``)."""
    close = closest(name, choices, cutoff)
    return f" (did you mean {close}?)" if close else ""


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def require_attr(obj: object, name: str, *, what: str, library: str, version: str, supported: str) -> Any:
    """``getattr(obj, name)`` for a private attribute of ``library``; where this version of
    it lacks one, a RuntimeError that names what is missing and the supported versions."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise RuntimeError(
            f"gradsync needs {library}'s {what} ({type(obj).__name__}.{name}), which {library} "
            f"{version} does not have; gradsync supports {library} {supported}: install one of "
            "those (constraints.txt pins the tested version)"
        ) from None
