"""The only place gradsync imports fairscale and touches its private state.

fairscale's last release, 0.4.13 (2022), is legacy: gradsync supports its
``ShardedDataParallel`` + ``OSS`` pair and nothing newer exists. Importing this module
imports fairscale, or raises a one-line ImportError that says how to install it (or that
the installed fairscale does not work with this torch).

Two things have no public API in fairscale 0.4.13:

* ``ShardedDataParallel.no_sync()`` sets ``_should_accumulate_grads`` and puts the old
  value back only when its block exits normally; after an exception inside the block every
  later backward would skip its reduction. ``no_sync`` below restores it in all cases.
* Reductions still in flight when a window is dropped (``_work_handles``, consumed by
  ``_consume_work_handles``) would write into the gradients after they were cleared.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from gradsync._support.torch_compat import SUPPORTED_TORCH
from gradsync._support.util import require_attr

#: The fairscale version whose internals this module was written and tested against.
SUPPORTED_FAIRSCALE = "0.4.13"
INSTALL_HINT = "pip install 'gradsync[fairscale]'"


def _import() -> tuple[Any, Any, Any, str]:
    """(ShardedDataParallel, OSS, FullyShardedDataParallel, version), or a one-line ImportError."""
    try:
        import fairscale
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] != "fairscale":
            raise _incompatible("?", err) from None
        raise ImportError(
            f"backend='fairscale' needs fairscale, which is not installed: {INSTALL_HINT} "
            f"(fairscale {SUPPORTED_FAIRSCALE}; legacy: backend='fsdp' is the supported sharded path)"
        ) from None
    except Exception as err:  # e.g. a fairscale that uses what this torch removed
        raise _incompatible("?", err) from None
    version = str(getattr(fairscale, "__version__", "?"))
    try:
        from packaging.version import Version

        too_old = Version(version) < Version(SUPPORTED_FAIRSCALE)
    except Exception:  # an unparsable version string: let the imports below decide
        too_old = False
    if too_old:
        raise ImportError(
            f"backend='fairscale' supports fairscale {SUPPORTED_FAIRSCALE}, not {version} (older "
            f"releases do not run on torch 2); {INSTALL_HINT} installs {SUPPORTED_FAIRSCALE}"
        )
    try:
        from fairscale.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
        from fairscale.optim import OSS
    except Exception as err:
        raise _incompatible(version, err) from None
    return ShardedDataParallel, OSS, FullyShardedDataParallel, version


def _incompatible(version: str, err: BaseException) -> ImportError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return ImportError(
        f"backend='fairscale': fairscale {version} does not import with torch {torch.__version__} "
        f"({type(err).__name__}: {first}); gradsync supports fairscale {SUPPORTED_FAIRSCALE} with "
        f"torch {SUPPORTED_TORCH}: {INSTALL_HINT}, or use backend='fsdp' (FSDP2)"
    )


ShardedDataParallel, OSS, FullyShardedDataParallel, VERSION = _import()


def _require(obj: object, name: str, what: str) -> Any:
    return require_attr(
        obj,
        name,
        what=f"ShardedDataParallel {what}",
        library="fairscale",
        version=VERSION,
        supported=SUPPORTED_FAIRSCALE,
    )


@contextlib.contextmanager
def no_sync(model: Any) -> Iterator[None]:
    """``model.no_sync()`` whose flag is put back even when the block raises."""
    saved = _require(model, "_should_accumulate_grads", "no_sync flag")
    try:
        with model.no_sync():
            yield
    finally:
        model._should_accumulate_grads = saved


def finish_reductions(model: Any) -> None:
    """Wait for every gradient reduction ``model`` still has in flight (a backward that
    raised before its end-of-backward flush leaves them pending)."""
    if _require(model, "_work_handles", "pending reductions"):
        _require(model, "_consume_work_handles", "wait for pending reductions")()


def broadcasts_buffers(model: Any) -> bool:
    """Whether ``model``'s next forward broadcasts its buffers from rank 0 (it does in each
    forward whose backward reduces, when it has buffers and broadcasting is on)."""
    enabled = _require(model, "_enable_broadcast_buffers", "broadcast_buffers flag")
    accumulating = _require(model, "_should_accumulate_grads", "no_sync flag")
    return bool(enabled) and not accumulating and any(True for _ in model.module.buffers())
