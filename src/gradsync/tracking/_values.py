"""What the trackers share: logged values as Python values, nested dicts flattened, one
warning per key a tracker cannot record, and the check that a tracker takes no arguments."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from gradsync.errors import ConfigError

log = logging.getLogger("gradsync")


def plain(value: Any) -> Any:
    """``value`` as a Python value where it is a one-element tensor (any device) or NumPy
    array or scalar; dicts are converted key by key; anything else is returned unchanged.

    Args:
        value: one logged value.

    Returns:
        The number for a one-element tensor or array, else the value itself.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().item() if value.numel() == 1 else value
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.size == 1):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    return value


def is_number(value: Any) -> bool:
    """Whether ``value`` is a Python number (booleans included)."""
    return isinstance(value, bool | int | float)


def flat(values: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(key, value) pairs with nested dicts' keys joined by "/": {"loss": {"train": 1}}
    gives ("loss/train", 1)."""
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flat(value, name + "/")
        else:
            yield name, value


class LeftOut:
    """Warns once per key that a tracker cannot record a value."""

    def __init__(self, tracker: str) -> None:
        self.tracker = tracker
        self.keys: set[str] = set()

    def __call__(self, key: str, value: Any, can: str) -> None:
        if key in self.keys:
            return
        self.keys.add(key)
        log.warning(
            "gradsync: the %s tracker cannot record values[%r] (a %s): it is left out; "
            "it records %s",
            self.tracker,
            key,
            type(value).__name__,
            can,
        )


def check_no_kwargs(name: str, kwargs: Mapping[str, Any], what: str) -> None:
    """Refuse arguments for tracker ``name``, which takes none (``what``: where they were
    given, ``init_kwargs`` or ``log_kwargs``)."""
    if kwargs:
        raise ConfigError(
            f"{what}[{name!r}]={dict(kwargs)!r}: the {name} tracker takes no "
            f"arguments there; drop the {name!r} entry"
        )
