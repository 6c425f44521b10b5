"""The DeepSpeed backend's options (read by backends/deepspeed.py as ``config.<name>``).
No torch or DeepSpeed here."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from gradsync._support.declaration import setting


@dataclass
class DeepSpeedOptions:
    """Settings that only the ``deepspeed`` backend reads."""

    # Checked when the backend loads it (backends/_deepspeed_config.py): a file is read there.
    deepspeed_config: dict[str, Any] | str | os.PathLike[str] | None = field(
        default=None,
        metadata=setting(
            "the DeepSpeed config: a dict, the path of a JSON/YAML file, or JSON text",
            backend="deepspeed",
        ),
    )
