"""The fairscale backend's options (read by backends/fairscale.py as ``config.<name>``).
No torch or fairscale here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gradsync._support.declaration import check_kwargs, setting


def _check_fairscale_kwargs(name: str, value: Any, config: Any) -> Any:
    return check_kwargs(name, value, "ShardedDataParallel", "{'reduce_buffer_size': 0}")


@dataclass
class FairscaleOptions:
    """Settings that only the ``fairscale`` backend reads."""

    fairscale_kwargs: dict[str, Any] | None = field(
        default=None,
        metadata=setting(
            'extra ShardedDataParallel(...) arguments, e.g. {"reduce_buffer_size": 0}',
            backend="fairscale",
            check=_check_fairscale_kwargs,
        ),
    )
