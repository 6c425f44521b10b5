"""DeepSpeed config handling: read it (``gradsync.compat.files``: a dict, a JSON/YAML path or
JSON text), fill its batch keys
from gradsync's plan (refusing contradictions), its precision section from ``mixed_precision``,
and complete it for ``deepspeed.initialize``. Used by the deepspeed adapter."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gradsync._plan.batch_plan import solve_with_schedule
from gradsync.backends import _deepspeed_compat
from gradsync.compat.files import load_deepspeed_config as load_ds_config
from gradsync.errors import ConfigError

if TYPE_CHECKING:
    from gradsync._plan.batch_plan import BatchPlan
    from gradsync.config import Config

__all__ = [
    "MICS_KEYS",
    "build_config",
    "check_batch",
    "check_hpz",
    "check_precision",
    "check_removed_keys",
    "check_setup_batch",
    "fill_batch",
    "fill_communication",
    "fill_precision",
    "load_ds_config",
]


def _is_auto(value: Any) -> bool:
    return value is None or value == "auto"


def fill_batch(ds: dict[str, Any], *, micro: int | None, steps: int, world: int) -> dict[str, Any]:
    """Fill the three batch keys from gradsync's plan where absent or "auto"; a contradicting
    value is a ConfigError naming both values."""
    if micro is None:
        given = ds.get("train_micro_batch_size_per_gpu")
        hint = f" (the DeepSpeed config says {given})" if not _is_auto(given) else ""
        raise ConfigError(
            "backend='deepspeed' needs the micro batch size when the model is prepared, and "
            f"gradsync does not know it yet{hint}; pass the DataLoader in the same "
            "accel.prepare(model, optimizer, loader) call, or set Accelerator(micro_batch_size=...)"
        )
    ds = check_batch(ds, micro=micro, steps=steps, world=world)
    ds.update(
        {key: value for key, value in _ours(micro, steps, world).items() if _is_auto(ds.get(key))}
    )
    return ds


def _ours(micro: int | None, steps: int, world: int) -> dict[str, int]:
    """The batch keys gradsync's plan fixes (the micro batch size may be unknown yet)."""
    ours = {"gradient_accumulation_steps": steps}
    if micro is not None:
        ours.update(train_micro_batch_size_per_gpu=micro, train_batch_size=micro * steps * world)
    return ours


def check_batch(ds: dict[str, Any], *, micro: int | None, steps: int, world: int) -> dict[str, Any]:
    """Refuse a batch key of the DeepSpeed config that contradicts gradsync's plan (those the
    plan knows: the accumulation steps always, the batch sizes once the micro batch is known);
    "auto" or absent keys are fine. Returns ``ds`` unchanged."""
    where = (
        f"micro_batch_size={'?' if micro is None else micro} x gradient_accumulation_steps="
        f"{steps} x world_size={world}"
    )
    for key, mine in _ours(micro, steps, world).items():
        value = ds.get(key)
        if not _is_auto(value) and value != mine:
            raise ConfigError(
                f"deepspeed_config {key}={value!r} contradicts gradsync's {key}={mine} "
                f'({where}); set it to "auto" or remove it so gradsync fills it, or change '
                "the Accelerator's batch settings to agree"
            )
    return ds


#: The ``zero_optimization`` keys of MiCS, which DeepSpeed removed: sharding inside a node and
#: replicating across nodes is what gradsync's FSDP2 2-D mesh does.
MICS_KEYS = ("mics_shard_size", "mics_hierarchical_params_gather")


def check_removed_keys(ds: dict[str, Any]) -> None:
    """Refuse, before any collective, a key DeepSpeed removed and would refuse in
    ``deepspeed.initialize``: its own message, and for MiCS's keys gradsync's way instead."""
    message = _deepspeed_compat.removed_key_message(ds)
    if message is None:
        return
    zero = ds.get("zero_optimization")
    mics = [key for key in MICS_KEYS if isinstance(zero, dict) and key in zero]
    if not mics:
        raise ConfigError(f"deepspeed_config: {message}")
    assert isinstance(zero, dict)
    raise ConfigError(
        f"deepspeed_config zero_optimization.{mics[0]}={zero[mics[0]]!r}: {message.strip()} "
        "In gradsync, shard inside a node and replicate across nodes with backend='fsdp', "
        "fsdp_mesh=(R, S) (R nodes x S processes per node, or fsdp_mesh='node'); or drop "
        "the key and stay on ZeRO 3 (zero_hpz_partition_size keeps its parameter gathers "
        "inside a node)"
    )


def check_hpz(ds: dict[str, Any], stage: int, world: int) -> None:
    """ZeRO 3's ``zero_hpz_partition_size`` (ZeRO++ hpZ) must divide the world size:
    DeepSpeed builds its secondary partition groups from consecutive ranks (and asserts
    only after it has started creating them)."""
    zero = ds.get("zero_optimization")
    hpz = zero.get("zero_hpz_partition_size", 1) if isinstance(zero, dict) else 1
    if stage != 3 or not isinstance(hpz, int) or hpz <= 1 or hpz >= world or world % hpz == 0:
        return
    raise ConfigError(
        f"deepspeed_config zero_optimization.zero_hpz_partition_size={hpz} does not divide "
        f"world_size={world} (DeepSpeed's hpZ groups are {hpz} consecutive ranks); use a "
        f"divisor of {world}, usually the processes per node, or drop the key"
    )


