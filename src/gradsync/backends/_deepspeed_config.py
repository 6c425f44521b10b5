"""DeepSpeed config handling: read it (dict, JSON/YAML path, JSON text), fill its batch keys
from gradsync's plan and its precision section from ``mixed_precision``, refusing
contradictions. Used by the deepspeed adapter."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gradsync.errors import ConfigError

_BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def load_ds_config(value: Any) -> dict[str, Any]:
    """A DeepSpeed config from a dict, a JSON/YAML file path, or JSON text (a copy)."""
    if value is None:
        return {}
    if isinstance(value, dict):
        copy: dict[str, Any] = json.loads(json.dumps(value))
        return copy
    if not isinstance(value, str | os.PathLike):
        raise ConfigError(f"deepspeed_config={value!r} must be a dict, a JSON/YAML path or JSON text")
    text = str(value)
    path = Path(text)
    if not text.lstrip().startswith("{") and path.is_file():
        raw = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(raw)
        else:
            data = json.loads(raw)
    else:
        try:
            data = json.loads(text)
        except ValueError:
            raise ConfigError(
                f"deepspeed_config={text!r} is neither an existing file nor JSON text; "
                "pass a dict, the path of a .json/.yaml file, or a JSON string"
            ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"deepspeed_config {text!r} must hold a mapping, not {type(data).__name__}")
    return data


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
    ours = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": steps,
        "train_batch_size": micro * steps * world,
    }
    where = f"micro_batch_size={micro} x gradient_accumulation_steps={steps} x world_size={world}"
    for key in _BATCH_KEYS:
        value = ds.get(key)
        if _is_auto(value):
            ds[key] = ours[key]
        elif value != ours[key]:
            raise ConfigError(
                f"deepspeed_config {key}={value!r} contradicts gradsync's {key}={ours[key]} "
                f"({where}); set it to \"auto\" or remove it so gradsync fills it, or change "
                "the Accelerator's batch settings to agree"
            )
    return ds


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and section.get("enabled", False) not in (False, "false", "auto")


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
