"""Data: sharding over ranks (``sharding``), nested batches (``batches``) and the prepared
dataloader (``loader``)."""

from __future__ import annotations

from gradsync.data.batches import batch_length, checked_count, split_batch, to_device, tree_map
from gradsync.data.loader import (
    Epochs,
    ItemCounter,
    LoaderContext,
    LoaderIteration,
    PreparedDataLoader,
)
from gradsync.data.sharding import BatchShard, IterableShard, shard_dataloader

__all__ = [
    "BatchShard",
    "Epochs",
    "ItemCounter",
    "IterableShard",
    "LoaderContext",
    "LoaderIteration",
    "PreparedDataLoader",
    "batch_length",
    "checked_count",
    "shard_dataloader",
    "split_batch",
    "to_device",
    "tree_map",
]
