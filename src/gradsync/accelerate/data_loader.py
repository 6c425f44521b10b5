"""``accelerate.data_loader``, spelled ``gradsync.accelerate.data_loader``."""

from __future__ import annotations

from gradsync.data.loader import skip_first_batches

__all__ = ["skip_first_batches"]
