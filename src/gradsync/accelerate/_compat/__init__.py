"""Accelerate's launch configuration in gradsync's terms: a config file as ``accelerate
config`` (or ``accelerate config default``) writes it, and ``accelerate launch``'s flags.

One translation serves every reader: ``gradsync.config.from_yaml`` (so
``Accelerator(config_file="accelerate.yaml")``, ``GRADSYNC_CONFIG`` and ``gradsync plan
--config`` read such a file) and ``gradsync launch`` (which also takes the keys that say how
to start the processes: ``num_processes``, ``num_machines``, ``machine_rank``,
``main_process_ip`` ...). The flags are first written as the file would hold them
(``from_flags``), so a flag and its key mean the same.

Each key is translated into gradsync settings or a launch option, or silent at Accelerate's
default, or noted (one warning line naming the key, its value, that it is ignored and why)
where gradsync has no counterpart and ignoring it leaves the result as it was, or a
ConfigError where ignoring it would change the training (``distributed_type: XLA``,
``fsdp_version: 1``, ``mixed_precision: fp8``, tensor parallelism ...).

One module per part of the file: ``processes`` (the backend, the processes and machines),
``precision`` (mixed precision, dynamo), ``fsdp``, ``deepspeed``, ``ignored`` (the keys left
aside); ``flags`` holds the flags. The sections' tables are read by one interpreter
(``keys.apply``).

A file is Accelerate's when it has a key only Accelerate's files have (``compute_environment``,
``distributed_type``, ``num_processes`` ...: ``is_accelerate``). gradsync's own keys may sit
beside Accelerate's in such a file; one that contradicts a translated key is a ConfigError.

Imports no torch (and nothing that does): the launcher's dry run reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradsync._support.util import did_you_mean
from gradsync.accelerate._compat import deepspeed, fsdp, ignored, precision, processes
from gradsync.accelerate._compat.flags import (
    FLAGS,
    FLAGS_BY_NAME,
    REFUSED_FLAG_PREFIXES,
    AcceleratedFlag,
    refused_flag,
)
from gradsync.accelerate._compat.keys import Source, Translation, boolean, section
from gradsync.accelerate._compat.processes import torchrun_fields
from gradsync.errors import ConfigError
from gradsync.settings import SETTINGS

__all__ = [
    "ACCELERATE_KEYS",
    "FLAGS",
    "REFUSED_FLAG_PREFIXES",
    "AcceleratedFlag",
    "Source",
    "Translation",
    "from_flags",
    "is_accelerate",
    "merge",
    "refused_flag",
    "torchrun_fields",
    "translate",
]

#: The top-level keys of Accelerate's config file (its ``ClusterConfig``), with the older
#: ``fp16`` and ``dynamo_backend`` that Accelerate still reads, and the flag
#: ``--num_cpu_threads_per_process`` as a key of its name.
ACCELERATE_KEYS = frozenset(
    {
        "compute_environment",
        "distributed_type",
        "mixed_precision",
        "use_cpu",
        "debug",
        "num_processes",
        "machine_rank",
        "num_machines",
        "gpu_ids",
        "main_process_ip",
        "main_process_port",
        "rdzv_backend",
        "same_network",
        "main_training_function",
        "enable_cpu_affinity",
        "fp8_config",
        "deepspeed_config",
        "fsdp_config",
        "parallelism_config",
        "megatron_lm_config",
        "mpirun_config",
        "downcast_bf16",
        "tpu_name",
        "tpu_zone",
        "tpu_use_cluster",
        "tpu_use_sudo",
        "command_file",
        "commands",
        "tpu_vm",
        "tpu_env",
        "dynamo_config",
        "fp16",
        "dynamo_backend",
        "num_cpu_threads_per_process",
    }
)
_GRADSYNC_KEYS = {s.yaml_key: s.name for s in SETTINGS}
#: Keys that only Accelerate's files have: any of them marks a file as Accelerate's.
_MARKS = ACCELERATE_KEYS - set(_GRADSYNC_KEYS)
#: A value in a DeepSpeed config by its path (``("zero_optimization", "stage")``), or None.
_get = deepspeed.value_at
#: The sections read with one backend: (section, backend, the distributed_type that means it).
_BACKEND_SECTIONS = (
    ("fsdp_config", "fsdp", "FSDP (--use_fsdp)"),
    ("deepspeed_config", "deepspeed", "DEEPSPEED (--use_deepspeed)"),
)


def is_accelerate(data: Mapping[str, Any]) -> bool:
    """Whether a config file's mapping is Accelerate's: it has a key only Accelerate's
    files have (``compute_environment``, ``distributed_type``, ``num_processes`` ...).

    Args:
        data: the file's top-level mapping.

    Returns:
        True for Accelerate's format.
    """
    return any(isinstance(k, str) and k in _MARKS for k in data)


def from_flags(values: Mapping[str, Any]) -> tuple[dict[str, Any], Source]:
    """``accelerate launch`` flags written as Accelerate's file would hold them.

    Args:
        values: flag name (``FLAGS``' names: ``num_processes``, ``use_fsdp``, ``zero_stage``
            ...) -> its value (True for a switch); None or False: not given.

    Returns:
        The file-shaped mapping, and the Source naming each key by its flag.

    Raises:
        ConfigError: an unknown name, or two flags that each choose the backend.
    """
    data: dict[str, Any] = {}
    given: dict[tuple[str | None, str], AcceleratedFlag] = {}
    for name, value in values.items():
        flag = FLAGS_BY_NAME.get(name)
        if flag is None:
            raise ConfigError(
                f"{name!r} is not an accelerate launch flag gradsync takes"
                f"{did_you_mean(name, FLAGS_BY_NAME)}; see gradsync launch --help"
            )
        if value is None or value is False:
            continue
        if flag.switch:
            value = flag.value
        earlier = given.get((flag.section, flag.key))
        if earlier is not None and flag.key == "distributed_type":
            raise ConfigError(
                f"--{earlier.name} and --{flag.name} each choose the backend; give one of them"
            )
        target = data.setdefault(flag.section, {}) if flag.section else data
        target[flag.key] = value
        given[(flag.section, flag.key)] = flag
    return data, Source("", given)


def merge(file: Mapping[str, Any], flags: Mapping[str, Any]) -> dict[str, Any]:
    """A file's mapping with the flags' keys over it (sections merged key by key).

    Args:
        file: the file's mapping.
        flags: ``from_flags``' mapping.

    Returns:
        The merged mapping (a copy).
    """
    out = dict(file)
    for key, value in flags.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def translate(
    data: Mapping[str, Any],
    source: Source | None = None,
    *,
    deepspeed_base: Any = None,
    base_label: str = "",
    backend: str | None = None,
) -> Translation:
    """Accelerate's config keys (a file's, ``from_flags``' or both ``merge``d) in gradsync's
    terms.

    Args:
        data: the mapping.
        source: names the keys in messages (default: a file without a name).
        deepspeed_base: a DeepSpeed config the ``deepspeed_config`` keys go into (gradsync's
            ``deepspeed_config`` setting from elsewhere: a dict, a path or JSON text); the
            keys win over it. Unused when ``deepspeed_config_file`` is given.
        base_label: names ``deepspeed_base`` in messages.
        backend: the backend given elsewhere (``--backend``), which wins over
            ``distributed_type`` in choosing the section that counts (``fsdp_config`` or
            ``deepspeed_config``).

    Returns:
        The settings, launch options and notes.

    Raises:
        ConfigError: a key gradsync cannot honour where ignoring it would change the
            training, an invalid value, or an unknown key.
    """
    src = source or Source()
    out = Translation()
    data = _older_spellings(data, src)
    _check_keys(data, src)
    processes.translate(data, src, out)
    ignored.translate(data, src, out)
    backend = backend or out.settings.get("backend")
    precision.mixed_precision(data, src, out)
    precision.dynamo(section(data, "dynamo_config", src, "dynamo_"), src, out)
    for name, its_backend, chosen_by in _BACKEND_SECTIONS:
        keys = section(data, name, src, "fsdp_" if its_backend == "fsdp" else "")
        if backend == its_backend == "fsdp":
            fsdp.translate(keys, src, out)
        elif backend == its_backend:
            deepspeed.translate(keys, src, out, deepspeed_base, base_label)
        elif keys:
            out.notes.append(
                f"{_first(src, name, keys)} is ignored: {name} is read with distributed_type "
                f"{chosen_by}, and the backend here is {backend or 'not given'}"
            )
    processes.parallelism(section(data, "parallelism_config", src, "parallelism_config_"), src, out)
    _gradsync_keys(data, src, out)
    return out


def _older_spellings(data: Mapping[str, Any], src: Source) -> dict[str, Any]:
    """``fp16: true`` as ``mixed_precision: fp16``, a top-level ``dynamo_backend`` as
    ``dynamo_config``'s (as Accelerate still reads them)."""
    data = dict(data)
    if "fp16" in data:
        fp16 = data.pop("fp16")
        if boolean(fp16, src.item(None, "fp16", fp16)) and data.get("mixed_precision") is None:
            data["mixed_precision"] = "fp16"
    if "dynamo_backend" in data:
        dynamo_backend = data.pop("dynamo_backend")
        data.setdefault("dynamo_config", {"dynamo_backend": dynamo_backend})
    return data


