"""Registry of backends: name -> factory. Imports are lazy, so naming a backend costs nothing."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from gradsync.errors import ConfigError

if TYPE_CHECKING:
    from gradsync.backends.base import Backend
    from gradsync.backends.ddp import DDPBackend
    from gradsync.backends.deepspeed import DeepSpeedBackend
    from gradsync.backends.fsdp import FSDPBackend
    from gradsync.backends.single import SingleBackend

    # mypy checks here that every adapter satisfies the Backend protocol.
    _ADAPTERS: tuple[type[Backend], ...] = (SingleBackend, DDPBackend, FSDPBackend, DeepSpeedBackend)

# name -> "module:Class"; the module is imported only when the backend is created.
_REGISTRY: dict[str, str] = {
    "single": "gradsync.backends.single:SingleBackend",
    "ddp": "gradsync.backends.ddp:DDPBackend",
    "fsdp": "gradsync.backends.fsdp:FSDPBackend",
    "deepspeed": "gradsync.backends.deepspeed:DeepSpeedBackend",
}


def available() -> list[str]:
    """The backend names gradsync knows (plus "auto")."""
    return sorted(_REGISTRY)


def check_name(name: str) -> str:
    """Return the normalised name, or raise a ConfigError that lists the known ones."""
    key = name.lower()
    if key != "auto" and key not in _REGISTRY:
        raise ConfigError(
            f"backend={name!r} is unknown; available: auto, {', '.join(available())}"
        )
    return key


def resolve_auto(name: str, world_size: int) -> str:
    """"auto" is ddp when there is more than one process, else single."""
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
