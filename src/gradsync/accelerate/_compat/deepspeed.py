"""``deepspeed_config``: Accelerate's DeepSpeed plugin keys, put where Accelerate puts them
in the DeepSpeed config (``zero_stage`` is ``zero_optimization.stage`` ...).

The config they go into is ``deepspeed_config_file`` when given (a value there that
contradicts a key is a ConfigError), else the DeepSpeed config given elsewhere (the keys win),
else a new one with Accelerate's default ZeRO stage 2. Without keys to put, the file (or the
config given elsewhere) is gradsync's ``deepspeed_config`` as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gradsync.accelerate._compat.keys import (
    Key,
    KeyPath,
    Source,
    Translation,
    When,
    apply,
    boolean,
    given,
    leftovers,
    whole,
    whole_number,
    word,
)
from gradsync.compat.files import load_deepspeed_config
from gradsync.errors import ConfigError

SECTION = "deepspeed_config"
LAUNCHER = (
    "gradsync launch starts the processes of one node with torchrun: run it once per "
    "node (e.g. srun --ntasks-per-node=1 gradsync launch ...)"
)
_STAGE: KeyPath = ("zero_optimization", "stage")


def _text(value: Any, item: str) -> str | None:
    """Text; "" and "none" are None (not set)."""
    text = str(value)
    return None if text.strip().lower() in ("", "none") else text


def _clipping(value: Any, item: str) -> float | None:
    """A clipping norm >= 0 (0: none); "auto" and "none" are None (DeepSpeed's default)."""
    if str(value).strip().lower() in ("auto", "none"):
        return None
    try:
        norm = float(value)
    except (TypeError, ValueError):
        norm = -1.0
    if not norm >= 0:
        raise ConfigError(f"{item} must be a number >= 0 (0: no clipping)")
    return norm


def _steps(value: Any, item: str) -> int | None:
    """Accumulation steps >= 1; "auto" is None (gradsync's plan decides)."""
    return None if str(value).strip().lower() == "auto" else whole(value, item, 1)


def _offload(kind: str) -> tuple[Key, Key]:
    """The device and NVMe path of the ``kind`` offload (optimizer or param)."""
    device = f"offload_{kind}_device"
    return (
        Key(
            device,
            word("none", "cpu", "nvme", upper=False),
            quiet=(None, "none"),
            to=("zero_optimization", f"offload_{kind}", "device"),
        ),
        Key(
            f"offload_{kind}_nvme_path",
            _text,
            to=("zero_optimization", f"offload_{kind}", "nvme_path"),
            when=When(device, ("nvme",), said=False),
        ),
    )


#: Each deepspeed_config key: how it is read, what is quiet, ignored (and why) or where it goes
#: (a path in the DeepSpeed config, or a gradsync setting).
KEYS: tuple[Key, ...] = (
    Key("deepspeed_config_file", _text),  # the config the others go into: translate()
    Key("zero_stage", whole_number(0, 3), to=_STAGE),
    *_offload("optimizer"),
    *_offload("param"),
    Key("gradient_clipping", _clipping, to=("gradient_clipping",)),
    Key(
        "zero3_save_16bit_model",
        boolean,
        quiet=(None, False),
        to=("zero_optimization", "stage3_gather_16bit_weights_on_model_save"),
    ),
    # 1: what `accelerate config` writes unless asked, and gradsync's default
    Key("gradient_accumulation_steps", _steps, quiet=(None, 1), to="gradient_accumulation_steps"),
    Key(
        "zero3_init_flag",
        boolean,
        quiet=(None, False),
        ignored="gradsync does not build the model; build it under deepspeed.zero.Init() "
        "yourself to create it sharded",
    ),
    Key(
        "deepspeed_multinode_launcher",
        word(upper=False),
        quiet=(None, "standard"),
        ignored=LAUNCHER,
    ),
    Key("deepspeed_hostfile", given, ignored=LAUNCHER),
    Key("deepspeed_exclusion_filter", given, ignored=LAUNCHER),
    Key("deepspeed_inclusion_filter", given, ignored=LAUNCHER),
    Key(
        "deepspeed_moe_layer_cls_names",
        given,
        ignored="set DeepSpeed's leaf modules yourself (deepspeed.utils.set_z3_leaf_modules)",
    ),
)


def value_at(ds: Mapping[str, Any], path: KeyPath) -> Any:
    """The value at ``path`` in a DeepSpeed config, or None.

    Args:
        ds: the config.
        path: the keys, outermost first.

    Returns:
        The value (None where the path is absent).
    """
    node: Any = ds
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _put(ds: dict[str, Any], path: KeyPath, value: Any) -> None:
    node = ds
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[path[-1]] = value


def translate(
    keys: Mapping[str, Any], src: Source, out: Translation, base: Any, base_label: str
) -> None:
    """The deepspeed_config keys into ``out``: gradsync's ``deepspeed_config`` (and
    ``gradient_accumulation_steps``), and a note for each key ignored.

    Args:
        keys: the section.
        src: names the keys in messages.
        out: receives the settings and notes.
        base: the DeepSpeed config given elsewhere (a dict, a path or JSON text), or None.
        base_label: names ``base`` in messages.

    Raises:
        ConfigError: a bad value, a bad DeepSpeed config file, or a key that contradicts the
            file.
    """
    applied = apply(KEYS, keys, SECTION, src, out)
    leftovers(KEYS, keys, SECTION, src, out)
    wanted = applied.paths
    file = applied.values.get("deepspeed_config_file")
    if file is not None:
        label = src.item(SECTION, "deepspeed_config_file", keys["deepspeed_config_file"])
        ds: dict[str, Any] | None = load_deepspeed_config(file, label)
        origin, strict = label, True
        as_given: Any = str(Path(str(file)).expanduser().resolve())
    elif base is not None:
        label = base_label or SECTION
        ds, origin, strict, as_given = load_deepspeed_config(base, label), label, False, base
    else:
        ds, origin, strict, as_given = None, "", True, None
        if _STAGE not in wanted:
            wanted[_STAGE] = (2, "Accelerate's default ZeRO stage")
    if not wanted:
        out.set("deepspeed_config", as_given, origin)
        return
    merged = ds if ds is not None else {}
    for path, (value, said) in wanted.items():
        current = value_at(merged, path)
        if strict and current not in (None, "auto") and current != value:
            raise ConfigError(
                f"{said} contradicts {'.'.join(path)}={current!r} in {origin}; drop one of them"
            )
        _put(merged, path, value)
    out.set(
        "deepspeed_config",
        merged,
        ", ".join(said for _, said in wanted.values()) + (f" into {origin}" if origin else ""),
    )
