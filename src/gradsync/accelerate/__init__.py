"""Accelerate's module paths on gradsync: ``from gradsync.accelerate import Accelerator``
(and ``gradsync.accelerate.utils``, ``gradsync.accelerate.logging``, ...) runs a script
written for Accelerate with only its import lines changed, and follows Accelerate's rule
book where gradsync's differs (``gradsync.rules``), so it ends with Accelerate's parameters.

``gradsync.Accelerator`` keeps gradsync's own rules. The two are chosen by the import and
never mixed. Names gradsync does not have raise one ImportError line saying what to use.
"""

from __future__ import annotations

from typing import Any

from gradsync.accelerate._names import refuse
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


def __getattr__(name: str) -> Any:
    refuse("accelerate", name)
    raise AttributeError(f"module 'gradsync.accelerate' has no attribute {name!r}")
