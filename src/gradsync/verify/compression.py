"""What ``comm_hook`` changes in `gradsync verify`'s comparison (no torch).

The reference is one process: it sends nothing, so it never compresses. A launched run with a
hook is compared with it at the tolerance the compression implies:

* ``fp16`` / ``bf16`` reduce the gradients of each window once, at the boundary, in that
  dtype: one relative rounding of the format per reduction (fp16 2^-11 = 4.9e-4, bf16 2^-8 =
  3.9e-3), carried into the parameters by the optimizer. They are compared at the tolerance
  of that precision (``TOLERANCE``: about 4 roundoffs of the format), as a reduce dtype of
  mixed precision is.
* ``power_sgd`` / ``batched_power_sgd`` send a rank-r approximation of the gradients with
  error feedback from their ``start_powerSGD_iter``-th reduction on: a different update,
  not a rounding of the same one, so those steps are not compared with one process. The
  steps before (plain all-reduces; in the wrapper's dtype with ``comm_wrapper``) are
  compared at the usual tolerance; the later ones are reported and checked for a finite
  window loss.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

#: The one rounding of each half-precision format, relative (2^-(significand bits)).
ROUNDING = {"fp16": 2.0**-11, "bf16": 2.0**-8}
POWER_SGD = ("power_sgd", "batched_power_sgd")
#: torch's PowerSGDState default for start_powerSGD_iter.
DEFAULT_START = 1000


def hook(meta: Mapping[str, Any]) -> str:
    """The launched run's comm_hook ("no" when none or not recorded)."""
    return str((meta.get("comm") or {}).get("hook") or "no")


def precision(meta: Mapping[str, Any], found: str) -> str:
    """The lowest precision in play once the hook's reduction dtype is counted: ``found`` (the
    parameters' or mixed precision's), or the hook's (or PowerSGD wrapper's) half format."""
    comm = meta.get("comm") or {}
    half = comm.get("hook") if comm.get("hook") in ROUNDING else comm.get("wrapper")
    if half not in ROUNDING or found == "bf16":
        return found
    return "bf16" if half == "bf16" else "fp16"


def first_approximated(meta: Mapping[str, Any]) -> int | None:
    """The first optimizer step whose reduction is PowerSGD's approximation (None: no
    PowerSGD hook). Its counter moves once per reduction: once per window where the sync
    is deferred, once per micro-step under ``every_step``."""
    comm = meta.get("comm") or {}
    if comm.get("hook") not in POWER_SGD:
        return None
    start = int((comm.get("options") or {}).get("start_powerSGD_iter", DEFAULT_START))
    ks = meta.get("k") or [1]
    per_step = int(ks[0]) if meta.get("sync_policy") == "every_step" else 1
    return start // per_step + 1


def note(meta: Mapping[str, Any], tolerance: float) -> str | None:
    """The report's line on the hook and the tolerance it implies (None: no hook)."""
    comm = meta.get("comm") or {}
    name = hook(meta)
    if name == "no":
        return None
    if name in ROUNDING:
        return (
            f"comm_hook={name!r}: each window's gradients are reduced once, at the boundary, in "
            f"{name} (one relative rounding of {ROUNDING[name]:.1e} per reduction), which one "
            f"process does not do: compared at {tolerance:g} relative, the tolerance of {name}; "
            "run with --comm-hook no for an exact check"
        )
    first = first_approximated(meta)
    rank = (comm.get("options") or {}).get("matrix_approximation_rank", 1)
    wrapper = comm.get("wrapper") or "no"
    sent = f", sent in {wrapper}" if wrapper != "no" else ""
    return (
        f"comm_hook={name!r} (rank {rank}{sent}): from step {first} on each reduction is a "
        "low-rank approximation with error feedback, a different update from one process's: "
        "those steps are not compared bitwise, only checked for a finite window loss (their "
        f"differences are shown); the steps before it are plain all-reduces{sent}, compared "
        f"at {tolerance:g}; run with --comm-hook no for an exact check of every step"
    )


def judged(meta: Mapping[str, Any], step: int) -> bool:
    """Whether ``step`` is compared with one process (False: PowerSGD approximated it)."""
    first = first_approximated(meta)
    return first is None or step < first


def finite(loss: float | None) -> bool:
    """A window loss that is not inf or NaN (None: unknown, taken as finite)."""
    return loss is None or math.isfinite(loss)
