"""The top-level keys gradsync leaves aside: quiet at Accelerate's defaults, and one note
naming the key, its value and why for any other value."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradsync._support.declaration import FALSE
from gradsync.accelerate._compat.flags import TPU
from gradsync.accelerate._compat.keys import Key, Source, Translation, apply


def _as_written(value: Any, item: str) -> Any:
    """The value, with an empty list or mapping as None and a boolean word for false as False
    (how Accelerate's files write "not set")."""
    if value in ({}, []):
        return None
    if isinstance(value, str) and value.strip().lower() in FALSE:
        return False
    return value


def _key(name: str, quiet: tuple[Any, ...], why: str) -> Key:
    return Key(name, _as_written, quiet=quiet, ignored=why)


#: Each key gradsync leaves aside: its quiet values, and why another value is ignored.
KEYS: tuple[Key, ...] = (
    _key("debug", (False, None), "gradsync has no debug mode (--audit counts the collectives)"),
    _key("downcast_bf16", (False, None), "it is for TPUs"),
    _key(
        "enable_cpu_affinity",
        (False, None),
        "gradsync launch pins no CPUs (it sets OMP_NUM_THREADS from those this job may use)",
    ),
    _key(
        "main_training_function",
        ("main", None),
        "gradsync runs the script itself (the function matters to notebook launches only)",
    ),
    Key("same_network"),  # accepted: the rendezvous is the same either way
    _key("tpu_name", (None,), TPU),
    _key("tpu_zone", (None,), TPU),
    _key("tpu_use_cluster", (False, None), TPU),
    _key("tpu_use_sudo", (False, None), TPU),
    _key("command_file", (None,), TPU),
    _key("commands", (None,), TPU),
    _key("tpu_vm", (None,), TPU),
    _key("tpu_env", (None,), TPU),
    _key(
        "mpirun_config",
        (None,),
        "gradsync launch starts the processes with torchrun (for "
        "mpiexec, run the script under it without gradsync launch)",
    ),
    _key("megatron_lm_config", (None,), "gradsync does not run Megatron-LM"),
    _key("fp8_config", (None,), "gradsync has no fp8 training"),
)


def translate(data: Mapping[str, Any], src: Source, out: Translation) -> None:
    """A note for each key left aside whose value is not Accelerate's default.

    Args:
        data: the file's mapping.
        src: names the keys in messages.
        out: receives the notes.
    """
    apply(KEYS, data, None, src, out)
