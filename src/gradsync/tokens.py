"""Item counters for token-weighted accumulation (``Accelerator(count_items=...)``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gradsync.errors import ConfigError


def count_label_tokens(batch: Any, ignore_index: int = -100, shift: bool = True) -> int:
    """The tokens a causal LM is trained on in ``batch``: the entries of ``batch["labels"]``
    that are not ``ignore_index``; with ``shift``, without each row's first position (the one
    a causal LM never predicts: Transformers shifts the labels left by one).

    Args:
        batch: a mapping with a ``"labels"`` tensor, or an object with a ``labels`` attribute.
        ignore_index: the label value that marks a position trained on no token.
        shift: drop each row's first label before counting.

    Returns:
        The number of labels that are not ``ignore_index``.

    Raises:
        ConfigError: the batch holds no ``labels`` tensor.
    """
    labels = batch.get("labels") if isinstance(batch, Mapping) else getattr(batch, "labels", None)
    if not isinstance(labels, torch.Tensor):
        raise ConfigError(
            f"count_label_tokens needs a batch with a 'labels' tensor, got a {type(batch).__name__}"
            f"{' with keys ' + ', '.join(map(str, batch)) if isinstance(batch, Mapping) else ''}; "
            "pass your own count_items=fn(batch) -> int for other batch layouts"
        )
    if shift:
        labels = labels[..., 1:]
    return int((labels != ignore_index).sum().item())
