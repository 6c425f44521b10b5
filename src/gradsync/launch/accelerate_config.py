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

A file is Accelerate's when it has a key only Accelerate's files have (``compute_environment``,
``distributed_type``, ``num_processes`` ...: ``is_accelerate``). gradsync's own keys may sit
beside Accelerate's in such a file; one that contradicts a translated key is a ConfigError.

Imports no torch (and nothing that does): the launcher's dry run reads it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradsync._util import did_you_mean
from gradsync.errors import ConfigError
from gradsync.settings import SETTINGS

__all__ = [
    "ACCELERATE_KEYS", "FLAGS", "REFUSED_FLAG_PREFIXES", "AcceleratedFlag", "Source",
    "Translation", "from_flags", "is_accelerate", "merge", "refused_flag", "torchrun_fields",
    "translate",
]

#: The top-level keys of Accelerate's config file (its ``ClusterConfig``), with the older
#: ``fp16`` and ``dynamo_backend`` that Accelerate still reads, and the flag
#: ``--num_cpu_threads_per_process`` as a key of its name.
ACCELERATE_KEYS = frozenset({
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug",
    "num_processes", "machine_rank", "num_machines", "gpu_ids", "main_process_ip",
    "main_process_port", "rdzv_backend", "same_network", "main_training_function",
    "enable_cpu_affinity", "fp8_config", "deepspeed_config", "fsdp_config", "parallelism_config",
    "megatron_lm_config", "mpirun_config", "downcast_bf16", "tpu_name", "tpu_zone",
    "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
    "dynamo_config", "fp16", "dynamo_backend", "num_cpu_threads_per_process",
})
_GRADSYNC_KEYS = {s.yaml_key: s.name for s in SETTINGS}
#: Keys that only Accelerate's files have: any of them marks a file as Accelerate's.
_MARKS = ACCELERATE_KEYS - set(_GRADSYNC_KEYS)

#: distributed_type -> gradsync's backend.
_BACKENDS = {"NO": "single", "MULTI_CPU": "ddp", "MULTI_GPU": "ddp", "FSDP": "fsdp",
             "DEEPSPEED": "deepspeed"}
_OTHER_DEVICES = ("MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU",
                  "MULTI_NEURON")

_TRUE = frozenset({"true", "yes", "1", "on"})
_FALSE = frozenset({"false", "no", "0", "off", ""})
_LAUNCHER = ("gradsync launch starts the processes of one node with torchrun: run it once per "
             "node (e.g. srun --ntasks-per-node=1 gradsync launch ...)")
_TPU = "it is for TPU pods, and gradsync does not run on TPUs"
_SHARD_ALL = ("gradsync's FSDP2 shards over all ranks; use FULL_SHARD, or distributed_type: "
              "MULTI_GPU for plain data parallelism")

#: Top-level keys gradsync leaves aside: their silent (default) values, and why any other
#: value is ignored.
_IGNORED: dict[str, tuple[tuple[Any, ...], str]] = {
    "debug": ((False, None), "gradsync has no debug mode (--audit counts the collectives)"),
    "downcast_bf16": ((False, None, "no"), "it is for TPUs"),
    "enable_cpu_affinity": ((False, None), "gradsync launch pins no CPUs (it sets "
                                           "OMP_NUM_THREADS from those this job may use)"),
    "main_training_function": (("main", None), "gradsync runs the script itself (the "
                                               "function matters to notebook launches only)"),
    "same_network": ((True, False, None), ""),
    "tpu_name": ((None,), _TPU), "tpu_zone": ((None,), _TPU),
    "tpu_use_cluster": ((False, None), _TPU), "tpu_use_sudo": ((False, None), _TPU),
    "command_file": ((None,), _TPU), "commands": ((None,), _TPU), "tpu_vm": ((None,), _TPU),
    "tpu_env": ((None,), _TPU),
    "mpirun_config": ((None,), "gradsync launch starts the processes with torchrun (for "
                               "mpiexec, run the script under it without gradsync launch)"),
    "megatron_lm_config": ((None,), "gradsync does not run Megatron-LM"),
    "fp8_config": ((None,), "gradsync has no fp8 training"),
}


@dataclass(frozen=True)
class AcceleratedFlag:
    """One ``accelerate launch`` flag that ``gradsync launch`` takes.

    Attributes:
        name: its name as Accelerate spells it, without the dashes (``num_processes``).
        section: where its key sits in Accelerate's file: None (the top level),
            ``deepspeed_config``, ``fsdp_config`` or ``dynamo_config``.
        key: its key there (``distributed_type`` for ``--multi_gpu``, ``--use_fsdp`` ...).
        switch: it takes no value.
        value: the key's value when a switch is given.
        help: one line for ``--help``.
        metavar: the value's placeholder.
        kind: how the value is read: "int", "float" or "text".
    """

    name: str
    section: str | None
    key: str
    switch: bool
    help: str
    value: Any = True
    metavar: str | None = None
    kind: str = "text"


def _f(name: str, help: str, *, section: str | None = None, key: str | None = None,
       switch: bool = False, value: Any = True, metavar: str | None = None,
       kind: str = "text") -> AcceleratedFlag:
    return AcceleratedFlag(name, section, key or name, switch, help, value, metavar, kind)


