"""The DDP backend's options (read by backends/ddp.py as ``config.<name>``). No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gradsync._support.declaration import check_kwargs, setting


def _check_ddp_kwargs(name: str, value: Any, config: Any) -> Any:
    return check_kwargs(name, value, "DistributedDataParallel", "{'find_unused_parameters': True}")


@dataclass
class DDPOptions:
    """Settings that only the ``ddp`` backend reads."""

    ddp_kwargs: dict[str, Any] | None = field(
        default=None,
        metadata=setting(
            'extra DistributedDataParallel(...) arguments, e.g. {"bucket_cap_mb": 50}',
            backend="ddp",
            check=_check_ddp_kwargs,
        ),
    )
    find_unused_parameters: bool = field(
        default=False,
        metadata=setting(
            "find the parameters a backward did not reach (torch's find_unused_parameters)",
            backend="ddp",
        ),
    )
