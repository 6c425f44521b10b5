"""Compressed gradient sync: one setting on every backend (read by each adapter as
``config.comm_hook`` and mapped onto its own mechanism: DDP's communication hooks, FSDP2's
reduce dtype, DeepSpeed's ``communication_data_type``). No torch here.

``comm_hook`` takes Accelerate's values; ``comm_wrapper`` casts what PowerSGD sends to a
half-precision dtype; ``comm_state_option`` holds PowerSGD's own options. Each is checked
here for what the value alone says (a name, a key, a wrapper without PowerSGD); what a
backend cannot run is refused by its adapter at setup, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gradsync._support.declaration import setting
from gradsync._support.util import did_you_mean
from gradsync.errors import ConfigError

__all__ = [
    "COMM_HOOKS",
    "COMM_WRAPPERS",
    "POWER_SGD",
    "POWER_SGD_OPTIONS",
    "CommHook",
    "CommWrapper",
    "CompressionSettings",
]

#: A gradient-compression hook: "no", "fp16" / "bf16" (the gradients sent in that dtype),
#: "power_sgd" / "batched_power_sgd" (a low-rank approximation with error feedback).
CommHook = Literal["no", "fp16", "bf16", "power_sgd", "batched_power_sgd"]
COMM_HOOKS: tuple[CommHook, ...] = ("no", "fp16", "bf16", "power_sgd", "batched_power_sgd")
#: What PowerSGD's matrices are sent as: "no" (the gradients' dtype), "fp16" or "bf16".
CommWrapper = Literal["no", "fp16", "bf16"]
COMM_WRAPPERS: tuple[CommWrapper, ...] = ("no", "fp16", "bf16")
#: The hooks that keep state between optimizer steps (error feedback, warm-start matrices).
POWER_SGD = frozenset({"power_sgd", "batched_power_sgd"})
#: PowerSGD's options (the keywords of torch's ``PowerSGDState`` but its process group).
POWER_SGD_OPTIONS = (
    "matrix_approximation_rank",
    "start_powerSGD_iter",
    "min_compression_rate",
    "use_error_feedback",
    "warm_start",
    "orthogonalization_epsilon",
    "random_seed",
    "compression_stats_logging_frequency",
    "batch_tensors_with_same_shape",
)


def _normal(value: Any) -> Any:
    """An enum member (Accelerate's ``DDPCommunicationHookType``) as its value, text lowered."""
    value = getattr(value, "value", value)
    return value.strip().lower() if isinstance(value, str) else value


def _check_hook(name: str, value: Any, config: Any) -> str:
    hook = _normal(value)
    if hook not in COMM_HOOKS:
        raise ConfigError(
            f"{name}={value!r} is unknown{did_you_mean(str(hook), COMM_HOOKS)}; use one of "
            f"{', '.join(COMM_HOOKS)}"
        )
    return str(hook)


def _check_wrapper(name: str, value: Any, config: Any) -> str:
    wrapper = _normal(value)
    if wrapper not in COMM_WRAPPERS:
        raise ConfigError(
            f"{name}={value!r} is unknown{did_you_mean(str(wrapper), COMM_WRAPPERS)}; use one "
            f"of {', '.join(COMM_WRAPPERS)}"
        )
    if wrapper != "no" and config.comm_hook not in POWER_SGD:
        raise ConfigError(
            f"{name}={wrapper!r} casts what PowerSGD sends, and comm_hook="
            f"{config.comm_hook!r} is no PowerSGD hook; use comm_hook='power_sgd' (or "
            f"'batched_power_sgd'), or comm_hook={wrapper!r} alone, or drop comm_wrapper"
        )
    return str(wrapper)


def _check_state_option(name: str, value: Any, config: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(
            f"{name}={value!r} must be a dict of PowerSGD options, e.g. "
            "{'matrix_approximation_rank': 2, 'start_powerSGD_iter': 10}"
        )
    for key in value:
        if key not in POWER_SGD_OPTIONS:
            raise ConfigError(
                f"{name}: {key!r} is no PowerSGD option{did_you_mean(str(key), POWER_SGD_OPTIONS)}; "
                f"use some of {', '.join(POWER_SGD_OPTIONS)}"
            )
    if value and config.comm_hook not in POWER_SGD:
        raise ConfigError(
            f"{name}={value!r} sets PowerSGD's options, and comm_hook={config.comm_hook!r} is "
            "no PowerSGD hook; use comm_hook='power_sgd', or drop comm_state_option"
        )
    return dict(value)


@dataclass
class CompressionSettings:
    """What one gradient synchronisation sends: core settings (every backend maps them onto
    its own mechanism or refuses them in one line)."""

    comm_hook: CommHook = field(
        default="no",
        metadata=setting(
            "compress the gradient sync: no, fp16 or bf16 (sent in that dtype: ddp hook, fsdp "
            "reduce dtype, deepspeed communication_data_type), power_sgd or batched_power_sgd "
            "(ddp only); runs at the boundary only under defer",
            flag=True,
            check=_check_hook,
            metavar="HOOK",
        ),
    )
    comm_wrapper: CommWrapper = field(
        default="no",
        metadata=setting(
            "with a PowerSGD comm_hook: send its matrices as fp16 or bf16 (no: as the gradients)",
            flag=True,
            check=_check_wrapper,
            metavar="DTYPE",
        ),
    )
    comm_state_option: dict[str, Any] | None = field(
        default=None,
        metadata=setting(
            "PowerSGD's options: matrix_approximation_rank, start_powerSGD_iter, "
            "min_compression_rate, use_error_feedback, warm_start, ... (torch's PowerSGDState; "
            "from text: a JSON object)",
            flag=True,
            check=_check_state_option,
            metavar="JSON",
        ),
    )