_DS, _FSDP, _DYNAMO = "deepspeed_config", "fsdp_config", "dynamo_config"
#: The ``accelerate launch`` flags ``gradsync launch`` takes (both spellings), each with the
#: key of Accelerate's file it stands for. The gradsync flags --mixed-precision,
#: --gradient-accumulation-steps and torchrun's (--max-restarts, --rdzv-backend, --tee ...)
#: already have Accelerate's spellings.
FLAGS: tuple[AcceleratedFlag, ...] = (
    _f("num_processes", "processes over all machines (Accelerate's total: --nproc-per-node is "
       "this divided by --num_machines)", metavar="N", kind="int"),
    _f("num_machines", "machines (--nnodes)", metavar="N", kind="int"),
    _f("machine_rank", "this machine's rank (--node-rank)", metavar="R", kind="int"),
    _f("main_process_ip", "address of the machine of rank 0 (--master-addr)", metavar="A"),
    _f("main_process_port", "its port (--master-port; 0: a free one)", metavar="P", kind="int"),
    _f("multi_gpu", "data parallel: --backend ddp", key="distributed_type", switch=True,
       value="MULTI_GPU"),
    _f("use_fsdp", "--backend fsdp (FSDP2)", key="distributed_type", switch=True, value="FSDP"),
    _f("use_deepspeed", "--backend deepspeed (ZeRO stage 2 unless --zero_stage or "
       "--deepspeed_config_file says otherwise)", key="distributed_type", switch=True,
       value="DEEPSPEED"),
    _f("tpu", "refused: gradsync does not run on TPUs", key="distributed_type", switch=True,
       value="XLA"),
    _f("use_megatron_lm", "refused: gradsync does not run Megatron-LM", key="distributed_type",
       switch=True, value="MEGATRON_LM"),
    _f("cpu", "train on the CPU even where a GPU is visible (GRADSYNC_DEVICE=cpu)",
       key="use_cpu", switch=True),
    _f("gpu_ids", "the GPUs to use, e.g. 0,1 (CUDA_VISIBLE_DEVICES; default: all)",
       metavar="IDS"),
    _f("num_cpu_threads_per_process", "OMP_NUM_THREADS of each process", metavar="N",
       kind="int"),
    _f("same_network", "accepted (the rendezvous is the same either way)", switch=True),
    _f("debug", "ignored, with a warning (gradsync's --audit counts the collectives)",
       switch=True),
    _f("enable_cpu_affinity", "ignored, with a warning", switch=True),
    _f("downcast_bf16", "ignored, with a warning (TPUs only)", switch=True),
    _f("main_training_function", "ignored, with a warning (notebook launches only)",
       metavar="NAME"),
    _f("mpirun_hostfile", "ignored, with a warning (gradsync starts the processes with "
       "torchrun)", section="mpirun_config", metavar="PATH"),
    _f("dynamo_backend", "torch.compile the model with this backend (gradsync's compile "
       "setting; no: off)", section=_DYNAMO, metavar="B"),
    _f("dynamo_mode", "torch.compile's mode", section=_DYNAMO, metavar="MODE"),
    _f("dynamo_use_fullgraph", "torch.compile with fullgraph=True", section=_DYNAMO,
       switch=True),
    _f("dynamo_use_dynamic", "torch.compile with dynamic=True", section=_DYNAMO, switch=True),
    _f("dynamo_use_regional_compilation", "ignored, with a warning", section=_DYNAMO,
       switch=True),
    _f("deepspeed_config_file", "a DeepSpeed JSON/YAML config (gradsync's deepspeed_config)",
       section=_DS, metavar="PATH"),
    _f("zero_stage", "ZeRO stage 0-3 (zero_optimization.stage of the DeepSpeed config)",
       section=_DS, metavar="N", kind="int"),
    _f("offload_optimizer_device", "none, cpu or nvme (zero_optimization.offload_optimizer)",
       section=_DS, metavar="D"),
    _f("offload_param_device", "none, cpu or nvme (zero_optimization.offload_param)",
       section=_DS, metavar="D"),
    _f("offload_optimizer_nvme_path", "the NVMe path of the optimizer offload", section=_DS,
       metavar="PATH"),
    _f("offload_param_nvme_path", "the NVMe path of the parameter offload", section=_DS,
       metavar="PATH"),
    _f("gradient_clipping", "DeepSpeed's gradient_clipping", section=_DS, metavar="X",
       kind="float"),
    _f("zero3_init_flag", "ignored when true, with a warning (build the model under "
       "deepspeed.zero.Init yourself)", section=_DS, metavar="BOOL"),
    _f("zero3_save_16bit_model", "zero_optimization.stage3_gather_16bit_weights_on_model_save",
       section=_DS, metavar="BOOL"),
    _f("deepspeed_multinode_launcher", "ignored unless 'standard', with a warning", section=_DS,
       metavar="L"),
    _f("deepspeed_hostfile", "ignored, with a warning", section=_DS, metavar="PATH"),
    _f("deepspeed_exclusion_filter", "ignored, with a warning", section=_DS, metavar="F"),
    _f("deepspeed_inclusion_filter", "ignored, with a warning", section=_DS, metavar="F"),
    _f("deepspeed_moe_layer_cls_names", "ignored, with a warning", section=_DS, metavar="NAMES"),
    _f("fsdp_version", "2 (gradsync runs FSDP2; 1 is refused)", section=_FSDP, metavar="V"),
    _f("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP (with the classes below), NO_WRAP; "
       "SIZE_BASED_WRAP is ignored with a warning", section=_FSDP, metavar="P"),
    _f("fsdp_transformer_layer_cls_to_wrap", "class names sharded as their own unit "
       "(gradsync's fsdp_wrap), e.g. LlamaDecoderLayer", section=_FSDP, metavar="NAMES"),
    _f("fsdp_min_num_params", "ignored (gradsync wraps by class)", section=_FSDP, metavar="N"),
    _f("fsdp_reshard_after_forward", "true (false is ignored with a warning)", section=_FSDP,
       metavar="BOOL"),
    _f("fsdp_sharding_strategy", "FULL_SHARD (SHARD_GRAD_OP is ignored with a warning; others "
       "are refused)", section=_FSDP, metavar="S"),
    _f("fsdp_activation_checkpointing", "true: recompute the wrapped classes' forward "
       "(gradsync's activation_checkpointing)", section=_FSDP, metavar="BOOL"),
    _f("fsdp_offload_params", "ignored when true, with a warning", section=_FSDP,
       metavar="BOOL"),
    _f("fsdp_state_dict_type", "SHARDED_STATE_DICT (what gradsync saves; others ignored with "
       "a warning)", section=_FSDP, metavar="T"),
    _f("fsdp_backward_prefetch", "ignored, with a warning (FSDP1 only)", section=_FSDP,
       metavar="P"),
    _f("fsdp_forward_prefetch", "ignored when true, with a warning", section=_FSDP,
       metavar="BOOL"),
    _f("fsdp_use_orig_params", "ignored when false, with a warning (FSDP2 keeps them)",
       section=_FSDP, metavar="BOOL"),
    _f("fsdp_cpu_ram_efficient_loading", "accepted (every rank starts from rank 0's weights)",
       section=_FSDP, metavar="BOOL"),
    _f("fsdp_sync_module_states", "accepted when true (gradsync always starts every rank from "
       "rank 0's weights)", section=_FSDP, metavar="BOOL"),
    _f("fsdp_activation_checkpointing_offload", "ignored when true, with a warning",
       section=_FSDP, metavar="BOOL"),
)
_FLAGS_BY_NAME = {f.name: f for f in FLAGS}

