"""Seeding every random-number generator a training script draws from (``gradsync.set_seed``)."""

from __future__ import annotations

import os
import random

import torch

from gradsync._support import dist
from gradsync.errors import ConfigError

#: The largest seed NumPy's legacy generator takes.
MAX_SEED = 2**32 - 1


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's ``random``, NumPy (when installed) and torch (the CPU and every CUDA
    device), as Accelerate's ``set_seed`` does.

    Call it on every rank before building the model, so every rank starts from the same
    weights; ``device_specific=True`` gives each rank its own stream (e.g. for data
    augmentation) instead.

    Args:
        seed: an int from 0 to ``2**32 - 1``.
        device_specific: add this process's rank (``gradsync._support.dist.rank()``: the process
            group's rank, else the launcher's ``RANK``) to ``seed``, so each rank draws
            differently.
        deterministic: also ``torch.use_deterministic_algorithms(True)`` (an error from any
            operation that has no deterministic implementation), cuDNN's benchmark mode off
            and, when unset, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which deterministic cuBLAS
            needs; can slow training down.

    Raises:
        ConfigError: ``seed`` is not an int from 0 to ``2**32 - 1`` (after adding the rank).
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(
            f"set_seed(seed={seed!r}) needs an int from 0 to {MAX_SEED}, e.g. set_seed(42)"
        )
    if device_specific:
        rank = dist.rank()
        if not 0 <= seed + rank <= MAX_SEED:
            raise ConfigError(
                f"set_seed(seed={seed}, device_specific=True) on rank {rank} gives "
                f"{seed + rank}, outside 0..{MAX_SEED}; give a seed from 0 to "
                f"{MAX_SEED - rank}"
            )
        seed += rank
    elif not 0 <= seed <= MAX_SEED:
        raise ConfigError(
            f"set_seed(seed={seed}) is outside 0..{MAX_SEED} (NumPy's range); "
            "give a seed in it, e.g. set_seed(42)"
        )
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)  # the CPU and every device torch knows
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True)
