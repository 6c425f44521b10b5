"""The only place gradsync touches DeepSpeed's private state.

DeepSpeed has no public API for: changing the clipping value after ``initialize``, the
fp32 master weights of its stage-0 mixed-precision optimizers, dropping the gradients
a micro-step has already accumulated (its ``zero_grad`` after a ZeRO 1/2 reduction leaves
the averaged partitions in place), and checking a config for the keys it removed before
``initialize`` (and so before any collective). Every access goes through ``_require`` so that a
DeepSpeed that renamed one fails with a message naming the supported versions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gradsync._support.util import require_attr

#: The DeepSpeed versions whose internals this module was written and tested against.
SUPPORTED_DEEPSPEED = "0.19 (tested with 0.19.8)"


def _version() -> str:
    try:
        import deepspeed

        return str(deepspeed.__version__)
    except ImportError:  # pragma: no cover - the adapter checks the import first
        return "?"


def _require(obj: object, name: str, what: str) -> Any:
    return require_attr(
        obj, name, what=what, library="deepspeed", version=_version(), supported=SUPPORTED_DEEPSPEED
    )


def set_clipping(engine: Any, max_norm: float) -> None:
    """Make ``engine.step()`` clip at ``max_norm`` (the config's gradient_clipping)."""
    _require(engine, "_config", "engine config").gradient_clipping = max_norm
    if hasattr(engine.optimizer, "clip_grad"):  # ZeRO optimizers copy the value at init
        engine.optimizer.clip_grad = max_norm


def can_coalesce(engine: Any) -> bool:
    """The engine's optimizer supports ``coalesce_grad_reduction()`` (DeepSpeed's BF16/FP16
    optimizer wrappers do not: they raise NotImplementedError)."""
    return hasattr(engine, "coalesce_grad_reduction") and hasattr(
        engine.optimizer, "_coalesce_grad_reduction"
    )


def removed_key_message(ds: dict[str, Any]) -> str | None:
    """DeepSpeed's own message for a config key it has removed (``deepspeed.initialize``
    raises it), or None where the config has none or this DeepSpeed has no such check."""
    try:
        from deepspeed.runtime import config as ds_config
    except ImportError:  # pragma: no cover - the adapter checks the import first
        return None
    reject = getattr(ds_config, "_reject_removed_config_keys", None)
    error = getattr(ds_config, "DeepSpeedConfigError", None)
    if reject is None or error is None:
        return None
    try:
        reject(ds)
    except error as err:
        return str(err)
    return None


def full_gradient_bytes(engine: Any) -> int:
    """Bytes of the full gradients of the engine's parameters, as a coalesced window holds
    them on every rank until its flush (ZeRO 3 partitions a parameter: ``ds_numel`` is its
    full size)."""
    module = _require(engine, "module", "wrapped module")
    return sum(
        int(getattr(p, "ds_numel", p.numel())) * p.element_size()
        for p in module.parameters()
        if p.requires_grad
    )


def flat_fp32_masters(engine: Any) -> dict[int, torch.Tensor]:
    """Stage 0 with bf16/fp16 (DeepSpeed's FP16_[Unfused]Optimizer) keeps fp32 masters per
    group: flat (fp32_groups_flat) or one per parameter (fp32_groups); keyed by id(param)."""
    opt = engine.optimizer
    out: dict[int, torch.Tensor] = {}
    for group, flat in zip(getattr(opt, "fp16_groups", []), getattr(opt, "fp32_groups_flat", [])):
        offset = 0
        for p in group:
            out[id(p)] = flat.narrow(0, offset, p.numel()).view_as(p)
            offset += p.numel()
    for group, masters in zip(getattr(opt, "fp16_groups", []), getattr(opt, "fp32_groups", [])):
        out.update({id(p): m for p, m in zip(group, masters)})
    return out


def clear_window_gradients(engine: Any) -> None:
    """Drop every gradient accumulated since the last step, as an overflowed step does, but
    without stepping: the parameters' gradients, ZeRO's reduced (averaged) partitions and
    its micro-step counter, and the fp32 gradients of the mixed-precision wrappers."""
    opt = engine.optimizer
    _require(opt, "zero_grad", "optimizer zero_grad")(set_to_none=True)
    if hasattr(opt, "clear_hp_grads"):  # BF16_Optimizer: fp32 gradient accumulators
        opt.clear_hp_grads()
    averaged = getattr(opt, "averaged_gradients", None)
    if isinstance(averaged, dict):  # ZeRO 1/2 (keyed by group, value None = empty) and 3
        for key in list(averaged):
            averaged[key] = None
        if hasattr(opt, "all_grad_tensors"):
            for key in list(opt.all_grad_tensors):
                opt.all_grad_tensors[key] = None
        else:
            averaged.clear()
    if hasattr(opt, "_release_preflattened_grad_buffers"):
        opt._release_preflattened_grad_buffers()
    if hasattr(opt, "micro_step_id") and hasattr(opt, "all_grad_tensors"):
        opt.micro_step_id = -1  # ZeRO 1/2's INITIAL_MICRO_STEP_ID, as step() leaves it
    module = _require(engine, "module", "wrapped module")
    for p in module.parameters():
        p.grad = None


#: The globals DeepSpeed's own checkpoint files name besides torch's ``weights_only`` set,
#: read from checkpoints of every ZeRO stage (0-3), fp32 and bf16, with and without an LR
#: scheduler, saved by DeepSpeed 0.19.8 (the bf16 and ZeRO optimizer states hold them).
CHECKPOINT_GLOBALS = frozenset(
    {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)


class _CheckedLoads:
    """Stands in for the engine's checkpoint engine while it loads: every file is checked
    (``checked(path)`` raises on a refused global) before the real engine reads it."""

    def __init__(self, inner: Any, checked: Callable[[str], None]) -> None:
        self._inner = inner
        self._checked = checked

    def load(self, path: str, map_location: Any = None) -> Any:
        self._checked(path)
        return self._inner.load(path, map_location=map_location)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def checked_loads(engine: Any, checked: Callable[[str], None]) -> Iterator[None]:
    """Inside: every file the engine's checkpoint engine loads passes ``checked`` first."""
    inner = _require(engine, "checkpoint_engine", "checkpoint engine")
    engine.checkpoint_engine = _CheckedLoads(inner, checked)
    try:
        yield
    finally:
        engine.checkpoint_engine = inner


class _DeferredWrites:
    """Stands in for the engine's checkpoint engine while it saves: a file write that fails
    is recorded in ``failed`` instead of raised, and later writes are skipped, so that this
    rank still runs every collective ``save_checkpoint`` runs (its barriers, ZeRO's
    gathers) and no rank waits in one for a rank that left. DeepSpeed's own torch engine
    writes through ``save_file`` (whose error names the file and the OS error)."""

    def __init__(
        self, inner: Any, failed: list[BaseException], save_file: Callable[..., None]
    ) -> None:
        self._inner = inner
        self._failed = failed
        self._save_file = save_file if type(inner).__name__ == "TorchCheckpointEngine" else None

    def save(self, state_dict: Any, path: str) -> None:
        if self._failed:
            return
        try:
            if self._save_file is not None:
                zipfile = bool(getattr(self._inner, "zipfile_serialization", True))
                self._save_file(state_dict, path, _use_new_zipfile_serialization=zipfile)
            else:
                self._inner.save(state_dict, path)
        except Exception as err:
            self._failed.append(err)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        try:
            self._inner.makedirs(path, exist_ok=exist_ok)
        except OSError as err:
            self._failed.append(err)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def deferred_write_errors(
    engine: Any, save_file: Callable[..., None]
) -> Iterator[list[BaseException]]:
    """Inside: what ``engine.save_checkpoint`` fails to write (its checkpoint engine's files
    and folders, rank 0's recovery scripts) is recorded in the yielded list, not raised;
    the caller raises it after ``save_checkpoint`` returned on every rank."""
    failed: list[BaseException] = []
    inner = _require(engine, "checkpoint_engine", "checkpoint engine")
    copy_scripts = _require(engine, "_copy_recovery_script", "recovery-script copy")

    def recorded_copy(save_path: str) -> None:
        try:
            copy_scripts(save_path)
        except OSError as err:
            failed.append(err)

    engine.checkpoint_engine = _DeferredWrites(inner, failed, save_file)
    engine._copy_recovery_script = recorded_copy
    try:
        yield failed
    finally:
        engine.checkpoint_engine = inner
        del engine._copy_recovery_script  # the class's method again
