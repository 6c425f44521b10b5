"""Small helpers shared by several modules (no torch here)."""

from __future__ import annotations

import difflib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
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


def unknown(name: str, value: object, choices: Iterable[object]) -> str:
    """``"name=value is unknown (did you mean X?); use one of a, b"``: the one line for a
    value out of a fixed set, with the closest choice when one is close."""
    names = [str(choice) for choice in choices]
    return (
        f"{name}={value!r} is unknown{did_you_mean(str(value), names)}; use one of "
        f"{', '.join(names)}"
    )


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def require_attr(
    obj: object, name: str, *, what: str, library: str, version: str, supported: str
) -> Any:
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


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """``callback(module)`` once the module ``name`` is imported: now when it already is, else
    right after its import finishes (before the statement that imported it goes on).

    The audit keeps torch.compile out of its process group this way without importing
    ``torch._dynamo`` itself, seconds of start-up for a process that never compiles."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
    else:
        sys.meta_path.insert(0, _AfterImport(name, callback))


class _AfterImport(importlib.abc.MetaPathFinder):
    """One-shot finder: finds ``name`` as the path finder would, with a loader that calls
    back after executing the module; it leaves ``sys.meta_path`` when used."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenCall(spec.loader, self.callback)
        return spec


class _ThenCall(importlib.abc.Loader):
    """A module's own loader, then the callback; the module keeps its own loader."""

    def __init__(self, loader: Any, callback: Callable[[ModuleType], None]) -> None:
        self.loader, self.callback = loader, callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.callback(module)