#: Families of ``accelerate launch`` flags ``gradsync launch`` refuses, by prefix: why.
REFUSED_FLAG_PREFIXES: dict[str, str] = {
    "megatron_lm_": "gradsync does not run Megatron-LM",
    "fp8_": "gradsync has no fp8 training (use --mixed-precision bf16)",
    "parallelism_config_": "gradsync runs data parallelism only (FSDP2 and ZeRO shard over all "
                           "ranks); drop it",
    "use_parallelism_config": "gradsync runs data parallelism only (FSDP2 and ZeRO shard over "
                              "all ranks); drop it",
    "tpu_cluster": _TPU, "no_tpu_cluster": _TPU, "tpu_use_sudo": _TPU, "vm": _TPU, "env": _TPU,
    "aws_": "gradsync launches on this machine, not on SageMaker",
    "role": "gradsync launch starts one role of workers; drop it",
    "mpirun_ccl": "gradsync starts the processes with torchrun; drop it",
}


def refused_flag(flag: str) -> str | None:
    """Why ``gradsync launch`` refuses the ``accelerate launch`` flag ``flag``, or None.

    Args:
        flag: the flag as given (``--megatron_lm_tp_degree`` or ``--megatron-lm-tp-degree``).

    Returns:
        The reason, or None when it is no Accelerate flag gradsync refuses.
    """
    name = flag.split("=", 1)[0].lstrip("-").replace("-", "_")
    for prefix, why in REFUSED_FLAG_PREFIXES.items():
        if name == prefix or (prefix.endswith("_") and name.startswith(prefix)):
            return why
    return None


@dataclass(frozen=True)
class Source:
    """Where translated values came from, for messages.

    Attributes:
        label: the file (``'accelerate.yaml'``), or "" for flags only.
        flags: (section, key) -> the flag that gave the key (it wins over the file's).
    """

    label: str = ""
    flags: Mapping[tuple[str | None, str], AcceleratedFlag] = field(default_factory=dict)

    def item(self, section: str | None, key: str, value: Any) -> str:
        """How a message names a key and its value: ``--zero_stage=5``, ``--tpu``, or
        ``deepspeed_config.zero_stage=5 in 'a.yaml'``.

        Args:
            section: the key's section (None: the top level).
            key: the key.
            value: its value.

        Returns:
            The text.
        """
        flag = self.flags.get((section, key))
        if flag is not None:
            return f"--{flag.name}" if flag.switch else f"--{flag.name}={value}"
        dotted = f"{section}.{key}" if section else key
        where = f" in {self.label}" if self.label else ""
        return f"{dotted}={value!r}{where}"


