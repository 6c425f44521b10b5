"""What a backend makes of ``comm_hook`` (gradsync.options.compression): the refusal of a hook
it cannot run, in one line, and the dtype a half-precision hook sends. Each adapter calls
``supported`` at setup with what it can run; DDP's hooks themselves live in ``_ddp_comm``."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from gradsync.errors import ConfigError

if TYPE_CHECKING:
    from gradsync.config import Config

log = logging.getLogger("gradsync")

#: The dtype each half-precision hook sends the gradients in.
HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


def supported(config: Config, backend: str, hooks: tuple[str, ...], how: str) -> str:
    """``config.comm_hook`` when ``backend`` runs it (``hooks``; ``how``: its mechanism, for
    the message), else a one-line ConfigError naming the backend and what it supports.

    Returns:
        The hook ("no" included).
    """
    hook = config.comm_hook
    if hook == "no" or hook in hooks:
        return hook
    if not hooks:
        raise ConfigError(
            f"comm_hook={hook!r}: backend={backend!r} has no compressed gradient sync ({how}); "
            "drop comm_hook, or use backend='ddp' (every hook), 'fsdp' or 'deepspeed' (fp16, bf16)"
        )
    raise ConfigError(
        f"comm_hook={hook!r} cannot run on backend={backend!r}, which compresses with "
        f"comm_hook {' or '.join(repr(h) for h in hooks)} ({how}); use one of those, or "
        "backend='ddp' for PowerSGD"
    )


def half_dtype(hook: str, device: torch.device) -> torch.dtype | None:
    """The dtype ``hook`` sends the gradients in (None: not a half-precision hook); a
    one-line ConfigError for bf16 on a device without bf16 collectives."""
    dtype = HALF.get(hook)
    if dtype is torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"comm_hook='bf16': the GPU ({torch.cuda.get_device_name(device)}) has no bf16 "
            "collectives; use comm_hook='fp16'"
        )
    return dtype


def nothing_to_send(config: Config) -> None:
    """One process: a hook has no gradient sync to compress; said once, not refused."""
    if config.comm_hook != "no":
        log.warning(
            "gradsync: comm_hook=%r does nothing in one process (no gradient is sent)",
            config.comm_hook,
        )
