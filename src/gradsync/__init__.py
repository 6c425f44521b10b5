"""gradsync: gradient accumulation that is correct and cheap on every PyTorch backend.

Importing gradsync does not import torch: the names below are loaded when first used,
so the command line (``gradsync launch``, ``gradsync plan``) starts fast and can say
"torch is not installed" itself.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradsync._plan.batch_plan import BatchPlan
from gradsync._version import __version__
from gradsync.config import Config
from gradsync.errors import CheckpointError, CollectiveError, ConfigError, UsageError

if TYPE_CHECKING:
    from gradsync import audit
    from gradsync.accelerator import Accelerator
    from gradsync.checkpoint import latest_checkpoint
    from gradsync.metrics import gather_object
    from gradsync.seeding import set_seed
    from gradsync.tokens import count_label_tokens

__all__ = [
    "Accelerator",
    "BatchPlan",
    "CheckpointError",
    "CollectiveError",
    "Config",
    "ConfigError",
    "UsageError",
    "__version__",
    "audit",
    "count_label_tokens",
    "gather_object",
    "latest_checkpoint",
    "set_seed",
]

# name -> module that defines it (imported on first access: these import torch)
_LAZY = {
    "Accelerator": "gradsync.accelerator",
    "audit": "gradsync.audit",
    "latest_checkpoint": "gradsync.checkpoint",
    "count_label_tokens": "gradsync.tokens",
    "gather_object": "gradsync.metrics",
    "set_seed": "gradsync.seeding",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import torch

        from gradsync._support import torch_range as _torch_range

        if _torch_range.below(torch.__version__):  # its modules may not even import there
            return _refused(name, _torch_range.refusal(torch.__version__))
        module = importlib.import_module(_LAZY[name])
        value = module if name == "audit" else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gradsync' has no attribute {name!r}")


def _refused(name: str, why: str) -> Any:
    """What ``name`` is on a torch below the supported range: calling it raises ``why``."""
    if name == "audit":
        raise UsageError(why)

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise UsageError(why)

    refused.__name__ = refused.__qualname__ = name
    return refused


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
