"""The FSDP2 backend's options (read by backends/fsdp.py as ``config.<name>``). No torch here."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from gradsync.declaration import ModuleSelector, check_bytes, setting
from gradsync.errors import ConfigError


def _check_old_budget(name: str, value: Any, config: Any) -> int:
    """fsdp_memory_budget, the old name of sync_memory_budget: bytes, and no contradiction."""
    budget = check_bytes(name, value, config)
    if config.sync_memory_budget is not None and config.sync_memory_budget != budget:
        raise ConfigError(
            f"fsdp_memory_budget={budget} contradicts sync_memory_budget="
            f"{config.sync_memory_budget}; fsdp_memory_budget is the old name of "
            "sync_memory_budget: set only sync_memory_budget"
        )
    return budget


def _check_reshard(name: str, value: Any, config: Any) -> bool:
    """The deprecated fsdp_reshard_after_backward: its False is fsdp_keep_params_in_window's
    True; a contradiction is an error, any use a DeprecationWarning."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be True, False or None")
    keep = config.fsdp_keep_params_in_window
    if keep is not None and keep == value:
        raise ConfigError(
            f"fsdp_reshard_after_backward={value} contradicts fsdp_keep_params_in_window={keep}; "
            "fsdp_reshard_after_backward is deprecated: set only fsdp_keep_params_in_window"
        )
    warnings.warn(
        "fsdp_reshard_after_backward is deprecated; use fsdp_keep_params_in_window=True "
        "(keeps the parameters gathered for the whole window: no all-gather after the "
        "window's first micro-step) or False",
        DeprecationWarning, stacklevel=6,  # the caller of Accelerator() / load_config()
    )
    return value


@dataclass
class FSDPOptions:
    """Settings that only the ``fsdp`` backend reads."""

    fsdp_wrap: ModuleSelector | None = field(default=None, metadata=setting(
        "the submodules sharded as their own unit: class names, classes or a callable "
        "module -> bool (None: the children of every ModuleList / Sequential)",
        backend="fsdp"))
    fsdp_keep_params_in_window: bool | None = field(default=None, metadata=setting(
        "keep the parameters gathered for the rest of a deferred window (None: decided by "
        "sync_memory_budget)", backend="fsdp"))
    fsdp_reshard_after_backward: bool | None = field(default=None, metadata=setting(
        "deprecated: False keeps the parameters gathered only after backward; use "
        "fsdp_keep_params_in_window", backend="fsdp", check=_check_reshard))
    fsdp_memory_budget: int | None = field(default=None, metadata=setting(
        "the old name of sync_memory_budget", backend="fsdp", check=_check_old_budget,
        minimum=0))
