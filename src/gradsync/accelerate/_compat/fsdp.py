"""``fsdp_config``: Accelerate's FSDP plugin in terms of gradsync's FSDP2 backend.

gradsync shards with ``fully_shard`` over all ranks and wraps by class, so most keys either
ask for what it does anyway (quiet) or for something it does not do (one note); the wrapped
classes become ``fsdp_wrap`` (and, with activation checkpointing, ``activation_checkpointing``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradsync._support.declaration import FALSE, TRUE
from gradsync.accelerate._compat.keys import (
    Key,
    Source,
    Translation,
    When,
    apply,
    boolean,
    class_names,
    leftovers,
    whole_number,
    word,
)
from gradsync.errors import ConfigError

SECTION = "fsdp_config"
_STRATEGIES = {
    "1": "FULL_SHARD",
    "2": "SHARD_GRAD_OP",
    "3": "NO_SHARD",
    "4": "HYBRID_SHARD",
    "5": "HYBRID_SHARD_ZERO2",
}
_SHARD_ALL = (
    "gradsync's FSDP2 shards over all ranks; use FULL_SHARD, or distributed_type: "
    "MULTI_GPU for plain data parallelism"
)
_RESHARDS = "gradsync's FSDP2 reshards after forward (fully_shard's default)"
_TRANSFORMER = "TRANSFORMER_BASED_WRAP"


def _sharding(*, true_is_full: bool) -> Any:
    """A reader of a sharding strategy (its name or number); with ``true_is_full``, a boolean
    word too (``fsdp_reshard_after_forward``: true is FULL_SHARD); false is SHARD_GRAD_OP."""

    def read(value: Any, item: str) -> str:
        text = str(value).strip().upper()
        name = _STRATEGIES.get(text, text)
        if name in _STRATEGIES.values():
            return name
        if true_is_full and name.lower() in TRUE:
            return "FULL_SHARD"
        if name.lower() in FALSE:
            return "SHARD_GRAD_OP"
        raise ConfigError(f"{item} is unknown; use true or false (FULL_SHARD or SHARD_GRAD_OP)")

    return read


_NOT_ALL_RANKS = {name: _SHARD_ALL for name in ("NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")}

#: Each fsdp_config key: how it is read, what is quiet, refused, ignored (and why) or where
#: it goes. In this order: ``fsdp_transformer_layer_cls_to_wrap`` reads the policy before it.
KEYS: tuple[Key, ...] = (
    Key(
        "fsdp_version",
        whole_number(1, 2),
        quiet=(2,),
        refused={
            1: "gradsync runs FSDP2 (fully_shard), not FSDP1; set fsdp_version: 2 (the other "
            "fsdp_config keys keep their meaning)"
        },
    ),
    Key(
        "fsdp_reshard_after_forward",
        _sharding(true_is_full=True),
        quiet=("FULL_SHARD",),
        refused=_NOT_ALL_RANKS,
        ignored=_RESHARDS,
    ),
    Key(
        "fsdp_sharding_strategy",
        _sharding(true_is_full=False),
        quiet=("FULL_SHARD",),
        refused=_NOT_ALL_RANKS,
        ignored=_RESHARDS,
    ),
    Key(
        "fsdp_auto_wrap_policy",
        word(_TRANSFORMER, "SIZE_BASED_WRAP", "NO_WRAP"),
        quiet=(None, _TRANSFORMER, "NO_WRAP"),
        ignored="gradsync shards by class (the children of each ModuleList unless "
        "fsdp_transformer_layer_cls_to_wrap names them); name the blocks with "
        "TRANSFORMER_BASED_WRAP and fsdp_transformer_layer_cls_to_wrap",
    ),
    Key(
        "fsdp_transformer_layer_cls_to_wrap",
        class_names,
        to="fsdp_wrap",
        when=When("fsdp_auto_wrap_policy", (None, _TRANSFORMER)),
    ),
    # true: the wrapped classes are recomputed (_checkpointing)
    Key("fsdp_activation_checkpointing", boolean, quiet=(False,)),
    # the Accelerate layout save_state writes beside gradsync's own (fsdp_state_dict_type)
    Key(
        "fsdp_state_dict_type",
        word("SHARDED_STATE_DICT", "FULL_STATE_DICT", "LOCAL_STATE_DICT"),
        quiet=(None, "SHARDED_STATE_DICT"),
        refused={
            "LOCAL_STATE_DICT": "FSDP2 has no LOCAL_STATE_DICT (Accelerate refuses it too); use "
            "SHARDED_STATE_DICT or FULL_STATE_DICT"
        },
        to="fsdp_state_dict_type",
    ),
    Key(
        "fsdp_backward_prefetch",
        word(),
        quiet=(None, "BACKWARD_PRE", "NONE"),
        ignored="FSDP2 prefetches by itself",
    ),
    Key("fsdp_cpu_ram_efficient_loading", boolean, quiet=(True, False)),
    Key("fsdp_min_num_params"),  # accepted: gradsync wraps by class
    Key(
        "fsdp_offload_params",
        boolean,
        quiet=(False,),
        ignored="gradsync's FSDP2 keeps the parameters on the device",
    ),
    Key("fsdp_forward_prefetch", boolean, quiet=(False,), ignored="FSDP2 prefetches by itself"),
    Key(
        "fsdp_use_orig_params",
        boolean,
        quiet=(True,),
        ignored="FSDP2 always keeps the original parameters",
    ),
    Key(
        "fsdp_sync_module_states",
        boolean,
        quiet=(True,),
        ignored="gradsync always starts every rank from rank 0's weights",
    ),
    Key(
        "fsdp_activation_checkpointing_offload",
        boolean,
        quiet=(False,),
        ignored="gradsync's activation checkpointing recomputes on the device",
    ),
)


def translate(keys: Mapping[str, Any], src: Source, out: Translation) -> None:
    """The fsdp_config keys into ``out``: settings, and a note for each key ignored.

    Args:
        keys: the section (its keys' ``fsdp_`` prefix restored).
        src: names the keys in messages.
        out: receives the settings and notes.

    Raises:
        ConfigError: FSDP1, a sharding gradsync cannot honour, or a bad value.
    """
    if "fsdp_version" not in keys and any((SECTION, k) not in src.flags for k in keys):
        out.notes.append(
            f"{SECTION}{' in ' + src.label if src.label else ''} has no fsdp_version, which "
            "means FSDP1 to Accelerate: gradsync runs FSDP2 (fully_shard); add fsdp_version: 2"
        )
    applied = apply(KEYS, keys, SECTION, src, out)
    if applied.values.get("fsdp_activation_checkpointing"):
        item = src.item(
            SECTION, "fsdp_activation_checkpointing", keys["fsdp_activation_checkpointing"]
        )
        classes = out.settings.get("fsdp_wrap")
        if classes:
            out.set("activation_checkpointing", list(classes), item)
        else:
            out.notes.append(
                f"{item} is ignored: gradsync checkpoints the classes it is given; name them in "
                "fsdp_transformer_layer_cls_to_wrap (with TRANSFORMER_BASED_WRAP), or set "
                "gradsync's activation_checkpointing"
            )
    leftovers(KEYS, keys, SECTION, src, out, article="an")
