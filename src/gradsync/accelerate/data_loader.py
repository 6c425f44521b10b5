"""``accelerate.data_loader``, spelled ``gradsync.accelerate.data_loader``."""

from __future__ import annotations

from typing import Any

from gradsync.data import PreparedDataLoader
from gradsync.errors import ConfigError


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """The prepared ``dataloader``, its next pass starting after ``num_batches`` batches
    (``Accelerator.skip_first_batches``: after ``load_state`` the restored count is a no-op)."""
    if not isinstance(dataloader, PreparedDataLoader):
        raise ConfigError(f"skip_first_batches() got a {type(dataloader).__name__}; pass the "
                          "loader returned by accel.prepare(loader)")
    dataloader.skip_next(num_batches)
    return dataloader
