"""The top-level keys that choose the backend and say how to start the processes
(``distributed_type``, ``num_processes``, ``num_machines`` ...), ``parallelism_config``, and
the torchrun fields ``accelerate launch`` would give torchrun for them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradsync.accelerate._compat.keys import Source, Translation, boolean, whole
from gradsync.errors import ConfigError

#: distributed_type -> gradsync's backend.
BACKENDS = {
    "NO": "single",
    "MULTI_CPU": "ddp",
    "MULTI_GPU": "ddp",
    "FSDP": "fsdp",
    "DEEPSPEED": "deepspeed",
}
#: distributed_type values gradsync refuses: why, and what to use.
_REFUSED = {
    "XLA": "gradsync does not run on TPUs (XLA); use MULTI_GPU or FSDP on GPUs",
    "MEGATRON_LM": "gradsync does not run Megatron-LM; use FSDP or DEEPSPEED for a model that "
    "needs sharding",
    **{
        name: "gradsync runs on CUDA GPUs and CPUs; use MULTI_GPU or MULTI_CPU"
        for name in (
            "MULTI_NPU",
            "MULTI_MLU",
            "MULTI_SDAA",
            "MULTI_MUSA",
            "MULTI_XPU",
            "MULTI_HPU",
            "MULTI_NEURON",
        )
    },
}
#: The whole-number launch keys: (lowest, highest). num_processes' -1 and main_process_port's
#: 0 are Accelerate's "not set" and "a free port": gradsync's defaults.
_NUMBERS: dict[str, tuple[int, int | None]] = {
    "num_processes": (-1, None),
    "num_machines": (1, None),
    "machine_rank": (0, None),
    "main_process_port": (0, 65535),
    "num_cpu_threads_per_process": (1, None),
}
_UNSET = (("num_processes", -1), ("main_process_port", 0))
#: The text launch keys, and their values that are gradsync's default.
_TEXTS: dict[str, tuple[str, ...]] = {
    "main_process_ip": (),
    "rdzv_backend": ("static",),
    "gpu_ids": ("all",),
}


def translate(data: Mapping[str, Any], src: Source, out: Translation) -> None:
    """The backend and the launch keys into ``out``.

    Args:
        data: the file's mapping.
        src: names the keys in messages.
        out: receives the backend setting, the launch options and notes.

    Raises:
        ConfigError: a distributed_type gradsync does not run, or a bad number.
    """
    kind = data.get("distributed_type")
    if kind is not None:
        item = src.item(None, "distributed_type", kind)
        name = str(kind).upper()
        if name in _REFUSED:
            raise ConfigError(f"{item}: {_REFUSED[name]}")
        if name not in BACKENDS:
            raise ConfigError(f"{item} is unknown; use NO, MULTI_CPU, MULTI_GPU, FSDP or DEEPSPEED")
        out.set("backend", BACKENDS[name], item)
    for key, (low, high) in _NUMBERS.items():
        value = data.get(key)
        if value is None:
            continue
        item = src.item(None, key, value)
        number = whole(value, item, low, high, shown=1 if key == "num_processes" else None)
        if key == "num_processes" and number == 0:
            raise ConfigError(f"{item} must be a whole number >= 1")
        if (key, number) not in _UNSET:
            out.launch[key] = number
            out.origins[key] = item
    for key, silent in _TEXTS.items():
        value = data.get(key)
        if value is not None and str(value).strip() and str(value) not in silent:
            out.launch[key] = str(value).strip()
            out.origins[key] = src.item(None, key, value)
    if "use_cpu" in data and boolean(data["use_cpu"], src.item(None, "use_cpu", data["use_cpu"])):
        out.launch["use_cpu"] = True
        out.origins["use_cpu"] = src.item(None, "use_cpu", data["use_cpu"])
        processes = out.launch.get("num_processes", 1)
        if processes > 1 and not str(data.get("distributed_type", "")).startswith("MULTI_"):
            out.notes.append(
                f"{out.origins['use_cpu']} with {out.origins['num_processes']}: gradsync starts "
                f"{processes} processes on the CPU, where accelerate launch would start one (it "
                f"needs --multi_gpu with ACCELERATE_USE_CPU=1 for {processes})"
            )
    machines = out.launch.get("num_machines", 1)
    if machines > 1 and out.launch.get("machine_rank", 0) >= machines:
        raise ConfigError(f"{out.origins['machine_rank']} must be below num_machines={machines}")


#: ``parallelism_config``'s sizes gradsync's ``parallelism`` setting has (gradsync.mesh).
_MESH_SIZES = {
    f"parallelism_config_{dim}_size": dim for dim in ("dp_replicate", "dp_shard", "tp", "cp")
}


def parallelism(keys: Mapping[str, Any], src: Source, out: Translation) -> None:
    """``parallelism_config``'s sizes as the ``parallelism`` setting (dp_replicate x dp_shard
    x tp; a size not given is 1, as in Accelerate's ParallelismConfig); nothing when every
    size is 1. Its other keys (cp_comm_strategy ...) say how a dim runs: accepted.

    Args:
        keys: the section (its keys' ``parallelism_config_`` prefix restored).
        src: names the keys in messages.
        out: receives the setting.

    Raises:
        ConfigError: a size that is not a whole number, context parallel above 1 (it needs a
            GPU), or another parallelism (sequence parallel ...) above 1.
    """
    sizes: dict[str, int] = {}
    origins: list[str] = []
    for key, value in keys.items():
        if not key.endswith("_size") or value is None:
            continue
        item = src.item("parallelism_config", key, value)
        size = whole(value, item, -1)
        if key not in _MESH_SIZES:
            if size > 1:
                raise ConfigError(
                    f"{item}: gradsync's mesh has dp_replicate, dp_shard and tp "
                    "(FSDP2 with tensor parallel); drop it or set it to 1"
                )
            continue
        if _MESH_SIZES[key] == "cp" and size > 1:
            raise ConfigError(
                f"{item}: context parallel needs a GPU (CUDA): torch's "
                "context_parallel has no CPU attention kernel; set it to 1"
            )
        sizes[_MESH_SIZES[key]] = size
        origins.append(item)
    if any(n != 1 for n in sizes.values()):
        out.set(
            "parallelism",
            {dim: sizes.get(dim, 1) for dim in ("dp_replicate", "dp_shard", "tp")},
            ", ".join(origins),
        )


def torchrun_fields(
    launch: Mapping[str, Any], rdzv_backend: str | None = None
) -> dict[str, tuple[Any, str]]:
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
