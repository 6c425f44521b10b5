"""Registry of backends: name -> factory. Imports are lazy, so naming a backend costs nothing."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from gradsync.errors import ConfigError

if TYPE_CHECKING:
    from gradsync.backends.base import Backend
    from gradsync.backends.ddp import DDPBackend
    from gradsync.backends.deepspeed import DeepSpeedBackend
    from gradsync.backends.fairscale import FairscaleBackend
    from gradsync.backends.fsdp import FSDPBackend
    from gradsync.backends.single import SingleBackend

    # mypy checks here that every adapter satisfies the Backend protocol.
    _ADAPTERS: tuple[type[Backend], ...] = (
        SingleBackend,
        DDPBackend,
        FSDPBackend,
        DeepSpeedBackend,
        FairscaleBackend,
    )

# name -> "module:Class"; the module is imported only when the backend is created.
_REGISTRY: dict[str, str] = {
    "single": "gradsync.backends.single:SingleBackend",
    "ddp": "gradsync.backends.ddp:DDPBackend",
    "fsdp": "gradsync.backends.fsdp:FSDPBackend",
    "deepspeed": "gradsync.backends.deepspeed:DeepSpeedBackend",
    "fairscale": "gradsync.backends.fairscale:FairscaleBackend",
}

# name -> the module an optional backend needs (installed by the extra of the same name).
_NEEDS: dict[str, str] = {"deepspeed": "deepspeed", "fairscale": "fairscale"}
# name -> what `gradsync env` says next to "available".
_NOTES: dict[str, str] = {
    "fairscale": "legacy: fairscale 0.4.13 is from 2022; backend='fsdp' is the supported sharded path",
}


def available() -> list[str]:
    """The backend names gradsync knows (plus "auto")."""
    return sorted(_REGISTRY)


def status(name: str) -> str:
    """Whether the backend can be used here, without importing it: "available" (with a note
    for legacy backends) or "not installed" with the install command."""
    key = check_name(name)
    needs = _NEEDS.get(key)
    if needs is not None and importlib.util.find_spec(needs) is None:
        return f"not installed (pip install 'gradsync[{key}]')"
    note = _NOTES.get(key)
    return f"available ({note})" if note else "available"


def check_name(name: str) -> str:
    """Return the normalised name, or raise a ConfigError that lists the known ones."""
    key = name.lower()
    if key != "auto" and key not in _REGISTRY:
        raise ConfigError(f"backend={name!r} is unknown; available: auto, {', '.join(available())}")
    return key


def resolve_auto(name: str, world_size: int) -> str:
    """ "auto" is ddp when there is more than one process, else single."""
    key = check_name(name)
    if key == "auto":
        return "ddp" if world_size > 1 else "single"
    return key


def create(name: str) -> Backend:
    """A fresh adapter for ``name`` (not "auto": resolve it first)."""
    key = check_name(name)
    if key == "auto":
        raise ConfigError("backend='auto' must be resolved with resolve_auto() before create()")
    module_name, _, cls_name = _REGISTRY[key].partition(":")
    module = importlib.import_module(module_name)
    backend: Backend = getattr(module, cls_name)()
    return backend