@dataclass
class Translation:
    """What Accelerate's keys say in gradsync's terms.

    Attributes:
        settings: gradsync setting -> value.
        launch: how to start the processes, by Accelerate's key: ``num_processes`` (over all
            machines), ``num_machines``, ``machine_rank``, ``main_process_ip``,
            ``main_process_port``, ``rdzv_backend``, ``use_cpu``, ``gpu_ids``,
            ``num_cpu_threads_per_process`` (those given).
        notes: one line per key that is ignored: the key, its value and why.
        origins: setting or launch key -> the key (and value) it was translated from.
    """

    settings: dict[str, Any] = field(default_factory=dict)
    launch: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    origins: dict[str, str] = field(default_factory=dict)


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
        flag = _FLAGS_BY_NAME.get(name)
        if flag is None:
            hint = did_you_mean(name, _FLAGS_BY_NAME)
            raise ConfigError(
                f"{name!r} is not an accelerate launch flag gradsync takes{hint}; see "
                "gradsync launch --help"
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


# -- reading values -----------------------------------------------------------------------
def _bool(value: Any, item: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE or value is None:
        return False
    raise ConfigError(f"{item} must be true or false")


def _int(value: Any, item: str, low: int, high: int | None = None, *, shown: int | None = None) -> int:
    """A whole number from low to high; ``shown``: the lower bound messages name (when
    ``low`` admits a value that means "not set", such as num_processes' -1)."""
    try:
        number = int(str(value).strip()) if not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or number < low or (high is not None and number > high):
        first = low if shown is None else shown
        span = f"{first} to {high}" if high is not None else f">= {first}"
        raise ConfigError(f"{item} must be a whole number {span}")
    return number


def _names(value: Any, item: str) -> list[str]:
    if isinstance(value, list | tuple):
        parts = [str(v).strip() for v in value]
    elif isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
    else:
        raise ConfigError(f"{item} must be class names separated by commas, e.g. LlamaDecoderLayer")
    return [p for p in parts if p]


def _section(data: Mapping[str, Any], key: str, source: Source, prefix: str = "") -> dict[str, Any]:
    """A section (``fsdp_config`` ...) with its keys' prefix restored where a file left it
    out (as Accelerate reads them: ``version`` is ``fsdp_version``)."""
    raw = data.get(key)
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source.item(None, key, raw)} must be a mapping of {key} keys")
    return {(k if not prefix or str(k).startswith(prefix.rstrip("_")) else prefix + str(k)): v
            for k, v in raw.items()}


# -- the translation ----------------------------------------------------------------------
def translate(data: Mapping[str, Any], source: Source | None = None, *,
              deepspeed_base: Any = None, base_label: str = "",
              backend: str | None = None) -> Translation:
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
    data = dict(data)
    if "fp16" in data:  # Accelerate's older spelling
        fp16 = data.pop("fp16")
        if _bool(fp16, src.item(None, "fp16", fp16)) and data.get("mixed_precision") is None:
            data["mixed_precision"] = "fp16"
    if "dynamo_backend" in data:
        backend = data.pop("dynamo_backend")
        data.setdefault("dynamo_config", {"dynamo_backend": backend})
    env = data.get("compute_environment")
    if env is not None and str(env).upper() != "LOCAL_MACHINE":
        raise ConfigError(
            f"{src.item(None, 'compute_environment', env)}: gradsync launches on the machines "
            "you start it on (SageMaker is not supported); use compute_environment: LOCAL_MACHINE"
        )
    unknown = sorted(str(k) for k in data if k not in ACCELERATE_KEYS and k not in _GRADSYNC_KEYS)
    if unknown:
        known = sorted(ACCELERATE_KEYS | set(_GRADSYNC_KEYS))

        def hint(k: str) -> str:
            return did_you_mean(k, known)

        where = f" in {src.label}" if src.label else ""
        raise ConfigError(
            f"unknown key(s) {', '.join(f'{k}{hint(k)}' for k in unknown)}{where}: neither "
            "Accelerate's nor gradsync's; rename or remove them"
        )
    _top_level(data, src, out)
    backend = backend or out.settings.get("backend")
    _mixed_precision(data, src, out)
    _dynamo(_section(data, "dynamo_config", src, "dynamo_"), src, out)
    for section, name, switch, read in (("fsdp_config", "fsdp", "FSDP (--use_fsdp)", _fsdp),
                                        ("deepspeed_config", "deepspeed",
                                         "DEEPSPEED (--use_deepspeed)", None)):
        keys = _section(data, section, src, "fsdp_" if name == "fsdp" else "")
        if backend == name:
            if read is not None:
                read(keys, src, out)
            else:
                _deepspeed(keys, src, out, deepspeed_base, base_label)
        elif keys:
            out.notes.append(
                f"{_first(src, section, keys)} is ignored: {section} is read with "
                f"distributed_type {switch}, and the backend here is {backend or 'not given'}")
    _parallelism(_section(data, "parallelism_config", src, "parallelism_config_"), src)
    _gradsync_keys(data, src, out)
    return out


def _first(src: Source, section: str, keys: Mapping[str, Any]) -> str:
    key, value = next(iter(keys.items()))
    more = f" (and {len(keys) - 1} more of {section})" if len(keys) > 1 else ""
    return src.item(section, key, value) + more


def _set(out: Translation, name: str, value: Any, origin: str) -> None:
    out.settings[name] = value
    out.origins[name] = origin


def _top_level(data: Mapping[str, Any], src: Source, out: Translation) -> None:
    kind = data.get("distributed_type")
    if kind is not None:
        item = src.item(None, "distributed_type", kind)
        name = str(kind).upper()
        if name in _BACKENDS:
            _set(out, "backend", _BACKENDS[name], item)
        elif name == "XLA":
            raise ConfigError(f"{item}: gradsync does not run on TPUs (XLA); use MULTI_GPU or "
                              "FSDP on GPUs")
        elif name == "MEGATRON_LM":
            raise ConfigError(f"{item}: gradsync does not run Megatron-LM; use FSDP or DEEPSPEED "
                              "for a model that needs sharding")
        elif name in _OTHER_DEVICES:
            raise ConfigError(f"{item}: gradsync runs on CUDA GPUs and CPUs; use MULTI_GPU or "
                              "MULTI_CPU")
        else:
            raise ConfigError(f"{item} is unknown; use NO, MULTI_CPU, MULTI_GPU, FSDP or DEEPSPEED")
    for key, (low, high) in (("num_processes", (-1, None)), ("num_machines", (1, None)),
                             ("machine_rank", (0, None)), ("main_process_port", (0, 65535)),
                             ("num_cpu_threads_per_process", (1, None))):
        value = data.get(key)
        if value is None:
            continue
        number = _int(value, src.item(None, key, value), low, high,
                      shown=1 if key == "num_processes" else None)
        if key == "num_processes" and number == 0:
            raise ConfigError(f"{src.item(None, key, value)} must be a whole number >= 1")
        if (key, number) in (("num_processes", -1), ("main_process_port", 0)):
            continue  # Accelerate's "not set" (-1) and "a free port" (0): gradsync's default
        out.launch[key] = number
        out.origins[key] = src.item(None, key, value)
    for key in ("main_process_ip", "rdzv_backend", "gpu_ids"):
        value = data.get(key)
        silent = {"rdzv_backend": ("static",), "gpu_ids": ("all",)}.get(key, ())
        if value is not None and str(value).strip() and str(value) not in silent:
            out.launch[key] = str(value).strip()
            out.origins[key] = src.item(None, key, value)
    if "use_cpu" in data and _bool(data["use_cpu"], src.item(None, "use_cpu", data["use_cpu"])):
        out.launch["use_cpu"] = True
        out.origins["use_cpu"] = src.item(None, "use_cpu", data["use_cpu"])
        processes = out.launch.get("num_processes", 1)
        if processes > 1 and not str(data.get("distributed_type", "")).startswith("MULTI_"):
            out.notes.append(
                f"{out.origins['use_cpu']} with {out.origins['num_processes']}: gradsync starts "
                f"{processes} processes on the CPU, where accelerate launch would start one (it "
                f"needs --multi_gpu with ACCELERATE_USE_CPU=1 for {processes})")
    if out.launch.get("num_machines", 1) > 1 and out.launch.get("machine_rank", 0) >= out.launch["num_machines"]:
        raise ConfigError(
            f"{out.origins['machine_rank']} must be below num_machines={out.launch['num_machines']}"
        )
    for key, (silent, why) in _IGNORED.items():
        value = data.get(key)
        if value in ({}, []) or value in silent or not why:
            continue
        if key == "megatron_lm_config" and str(data.get("distributed_type", "")).upper() == "MEGATRON_LM":
            continue  # refused above
        if isinstance(value, str) and value.strip().lower() in _FALSE and False in silent:
            continue
        out.notes.append(f"{src.item(None, key, value)} is ignored: {why}")


def _mixed_precision(data: Mapping[str, Any], src: Source, out: Translation) -> None:
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
        _set(out, "mixed_precision", text, item)


def _dynamo(keys: Mapping[str, Any], src: Source, out: Translation) -> None:
    if not keys:
        return
    backend = keys.get("dynamo_backend")
    if backend is None or str(backend).strip().lower() in ("no", "none", ""):
        return
    item = src.item("dynamo_config", "dynamo_backend", backend)
    compile_args: dict[str, Any] = {"backend": str(backend).strip().lower()}
    mode = keys.get("dynamo_mode")
    if mode is not None and str(mode) != "default":
        compile_args["mode"] = str(mode)
    for key, arg in (("dynamo_use_fullgraph", "fullgraph"), ("dynamo_use_dynamic", "dynamic")):
        if key in keys and _bool(keys[key], src.item("dynamo_config", key, keys[key])):
            compile_args[arg] = True
    regional = keys.get("dynamo_use_regional_compilation")
    if regional is not None and _bool(regional, src.item("dynamo_config", "dynamo_use_regional_compilation", regional)):
        out.notes.append(
            f"{src.item('dynamo_config', 'dynamo_use_regional_compilation', regional)} is "
            "ignored: gradsync compiles the whole model (on FSDP each sharded block)"
        )
    for key in sorted(set(keys) - {"dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph",
                                   "dynamo_use_dynamic", "dynamo_use_regional_compilation"}):
        out.notes.append(f"{src.item('dynamo_config', key, keys[key])} is ignored: not a "
                         "dynamo_config key gradsync knows")
    _set(out, "compile", compile_args, item)


# -- FSDP ---------------------------------------------------------------------------------
_FSDP_SILENT: dict[str, tuple[Any, ...]] = {
    "fsdp_offload_params": (False,), "fsdp_forward_prefetch": (False,),
    "fsdp_use_orig_params": (True,), "fsdp_sync_module_states": (True,),
    "fsdp_activation_checkpointing_offload": (False,),
}
_FSDP_WHY = {
    "fsdp_offload_params": "gradsync's FSDP2 keeps the parameters on the device",
    "fsdp_forward_prefetch": "FSDP2 prefetches by itself",
    "fsdp_use_orig_params": "FSDP2 always keeps the original parameters",
    "fsdp_sync_module_states": "gradsync always starts every rank from rank 0's weights",
    "fsdp_activation_checkpointing_offload": "gradsync's activation checkpointing recomputes "
                                             "on the device",
}


def _fsdp(keys: Mapping[str, Any], src: Source, out: Translation) -> None:
    def item(key: str) -> str:
        return src.item("fsdp_config", key, keys[key])

    done = {"fsdp_version", "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap",
            "fsdp_min_num_params", "fsdp_reshard_after_forward", "fsdp_sharding_strategy",
            "fsdp_activation_checkpointing", "fsdp_state_dict_type", "fsdp_backward_prefetch",
            "fsdp_cpu_ram_efficient_loading", *_FSDP_SILENT}
    if "fsdp_version" in keys:
        if _int(keys["fsdp_version"], item("fsdp_version"), 1, 2) == 1:
            raise ConfigError(
                f"{item('fsdp_version')}: gradsync runs FSDP2 (fully_shard), not FSDP1; set "
                "fsdp_version: 2 (the other fsdp_config keys keep their meaning)"
            )
    elif any(("fsdp_config", k) not in src.flags for k in keys):  # a file's section
        out.notes.append(
            f"fsdp_config{' in ' + src.label if src.label else ''} has no fsdp_version, which "
            "means FSDP1 to Accelerate: gradsync runs FSDP2 (fully_shard); add fsdp_version: 2"
        )
    for key in ("fsdp_reshard_after_forward", "fsdp_sharding_strategy"):
        if key not in keys:
            continue
        value = keys[key]
        text = str(value).strip().upper()
        strategy = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD",
                    "5": "HYBRID_SHARD_ZERO2"}.get(text, text)
        if strategy in ("FULL_SHARD",) or (strategy.lower() in _TRUE and key == "fsdp_reshard_after_forward"):
            continue
        if strategy == "SHARD_GRAD_OP" or strategy.lower() in _FALSE:
            out.notes.append(f"{item(key)} is ignored: gradsync's FSDP2 reshards after forward "
                             "(fully_shard's default)")
        elif strategy in ("NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
            raise ConfigError(f"{item(key)}: {_SHARD_ALL}")
        else:
            raise ConfigError(f"{item(key)} is unknown; use true or false (FULL_SHARD or "
                              "SHARD_GRAD_OP)")
    policy = keys.get("fsdp_auto_wrap_policy")
    policy_name = str(policy).strip().upper() if policy is not None else None
    if policy_name not in (None, "TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"):
        raise ConfigError(f"{item('fsdp_auto_wrap_policy')} is unknown; use "
                          "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP")
    classes: list[str] = []
    if keys.get("fsdp_transformer_layer_cls_to_wrap") is not None:
        names = _names(keys["fsdp_transformer_layer_cls_to_wrap"], item("fsdp_transformer_layer_cls_to_wrap"))
        if policy_name in (None, "TRANSFORMER_BASED_WRAP"):
            classes = names
            if classes:
                _set(out, "fsdp_wrap", classes, item("fsdp_transformer_layer_cls_to_wrap"))
        else:
            out.notes.append(f"{item('fsdp_transformer_layer_cls_to_wrap')} is ignored: "
                             f"fsdp_auto_wrap_policy is {policy_name}")
    if policy_name == "SIZE_BASED_WRAP":
        out.notes.append(
            f"{item('fsdp_auto_wrap_policy')} is ignored: gradsync shards by class (the children "
            "of each ModuleList unless fsdp_transformer_layer_cls_to_wrap names them); name the "
            "blocks with TRANSFORMER_BASED_WRAP and fsdp_transformer_layer_cls_to_wrap"
        )
    if "fsdp_activation_checkpointing" in keys and _bool(keys["fsdp_activation_checkpointing"], item("fsdp_activation_checkpointing")):
        if classes:
            _set(out, "activation_checkpointing", list(classes), item("fsdp_activation_checkpointing"))
        else:
            out.notes.append(
                f"{item('fsdp_activation_checkpointing')} is ignored: gradsync checkpoints the "
                "classes it is given; name them in fsdp_transformer_layer_cls_to_wrap (with "
                "TRANSFORMER_BASED_WRAP), or set gradsync's activation_checkpointing"
            )
    state = keys.get("fsdp_state_dict_type")
    if state is not None and str(state).strip().upper() != "SHARDED_STATE_DICT":
        out.notes.append(
            f"{item('fsdp_state_dict_type')} is ignored: gradsync's save_state writes sharded "
            "checkpoints (torch.distributed.checkpoint); accel.save_model writes the whole model"
        )
    prefetch = keys.get("fsdp_backward_prefetch")
    if prefetch is not None and str(prefetch).strip().upper() not in ("BACKWARD_PRE", "NONE"):
        out.notes.append(f"{item('fsdp_backward_prefetch')} is ignored: FSDP2 prefetches by itself")
    if "fsdp_cpu_ram_efficient_loading" in keys:
        _bool(keys["fsdp_cpu_ram_efficient_loading"], item("fsdp_cpu_ram_efficient_loading"))
    for key, silent in _FSDP_SILENT.items():
        if key in keys and _bool(keys[key], item(key)) not in silent:
            out.notes.append(f"{item(key)} is ignored: {_FSDP_WHY[key]}")
    for key in sorted(set(keys) - done):
        out.notes.append(f"{item(key)} is ignored: not an fsdp_config key gradsync knows")


# -- DeepSpeed ----------------------------------------------------------------------------
#: deepspeed_config key -> where it goes in the DeepSpeed config (as Accelerate puts it).
_DS_PATHS: dict[str, tuple[str, ...]] = {
    "zero_stage": ("zero_optimization", "stage"),
    "offload_optimizer_device": ("zero_optimization", "offload_optimizer", "device"),
    "offload_param_device": ("zero_optimization", "offload_param", "device"),
    "offload_optimizer_nvme_path": ("zero_optimization", "offload_optimizer", "nvme_path"),
    "offload_param_nvme_path": ("zero_optimization", "offload_param", "nvme_path"),
    "gradient_clipping": ("gradient_clipping",),
    "zero3_save_16bit_model": ("zero_optimization", "stage3_gather_16bit_weights_on_model_save"),
}
_DS_LAUNCHER_KEYS = ("deepspeed_hostfile", "deepspeed_exclusion_filter",
                     "deepspeed_inclusion_filter")


def _load_ds(value: Any, label: str) -> dict[str, Any]:
    """A DeepSpeed config from a dict, a JSON/YAML file or JSON text (a copy)."""
    if isinstance(value, Mapping):
        copy: dict[str, Any] = json.loads(json.dumps(value))
        return copy
    text = str(value)
    path = Path(text).expanduser()
    if text.lstrip().startswith("{"):
        data = _parse_ds(text, label, yaml_ok=False)
    elif path.is_file():
        try:
            raw = path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{label} cannot be read ({err}); give a readable DeepSpeed JSON file") from None
        data = _parse_ds(raw, label, yaml_ok=path.suffix.lower() in (".yaml", ".yml"))
    else:
        raise ConfigError(f"{label}: {text!r} does not exist; give the path of a DeepSpeed JSON file")
    if not isinstance(data, dict):
        raise ConfigError(f"{label} must hold a mapping (a DeepSpeed config), not {type(data).__name__}")
    return data


def _parse_ds(text: str, label: str, *, yaml_ok: bool) -> Any:
    if yaml_ok:
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{label} is YAML, which needs PyYAML; pip install 'gradsync[yaml]'") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"{label} is not valid YAML ({' '.join(str(err).split())})") from None
    try:
        return json.loads(text)
    except ValueError as err:
        raise ConfigError(f"{label} is not valid JSON ({err}); fix the syntax there") from None


def _get(ds: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = ds
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _put(ds: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = ds
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[path[-1]] = value


def _deepspeed(keys: Mapping[str, Any], src: Source, out: Translation, base: Any,
               base_label: str) -> None:
    def item(key: str) -> str:
        return src.item("deepspeed_config", key, keys[key])

    wanted: dict[tuple[str, ...], tuple[Any, str]] = {}  # DeepSpeed path -> (value, item)
    file = keys.get("deepspeed_config_file")
    if file is not None and str(file).strip().lower() in ("", "none"):
        file = None
    if "zero_stage" in keys and keys["zero_stage"] is not None:
        wanted[_DS_PATHS["zero_stage"]] = (_int(keys["zero_stage"], item("zero_stage"), 0, 3), item("zero_stage"))
    devices = {}
    for kind in ("optimizer", "param"):
        key = f"offload_{kind}_device"
        if keys.get(key) is None:
            continue
        device = str(keys[key]).strip().lower()
        if device not in ("none", "cpu", "nvme"):
            raise ConfigError(f"{item(key)} is unknown; use none, cpu or nvme")
        devices[kind] = device
        if device != "none":
            wanted[_DS_PATHS[key]] = (device, item(key))
        nvme = keys.get(f"offload_{kind}_nvme_path")
        if device == "nvme" and nvme is not None and str(nvme).strip().lower() != "none":
            wanted[_DS_PATHS[f"offload_{kind}_nvme_path"]] = (str(nvme), item(f"offload_{kind}_nvme_path"))
    clip = keys.get("gradient_clipping")
    if clip is not None and str(clip).strip().lower() not in ("auto", "none"):
        try:
            clip_value = float(clip)
        except (TypeError, ValueError):
            clip_value = -1.0
        if not clip_value >= 0:
            raise ConfigError(f"{item('gradient_clipping')} must be a number >= 0 (0: no clipping)")
        wanted[_DS_PATHS["gradient_clipping"]] = (clip_value, item("gradient_clipping"))
    if keys.get("zero3_save_16bit_model") is not None and _bool(keys["zero3_save_16bit_model"], item("zero3_save_16bit_model")):
        wanted[_DS_PATHS["zero3_save_16bit_model"]] = (True, item("zero3_save_16bit_model"))
    steps = keys.get("gradient_accumulation_steps")
    if steps is not None and str(steps).strip().lower() != "auto":
        k = _int(steps, item("gradient_accumulation_steps"), 1)
        if k != 1:  # 1: what `accelerate config` writes unless asked, and gradsync's default
            _set(out, "gradient_accumulation_steps", k, item("gradient_accumulation_steps"))
    if keys.get("zero3_init_flag") is not None and _bool(keys["zero3_init_flag"], item("zero3_init_flag")):
        out.notes.append(
            f"{item('zero3_init_flag')} is ignored: gradsync does not build the model; build it "
            "under deepspeed.zero.Init() yourself to create it sharded"
        )
    launcher = keys.get("deepspeed_multinode_launcher")
    if launcher is not None and str(launcher).strip().lower() != "standard":
        out.notes.append(f"{item('deepspeed_multinode_launcher')} is ignored: {_LAUNCHER}")
    for key in _DS_LAUNCHER_KEYS:
        if keys.get(key) is not None:
            out.notes.append(f"{item(key)} is ignored: {_LAUNCHER}")
    if keys.get("deepspeed_moe_layer_cls_names") is not None:
        out.notes.append(f"{item('deepspeed_moe_layer_cls_names')} is ignored: set DeepSpeed's "
                         "leaf modules yourself (deepspeed.utils.set_z3_leaf_modules)")
    known = {"deepspeed_config_file", "gradient_accumulation_steps", "zero3_init_flag",
             "deepspeed_multinode_launcher", "deepspeed_moe_layer_cls_names", *_DS_LAUNCHER_KEYS,
             *_DS_PATHS}
    for key in sorted(set(keys) - known):
        out.notes.append(f"{item(key)} is ignored: not a deepspeed_config key gradsync knows")

    if file is not None:
        label = item("deepspeed_config_file")
        ds: dict[str, Any] | None = _load_ds(file, label)
        origin, strict = label, True
        path_only: Any = str(Path(str(file)).expanduser().resolve())
    elif base is not None:
        label = base_label or "deepspeed_config"
        ds, origin, strict, path_only = _load_ds(base, label), label, False, base
    else:
        ds, origin, strict, path_only = None, "", True, None
        if _DS_PATHS["zero_stage"] not in wanted:
            wanted[_DS_PATHS["zero_stage"]] = (2, "Accelerate's default ZeRO stage")
    if not wanted:
        _set(out, "deepspeed_config", path_only, origin)
        return
    merged = ds if ds is not None else {}
    for path, (value, said) in wanted.items():
        current = _get(merged, path)
        if strict and current not in (None, "auto") and current != value:
            raise ConfigError(
                f"{said} contradicts {'.'.join(path)}={current!r} in {origin}; drop one of them"
            )
        _put(merged, path, value)
    _set(out, "deepspeed_config", merged,
         ", ".join(said for _, said in wanted.values()) + (f" into {origin}" if origin else ""))


def _parallelism(keys: Mapping[str, Any], src: Source) -> None:
    for key, value in keys.items():
        if not key.endswith("_size") or key.endswith("dp_shard_size") or value is None:
            continue
        if _int(value, src.item("parallelism_config", key, value), -1) > 1:
            raise ConfigError(
                f"{src.item('parallelism_config', key, value)}: gradsync runs data parallelism "
                "only (FSDP2 and ZeRO shard over all ranks); drop it or set it to 1"
            )


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
        _set(out, name, value, src.item(None, key, value))


def torchrun_fields(launch: Mapping[str, Any],
                    rdzv_backend: str | None = None) -> dict[str, tuple[Any, str]]:
    """LaunchConfig's torchrun fields for Accelerate's launch keys, as ``accelerate launch``
    starts torchrun: on one machine the port only; on several the node rank and the main
    process's address and port (29500 unless given), a static rendezvous unless
    ``rdzv_backend`` names another (then ``--rdzv-endpoint``). ``num_processes`` is left to
    the launcher, which divides it by the nodes.

    Args:
        launch: ``Translation.launch``.
        rdzv_backend: the rendezvous backend given elsewhere (a flag), else the key's.

    Returns:
        LaunchConfig field -> (value, the Accelerate key it comes from).
    """
    fields: dict[str, tuple[Any, str]] = {}
    machines = launch.get("num_machines")
    if machines is not None:
        fields["nnodes"] = (machines, "num_machines")
    if "machine_rank" in launch:
        fields["node_rank"] = (launch["machine_rank"], "machine_rank")
    backend = rdzv_backend or launch.get("rdzv_backend")
    ip, port = launch.get("main_process_ip"), launch.get("main_process_port")
    port_key = "main_process_port" if port is not None else "num_machines"
    if (machines or 1) > 1:
        port = port if port is not None else 29500
        if ip is not None and backend not in (None, "static"):
            fields["rdzv_endpoint"] = (f"{ip}:{port}", "main_process_ip")
            if rdzv_backend is None:
                fields["rdzv_backend"] = (backend, "rdzv_backend")
        elif ip is not None:
            fields["master_addr"] = (ip, "main_process_ip")
            fields["master_port"] = (port, port_key)
    elif port is not None:
        fields["master_port"] = (port, port_key)
    return fields
