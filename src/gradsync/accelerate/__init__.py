"""Accelerate's module paths on gradsync: ``from gradsync.accelerate import Accelerator``
(and ``gradsync.accelerate.utils``, ``gradsync.accelerate.logging``, ...) runs a script
written for Accelerate with only its import lines changed, and follows Accelerate's rule
book where gradsync's differs (``gradsync.rules``), so it ends with Accelerate's parameters.

``gradsync.Accelerator`` keeps gradsync's own rules. The two are chosen by the import and
never mixed. Names gradsync does not have raise one ImportError line saying what to use.

Everything gradsync knows of Accelerate lives in this package: the script-facing names
here and in its submodules, and ``_compat``, the translation of Accelerate's config files
and ``accelerate launch`` flags, which the launcher reads without torch. So importing this
package imports no torch: the names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradsync.accelerate._names import refuse

if TYPE_CHECKING:
    from gradsync.accelerate.accelerator import Accelerator
    from gradsync.accelerate.accelerator import GradientState as GradientState
    from gradsync.accelerate.config import (
        AutocastKwargs,
        DataLoaderConfiguration,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
    )
    from gradsync.accelerate.config import (
        GradientAccumulationPlugin as GradientAccumulationPlugin,
    )
    from gradsync.accelerate.config import (
        ProjectConfiguration as ProjectConfiguration,
    )
    from gradsync.accelerate.data_loader import skip_first_batches
    from gradsync.accelerate.state import AcceleratorState as AcceleratorState
    from gradsync.accelerate.state import PartialState
    from gradsync.accelerate.utils import find_executable_batch_size
    from gradsync.backends.kinds import DistributedType

# Accelerate's top-level names (AcceleratorState, GradientState, ProjectConfiguration and
# GradientAccumulationPlugin also import from here, as from gradsync.accelerate.state / .utils).
__all__ = [
    "Accelerator",
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "PartialState",
    "find_executable_batch_size",
    "skip_first_batches",
]

#: name -> the module that defines it (imported on first access: these import torch)
_LAZY = {
    "Accelerator": "gradsync.accelerate.accelerator",
    "GradientState": "gradsync.accelerate.accelerator",
    "AutocastKwargs": "gradsync.accelerate.config",
    "DataLoaderConfiguration": "gradsync.accelerate.config",
    "DDPCommunicationHookType": "gradsync.accelerate.config",
    "DistributedDataParallelKwargs": "gradsync.accelerate.config",
    "GradientAccumulationPlugin": "gradsync.accelerate.config",
    "GradScalerKwargs": "gradsync.accelerate.config",
    "InitProcessGroupKwargs": "gradsync.accelerate.config",
    "ProjectConfiguration": "gradsync.accelerate.config",
    "skip_first_batches": "gradsync.accelerate.data_loader",
    "AcceleratorState": "gradsync.accelerate.state",
    "PartialState": "gradsync.accelerate.state",
    "find_executable_batch_size": "gradsync.accelerate.utils",
    "DistributedType": "gradsync.backends.kinds",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    refuse("accelerate", name)
    raise AttributeError(f"module 'gradsync.accelerate' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