def check_setup_batch(ds: dict[str, Any], config: Config, world: int) -> None:
    """Report a batch key that contradicts gradsync's settings at setup, not later at prepare
    (under a schedule, against the first window's k: gradsync drives DeepSpeed's boundary
    itself after that)."""
    plan, _ = solve_with_schedule(
        data_parallel_size=world,
        global_batch_size=config.global_batch_size,
        micro_batch_size=config.micro_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
    )
    check_batch(
        ds, micro=plan.micro_batch_size, steps=plan.gradient_accumulation_steps, world=world
    )


def build_config(
    base: dict[str, Any],
    *,
    given_optimizer: bool,
    plan: BatchPlan,
    world: int,
    mixed_precision: str,
    cpu: bool,
) -> dict[str, Any]:
    """The config ``deepspeed.initialize`` gets: the batch keys from the plan, clipping off
    unless asked, the mixed-precision section, and exactly one optimizer (a torch one given
    to prepare, or the config's section)."""
    ds = fill_batch(
        dict(base), micro=plan.micro_batch_size, steps=plan.gradient_accumulation_steps, world=world
    )
    # DeepSpeed clips at 1.0 by default; gradsync clips only when asked (clip_grad_norm_).
    ds.setdefault("gradient_clipping", 0.0)
    fill_precision(ds, mixed_precision)
    if not given_optimizer:
        if "optimizer" not in ds:
            raise ConfigError(
                "backend='deepspeed' got no optimizer: pass a torch optimizer to "
                "accel.prepare(model, optimizer), or give deepspeed_config an 'optimizer' section"
            )
        params = ds["optimizer"].setdefault("params", {})
        if cpu and str(ds["optimizer"].get("type", "")).lower() in ("adam", "adamw"):
            params.setdefault("torch_adam", True)  # FusedAdam would JIT-build a C++ op
    else:
        if "optimizer" in ds:
            raise ConfigError(
                "prepare() got a torch optimizer and deepspeed_config has an 'optimizer' "
                "section; use one of them (remove the section, or do not pass the optimizer)"
            )
        ds.setdefault("zero_allow_untested_optimizer", True)
    return ds


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and section.get("enabled", False) not in (
        False,
        "false",
        "auto",
    )


def fill_precision(ds: dict[str, Any], mixed_precision: str) -> dict[str, Any]:
    """Enable the config's ``fp16`` or ``bf16`` section for ``mixed_precision``; a config that
    disables it or enables the other one is a ConfigError naming both values."""
    if mixed_precision not in ("bf16", "fp16"):
        return ds
    other = "fp16" if mixed_precision == "bf16" else "bf16"
    if _enabled(ds.get(other)):
        raise ConfigError(
            f"mixed_precision={mixed_precision!r} contradicts deepspeed_config "
            f"{other}.enabled=true; set one of them (drop the {other} section, or use "
            f"mixed_precision={other!r})"
        )
    section = ds.setdefault(mixed_precision, {})
    if section.get("enabled", True) in (False, "false"):
        raise ConfigError(
            f"mixed_precision={mixed_precision!r} contradicts deepspeed_config "
            f"{mixed_precision}.enabled=false; enable it or drop mixed_precision"
        )
    section["enabled"] = True
    return ds


def fill_communication(ds: dict[str, Any], comm_hook: str) -> dict[str, Any]:
    """``communication_data_type`` from ``comm_hook`` ("fp16" or "bf16": DeepSpeed's gradient
    reductions sent in that dtype) where the config leaves it absent or "auto"; a config
    value that contradicts it is a ConfigError naming both, never overridden."""
    if comm_hook not in ("fp16", "bf16"):
        return ds
    given = ds.get("communication_data_type")
    if _is_auto(given):
        return {**ds, "communication_data_type": comm_hook}
    if str(given).lower() != comm_hook:
        raise ConfigError(
            f"comm_hook={comm_hook!r} contradicts deepspeed_config communication_data_type="
            f"{given!r}; set one of them (drop communication_data_type, or comm_hook="
            f"{str(given).lower()!r} or 'no')"
        )
    return ds


def check_precision(mixed_precision: str) -> str:
    """``mixed_precision``, or a one-line ConfigError when DeepSpeed's accelerator on this
    machine cannot run fp16 (its CPU accelerator, without fp16 support in oneDNN)."""
    if mixed_precision == "fp16":
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        if not get_accelerator().is_fp16_supported():
            raise ConfigError(
                f"mixed_precision='fp16': DeepSpeed {deepspeed.__version__}'s "
                f"{get_accelerator().device_name()!r} accelerator does not support fp16 on "
                "this machine; use mixed_precision='bf16' or 'no'"
            )
    return mixed_precision
