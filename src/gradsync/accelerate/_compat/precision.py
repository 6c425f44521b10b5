"""``mixed_precision`` and ``dynamo_config``: gradsync's ``mixed_precision`` and ``compile``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradsync.accelerate._compat.keys import (
    Key,
    Source,
    Translation,
    apply,
    boolean,
    leftovers,
    word,
)
from gradsync.errors import ConfigError

DYNAMO = "dynamo_config"
#: Each dynamo_config key: where it goes in torch.compile's arguments (gradsync's ``compile``).
DYNAMO_KEYS: tuple[Key, ...] = (
    Key("dynamo_backend", word(upper=False), to=("backend",)),
    Key("dynamo_mode", lambda value, item: str(value), quiet=(None, "default"), to=("mode",)),
    Key("dynamo_use_fullgraph", boolean, quiet=(False,), to=("fullgraph",)),
    Key("dynamo_use_dynamic", boolean, quiet=(False,), to=("dynamic",)),
    Key(
        "dynamo_use_regional_compilation",
        boolean,
        quiet=(None, False),
        ignored="gradsync compiles the whole model (on FSDP each sharded block)",
    ),
)


def mixed_precision(data: Mapping[str, Any], src: Source, out: Translation) -> None:
    """``mixed_precision`` (no, bf16 or fp16) into gradsync's setting.

    Args:
        data: the file's mapping (``fp16: true`` already read as ``mixed_precision: fp16``).
        src: names the keys in messages.
        out: receives the setting.

    Raises:
        ConfigError: fp8, or another unknown value.
    """
    value = data.get("mixed_precision")
    if value is None:
        return
    item = src.item(None, "mixed_precision", value)
    text = str(value).strip().lower()
    if text == "fp8":
        raise ConfigError(f"{item}: gradsync has no fp8 training; use bf16 (or fp16)")
    if text not in ("no", "bf16", "fp16"):
        raise ConfigError(f"{item} is unknown; use no, bf16 or fp16")
    if text != "no":  # "no" is gradsync's default: nothing to set
        out.set("mixed_precision", text, item)


def dynamo(keys: Mapping[str, Any], src: Source, out: Translation) -> None:
    """The dynamo_config keys into gradsync's ``compile`` (torch.compile's arguments).

    Args:
        keys: the section (its keys' ``dynamo_`` prefix restored).
        src: names the keys in messages.
        out: receives the setting and notes.

    Raises:
        ConfigError: a switch that is not true or false.
    """
    backend = keys.get("dynamo_backend")
    if backend is None or str(backend).strip().lower() in ("no", "none", ""):
        return  # no torch.compile: the other keys do not count
    applied = apply(DYNAMO_KEYS, keys, DYNAMO, src, out)
    leftovers(DYNAMO_KEYS, keys, DYNAMO, src, out)
    out.set(
        "compile",
        {path[0]: value for path, (value, _) in applied.paths.items()},
        src.item(DYNAMO, "dynamo_backend", backend),
    )
