"""The only place outside ``backends/`` that touches private torch attributes.

The audit's process-group wrapper hands the single-tensor collectives on to the wrapped
group's ``_allgather_base`` / ``_reduce_scatter_base`` (the C++ methods that
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` end in), sets the NCCL options'
timeout, and the dataloader sharding asks whether a ``RandomSampler`` was given
``num_samples``. A torch that renamed one fails here with a message naming the supported
versions.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from gradsync._util import require_attr

#: The torch versions whose internals this module was written and tested against.
SUPPORTED_TORCH = "2.6 to 2.13"


def require(obj: object, name: str, what: str) -> Any:
    """``getattr(obj, name)``, or a RuntimeError naming what is missing and the fix."""
    return require_attr(obj, name, what=what, library="torch", version=torch.__version__,
                        supported=SUPPORTED_TORCH)


def allgather_base(pg: Any, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> Any:
    return require(pg, "_allgather_base", "all-gather into one tensor")(
        output, inp, opts
    )


def reduce_scatter_base(pg: Any, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> Any:
    return require(pg, "_reduce_scatter_base", "reduce-scatter of one tensor")(
        output, inp, opts
    )


def set_nccl_timeout(opts: Any, timeout: timedelta) -> None:
    require(opts, "_timeout", "NCCL options timeout")
    opts._timeout = timeout


def sampler_num_samples(sampler: torch.utils.data.RandomSampler) -> int | None:
    """The ``num_samples`` a RandomSampler was built with (None: one pass over the data)."""
    value: int | None = require(sampler, "_num_samples", "RandomSampler's own num_samples")
    return value
