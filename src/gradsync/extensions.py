"""The one registration point for code outside the core (``gradsync verify``'s recorder):
``GRADSYNC_EXTENSIONS`` names modules, comma-separated; each may force settings over every
other source (``overrides(environ)``) and attach to an Accelerator as it is built
(``attach(accel, parts)``). The core imports them by name only when the variable names
them, and never imports them otherwise.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any, Protocol

from gradsync.errors import ConfigError

ENV = "GRADSYNC_EXTENSIONS"


class Extension(Protocol):
    """What a module named in ``GRADSYNC_EXTENSIONS`` provides."""

    def overrides(self, environ: Mapping[str, str]) -> dict[str, Any]:
        """Settings forced over every other source (the script's keywords too)."""
        ...

    def attach(self, accel: Any, parts: Any) -> object | None:
        """Hook into the Accelerator being built (``parts``: its ``assembly.Parts``)."""
        ...


def named(environ: Mapping[str, str] | None = None) -> list[Extension]:
    """The extensions ``GRADSYNC_EXTENSIONS`` names (none when it is unset)."""
    env = os.environ if environ is None else environ
    found: list[Extension] = []
    for name in filter(None, (n.strip() for n in env.get(ENV, "").split(","))):
        try:
            module: Any = importlib.import_module(name)
        except ImportError as err:
            raise ConfigError(
                f"{ENV}={env[ENV]!r}: cannot import {name!r} ({err}); unset it"
            ) from None
        found.append(module)
    return found