def _check_keys(data: Mapping[str, Any], src: Source) -> None:
    """Refuse a compute environment other than this machine, and keys neither Accelerate's
    nor gradsync's."""
    env = data.get("compute_environment")
    if env is not None and str(env).upper() != "LOCAL_MACHINE":
        raise ConfigError(
            f"{src.item(None, 'compute_environment', env)}: gradsync launches on the machines "
            "you start it on (SageMaker is not supported); use compute_environment: LOCAL_MACHINE"
        )
    unknown = sorted(str(k) for k in data if k not in ACCELERATE_KEYS and k not in _GRADSYNC_KEYS)
    if unknown:
        known = sorted(ACCELERATE_KEYS | set(_GRADSYNC_KEYS))
        where = f" in {src.label}" if src.label else ""
        raise ConfigError(
            f"unknown key(s) {', '.join(k + did_you_mean(k, known) for k in unknown)}{where}: "
            "neither Accelerate's nor gradsync's; rename or remove them"
        )


def _first(src: Source, name: str, keys: Mapping[str, Any]) -> str:
    key, value = next(iter(keys.items()))
    more = f" (and {len(keys) - 1} more of {name})" if len(keys) > 1 else ""
    return src.item(name, key, value) + more


def _gradsync_keys(data: Mapping[str, Any], src: Source, out: Translation) -> None:
    """gradsync's own keys beside Accelerate's: read as in gradsync's file."""
    for key, value in data.items():
        if key in ACCELERATE_KEYS or key not in _GRADSYNC_KEYS:
            continue
        name = _GRADSYNC_KEYS[key]
        if name in out.settings and out.settings[name] != value:
            raise ConfigError(
                f"{src.item(None, key, value)} contradicts {out.origins[name]} (which means "
                f"{name}={out.settings[name]!r}); keep one of them"
            )
        out.set(name, value, src.item(None, key, value))
