"""``accelerate launch``'s flags that ``gradsync launch`` takes, each with the key of
Accelerate's config file it stands for, and the flag families it refuses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["FLAGS", "REFUSED_FLAG_PREFIXES", "AcceleratedFlag", "refused_flag"]

TPU = "it is for TPU pods, and gradsync does not run on TPUs"


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


def _f(
    name: str,
    help: str,
    *,
    section: str | None = None,
    key: str | None = None,
    switch: bool = False,
    value: Any = True,
    metavar: str | None = None,
    kind: str = "text",
) -> AcceleratedFlag:
    return AcceleratedFlag(name, section, key or name, switch, help, value, metavar, kind)


_DS, _FSDP, _DYNAMO = "deepspeed_config", "fsdp_config", "dynamo_config"
_PARALLEL = "parallelism_config"
#: The ``accelerate launch`` flags ``gradsync launch`` takes (both spellings), each with the
#: key of Accelerate's file it stands for. The gradsync flags --mixed-precision,
#: --gradient-accumulation-steps and torchrun's (--max-restarts, --rdzv-backend, --tee ...)
#: already have Accelerate's spellings.
FLAGS: tuple[AcceleratedFlag, ...] = (
    _f(
        "num_processes",
        "processes over all machines (Accelerate's total: --nproc-per-node is "
        "this divided by --num_machines)",
        metavar="N",
        kind="int",
    ),
    _f("num_machines", "machines (--nnodes)", metavar="N", kind="int"),
    _f("machine_rank", "this machine's rank (--node-rank)", metavar="R", kind="int"),
    _f("main_process_ip", "address of the machine of rank 0 (--master-addr)", metavar="A"),
    _f("main_process_port", "its port (--master-port; 0: a free one)", metavar="P", kind="int"),
    _f(
        "multi_gpu",
        "data parallel: --backend ddp",
        key="distributed_type",
        switch=True,
        value="MULTI_GPU",
    ),
    _f("use_fsdp", "--backend fsdp (FSDP2)", key="distributed_type", switch=True, value="FSDP"),
    _f(
        "use_deepspeed",
        "--backend deepspeed (ZeRO stage 2 unless --zero_stage or "
        "--deepspeed_config_file says otherwise)",
        key="distributed_type",
        switch=True,
        value="DEEPSPEED",
    ),
    _f(
        "tpu",
        "refused: gradsync does not run on TPUs",
        key="distributed_type",
        switch=True,
        value="XLA",
    ),
    _f(
        "use_megatron_lm",
        "refused: gradsync does not run Megatron-LM",
        key="distributed_type",
        switch=True,
        value="MEGATRON_LM",
    ),
    _f(
        "cpu",
        "train on the CPU even where a GPU is visible (GRADSYNC_DEVICE=cpu)",
        key="use_cpu",
        switch=True,
    ),
    _f("gpu_ids", "the GPUs to use, e.g. 0,1 (CUDA_VISIBLE_DEVICES; default: all)", metavar="IDS"),
    _f("num_cpu_threads_per_process", "OMP_NUM_THREADS of each process", metavar="N", kind="int"),
    _f("same_network", "accepted (the rendezvous is the same either way)", switch=True),
    _f("debug", "ignored, with a warning (gradsync's --audit counts the collectives)", switch=True),
    _f("enable_cpu_affinity", "ignored, with a warning", switch=True),
    _f("downcast_bf16", "ignored, with a warning (TPUs only)", switch=True),
    _f(
        "main_training_function", "ignored, with a warning (notebook launches only)", metavar="NAME"
    ),
    _f(
        "mpirun_hostfile",
        "ignored, with a warning (gradsync starts the processes with torchrun)",
        section="mpirun_config",
        metavar="PATH",
    ),
    _f(
        "dynamo_backend",
        "torch.compile the model with this backend (gradsync's compile setting; no: off)",
        section=_DYNAMO,
        metavar="B",
    ),
    _f("dynamo_mode", "torch.compile's mode", section=_DYNAMO, metavar="MODE"),
    _f("dynamo_use_fullgraph", "torch.compile with fullgraph=True", section=_DYNAMO, switch=True),
    _f("dynamo_use_dynamic", "torch.compile with dynamic=True", section=_DYNAMO, switch=True),
    _f("dynamo_use_regional_compilation", "ignored, with a warning", section=_DYNAMO, switch=True),
    _f(
        "deepspeed_config_file",
        "a DeepSpeed JSON/YAML config (gradsync's deepspeed_config)",
        section=_DS,
        metavar="PATH",
    ),
    _f(
        "zero_stage",
        "ZeRO stage 0-3 (zero_optimization.stage of the DeepSpeed config)",
        section=_DS,
        metavar="N",
        kind="int",
    ),
    _f(
        "offload_optimizer_device",
        "none, cpu or nvme (zero_optimization.offload_optimizer)",
        section=_DS,
        metavar="D",
    ),
    _f(
        "offload_param_device",
        "none, cpu or nvme (zero_optimization.offload_param)",
        section=_DS,
        metavar="D",
    ),
    _f(
        "offload_optimizer_nvme_path",
        "the NVMe path of the optimizer offload",
        section=_DS,
        metavar="PATH",
    ),
    _f(
        "offload_param_nvme_path",
        "the NVMe path of the parameter offload",
        section=_DS,
        metavar="PATH",
    ),
    _f(
        "gradient_clipping", "DeepSpeed's gradient_clipping", section=_DS, metavar="X", kind="float"
    ),
    _f(
        "zero3_init_flag",
        "ignored when true, with a warning (build the model under deepspeed.zero.Init yourself)",
        section=_DS,
        metavar="BOOL",
    ),
    _f(
        "zero3_save_16bit_model",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        section=_DS,
        metavar="BOOL",
    ),
    _f(
        "deepspeed_multinode_launcher",
        "ignored unless 'standard', with a warning",
        section=_DS,
        metavar="L",
    ),
    _f("deepspeed_hostfile", "ignored, with a warning", section=_DS, metavar="PATH"),
    _f("deepspeed_exclusion_filter", "ignored, with a warning", section=_DS, metavar="F"),
    _f("deepspeed_inclusion_filter", "ignored, with a warning", section=_DS, metavar="F"),
    _f("deepspeed_moe_layer_cls_names", "ignored, with a warning", section=_DS, metavar="NAMES"),
    _f("fsdp_version", "2 (gradsync runs FSDP2; 1 is refused)", section=_FSDP, metavar="V"),
    _f(
        "use_parallelism_config",
        "accepted: the parallelism_config flags below say the mesh",
        section=_PARALLEL,
        switch=True,
    ),
    *(
        _f(
            f"parallelism_config_{dim}_size",
            f"the mesh's {dim} size (--parallelism {dim}=N)"
            + (": above 1 needs a GPU (refused)" if dim == "cp" else ""),
            section=_PARALLEL,
            metavar="N",
            kind="int",
        )
        for dim in ("dp_replicate", "dp_shard", "tp", "cp")
    ),
    _f(
        "fsdp_auto_wrap_policy",
        "TRANSFORMER_BASED_WRAP (with the classes below), NO_WRAP; "
        "SIZE_BASED_WRAP is ignored with a warning",
        section=_FSDP,
        metavar="P",
    ),
    _f(
        "fsdp_transformer_layer_cls_to_wrap",
        "class names sharded as their own unit (gradsync's fsdp_wrap), e.g. LlamaDecoderLayer",
        section=_FSDP,
        metavar="NAMES",
    ),
    _f("fsdp_min_num_params", "ignored (gradsync wraps by class)", section=_FSDP, metavar="N"),
    _f(
        "fsdp_reshard_after_forward",
        "true (false is ignored with a warning)",
        section=_FSDP,
        metavar="BOOL",
    ),
    _f(
        "fsdp_sharding_strategy",
        "FULL_SHARD (SHARD_GRAD_OP is ignored with a warning; others are refused)",
        section=_FSDP,
        metavar="S",
    ),
    _f(
        "fsdp_activation_checkpointing",
        "true: recompute the wrapped classes' forward (gradsync's activation_checkpointing)",
        section=_FSDP,
        metavar="BOOL",
    ),
    _f("fsdp_offload_params", "ignored when true, with a warning", section=_FSDP, metavar="BOOL"),
    _f(
        "fsdp_state_dict_type",
        "SHARDED_STATE_DICT or FULL_STATE_DICT: the Accelerate layout save_state writes",
        section=_FSDP,
        metavar="T",
    ),
    _f(
        "fsdp_backward_prefetch", "ignored, with a warning (FSDP1 only)", section=_FSDP, metavar="P"
    ),
    _f("fsdp_forward_prefetch", "ignored when true, with a warning", section=_FSDP, metavar="BOOL"),
    _f(
        "fsdp_use_orig_params",
        "ignored when false, with a warning (FSDP2 keeps them)",
        section=_FSDP,
        metavar="BOOL",
    ),
    _f(
        "fsdp_cpu_ram_efficient_loading",
        "accepted (every rank starts from rank 0's weights)",
        section=_FSDP,
        metavar="BOOL",
    ),
    _f(
        "fsdp_sync_module_states",
        "accepted when true (gradsync always starts every rank from rank 0's weights)",
        section=_FSDP,
        metavar="BOOL",
    ),
    _f(
        "fsdp_activation_checkpointing_offload",
        "ignored when true, with a warning",
        section=_FSDP,
        metavar="BOOL",
    ),
)
FLAGS_BY_NAME = {f.name: f for f in FLAGS}

#: Families of ``accelerate launch`` flags ``gradsync launch`` refuses, by prefix: why.
REFUSED_FLAG_PREFIXES: dict[str, str] = {
    "megatron_lm_": "gradsync does not run Megatron-LM",
    "fp8_": "gradsync has no fp8 training (use --mixed-precision bf16)",
    "parallelism_config_sp_": "gradsync has no sequence parallel; its mesh is dp_replicate x "
    "dp_shard x tp (--parallelism_config_*_size)",
    "tpu_cluster": TPU,
    "no_tpu_cluster": TPU,
    "tpu_use_sudo": TPU,
    "vm": TPU,
    "env": TPU,
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
