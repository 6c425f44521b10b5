"""``accelerate.utils``, spelled ``gradsync.accelerate.utils``: the names Accelerate scripts
import from it, with Accelerate's meaning (the refused ones say what to use)."""

from __future__ import annotations

import contextlib
import enum
import functools
import gc
import importlib.util
import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gradsync._support import dist
from gradsync.accelerate._names import refuse
from gradsync.accelerate.config import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProjectConfiguration,
)
from gradsync.backends.kinds import DistributedType
from gradsync.data.batches import tree_map
from gradsync.metrics import gather, gather_object, pad_across_processes, reduce
from gradsync.seeding import set_seed

__all__ = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "LoggerType",
    "PrecisionType",
    "ProjectConfiguration",
    "broadcast",
    "broadcast_object_list",
    "check_os_kernel",
    "extract_model_from_parallel",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "is_deepspeed_available",
    "is_mlflow_available",
    "is_tensorboard_available",
    "is_wandb_available",
    "pad_across_processes",
    "patch_environment",
    "reduce",
    "release_memory",
    "send_to_device",
    "set_seed",
    "tqdm",
    "wait_for_everyone",
]


class LoggerType(str, enum.Enum):
    """Tracker names for ``log_with``."""

    ALL = "all"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    MLFLOW = "mlflow"

    def __str__(self) -> str:
        return self.value


class PrecisionType(str, enum.Enum):
    """Values of ``mixed_precision``."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"

    def __str__(self) -> str:
        return self.value


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def is_tensorboard_available() -> bool:
    return _available("tensorboard") or _available("tensorboardX")


def is_wandb_available() -> bool:
    return _available("wandb")


def is_mlflow_available() -> bool:
    return _available("mlflow")


def is_deepspeed_available() -> bool:
    return _available("deepspeed")


def wait_for_everyone() -> None:
    """A barrier over every process (nothing in one process)."""
    dist.barrier()


def send_to_device(
    tensor: Any,
    device: torch.device | str,
    non_blocking: bool = False,
    skip_keys: list[str] | str | None = None,
) -> Any:
    """Every tensor of a nested structure on ``device``."""
    skip = [skip_keys] if isinstance(skip_keys, str) else list(skip_keys or [])
    if isinstance(tensor, dict) and skip:
        return type(tensor)(
            {
                k: v if k in skip else send_to_device(v, device, non_blocking)
                for k, v in tensor.items()
            }
        )
    return tree_map(
        lambda t: t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t,
        tensor,
    )


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Every tensor of a nested structure, as ``from_process`` has it, on every process."""
    if not dist.is_multiprocess():
        return tensor
    import torch.distributed

    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            torch.distributed.broadcast(t, src=from_process)
        return t

    return tree_map(one, tensor)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """``object_list`` as ``from_process`` has it, on every process (in place)."""
    if dist.is_multiprocess():
        import torch.distributed

        torch.distributed.broadcast_object_list(object_list, src=from_process)
    return object_list


def extract_model_from_parallel(
    model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
) -> Any:
    """The model inside DDP, a DeepSpeed engine or ``torch.compile``."""
    while True:
        if not keep_torch_compile and hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            return model


def release_memory(*objects: Any) -> list[None]:
    """Drop the references given, collect garbage and empty the device cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [None for _ in objects]


def check_os_kernel() -> None:
    """Nothing to check."""


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set environment variables (upper-cased names) for the block, then restore them."""
    saved = {key.upper(): os.environ.get(key.upper()) for key in kwargs}
    os.environ.update({key.upper(): str(value) for key, value in kwargs.items()})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        s in text
        for s in (
            "out of memory",
            "DefaultCPUAllocator: can't allocate memory",
            "CUDNN_STATUS_NOT_SUPPORTED",
        )
    )


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Any:
    """A decorator: call ``function(batch_size, *args, **kwargs)`` from ``starting_batch_size``
    on, lowering ``batch_size`` after an out-of-memory error (to 90 %, or to what
    ``reduce_batch_size_fn()`` returns) until it runs; a later call starts from the size
    that ran. On several processes the ranks agree on each attempt (a rank out of memory
    makes every rank retry), so no rank trains at a size the others gave up."""
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    first = next(iter(inspect.signature(function).parameters), None)
    if first != "batch_size":
        raise TypeError(
            f"find_executable_batch_size: {function.__name__}'s first argument must "
            f"be batch_size (it is {first!r}); the decorator passes it"
        )
    size = starting_batch_size

    def lower() -> int:
        return reduce_batch_size_fn() if reduce_batch_size_fn is not None else int(size * 0.9)

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal size
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        while True:
            if size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            failed = False
            result: Any = None
            try:
                result = function(size, *args, **kwargs)
            except Exception as error:
                if not _out_of_memory(error):
                    raise
                failed = True
            if dist.is_multiprocess():
                failed = dist.any_rank(failed, device)
            if not failed:
                return result
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            size = lower()

    return run


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm``, shown on the local main process only (``main_process_only``)."""
    try:
        from tqdm.auto import tqdm as bar
    except ImportError:
        raise ImportError("gradsync.accelerate.utils.tqdm needs tqdm: pip install tqdm") from None
    if main_process_only:
        kwargs["disable"] = kwargs.get("disable", False) or dist.rank_info()[2] != 0
    return bar(*args, **kwargs)


def __getattr__(name: str) -> Any:
    refuse("accelerate.utils", name)
    raise AttributeError(f"module 'gradsync.accelerate.utils' has no attribute {name!r}")
