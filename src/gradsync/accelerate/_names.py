"""Every name an Accelerate script imports or reads, and what ``gradsync.accelerate`` makes
of it: the same name with Accelerate's meaning, or one line that says what to use. The
migration guide's table is generated from these tables (``docs/hooks.py``)."""

from __future__ import annotations

#: module -> name -> what to use instead (an Accelerate name gradsync.accelerate lacks)
REFUSED: dict[str, dict[str, str]] = {
    "accelerate": {
        "notebook_launcher": "launch with `gradsync launch --nproc-per-node N script.py`",
        "debug_launcher": "launch with `gradsync launch --nproc-per-node 2 script.py` on the CPU",
        "init_empty_weights": "build the model on the meta device with `torch.device('meta')` yourself",
        "init_on_device": "`with torch.device(...)` builds a model on a device",
        "load_checkpoint_and_dispatch": "big-model inference is not gradsync's: use Accelerate for it",
        "dispatch_model": "big-model inference is not gradsync's: use Accelerate for it",
        "infer_auto_device_map": "big-model inference is not gradsync's: use Accelerate for it",
        "cpu_offload": "DeepSpeed ZeRO offload (`deepspeed_config`) or FSDP2 CPU offload",
        "cpu_offload_with_hook": "big-model inference is not gradsync's: use Accelerate for it",
        "disk_offload": "big-model inference is not gradsync's: use Accelerate for it",
        "load_checkpoint_in_model": "`accel.load_state(folder)`, or `from_pretrained` for a saved model",
        "prepare_pippy": "pipeline parallelism is not supported; use FSDP2 (`backend='fsdp'`)",
        "synchronize_rng_states": "nothing to call: prepared loaders keep every rank's generator equal",
        "DeepSpeedPlugin": "`Accelerator(backend='deepspeed', deepspeed_config=...)` or `gradsync launch --use_deepspeed`",
        "FullyShardedDataParallelPlugin": "`Accelerator(backend='fsdp', fsdp_...=...)` or `gradsync launch --use_fsdp`",
        "ParallelismConfig": "`fsdp_mesh=(replicas, shards)` on `backend='fsdp'`",
        "ProfileKwargs": "`torch.profiler.profile(...)` around the loop",
        "DDPCommunicationHookType": "register a communication hook on the prepared DDP model yourself",
    },
    "accelerate.utils": {
        "DummyOptim": "build the torch optimizer, or give DeepSpeed's optimizer in `deepspeed_config`",
        "DummyScheduler": "build the torch scheduler, or give DeepSpeed's scheduler in `deepspeed_config`",
        "MegatronLMDummyScheduler": "Megatron-LM is not supported; use FSDP2 (`backend='fsdp'`)",
        "DeepSpeedPlugin": "`Accelerator(backend='deepspeed', deepspeed_config=...)`",
        "FullyShardedDataParallelPlugin": "`Accelerator(backend='fsdp', fsdp_...=...)`",
        "TorchDynamoPlugin": "`Accelerator(compile=True)` or `dynamo_backend=`",
        "write_basic_config": "`gradsync launch` needs no config file; flags or `--config_file` work",
        "merge_fsdp_weights": "`accel.save_model(model, folder)` writes full weights under FSDP2",
        "ProfileKwargs": "`torch.profiler.profile(...)` around the loop",
        "FP8RecipeKwargs": "fp8 is not supported; use mixed_precision='bf16'",
        "TERecipeKwargs": "fp8 is not supported; use mixed_precision='bf16'",
        "synchronize_rng_states": "nothing to call: prepared loaders keep every rank's generator equal",
        "load_checkpoint_in_model": "`accel.load_state(folder)`, or `from_pretrained` for a saved model",
    },
}

#: Accelerator members Accelerate has and gradsync.accelerate lacks -> what to use instead
REFUSED_MEMBERS: dict[str, str] = {
    "lomo_backward": "LOMO optimizers are not supported; use a torch optimizer",
    "profile": "`torch.profiler.profile(...)` around the loop",
    "prepare_pippy": "pipeline parallelism is not supported; use FSDP2 (`backend='fsdp'`)",
    "verify_device_map": "big-model inference is not gradsync's: use Accelerate for it",
    "deepspeed_engine_wrapped": "`accel.unwrap_model(model)` is the DeepSpeed engine's module",
    "fp8_backend": "fp8 is not supported; use mixed_precision='bf16'",
    "torch_device_mesh": "`accel.mesh` (FSDP2's DeviceMesh)",
    "state_dict_type": "`accel.get_state_dict(model)` returns the full state dict",
}


def refuse(module: str, name: str) -> None:
    """The one-line ImportError for an Accelerate name ``module`` lacks (None when ``name``
    is not one)."""
    fix = REFUSED.get(module, {}).get(name)
    if fix is not None:
        spelled = "gradsync." + module if module != "accelerate" else "gradsync.accelerate"
        raise ImportError(f"{spelled} has no {name} (Accelerate's {module}.{name}): {fix}")
    return None


def refuse_member(name: str) -> None:
    """The one-line AttributeError for an Accelerator member gradsync lacks."""
    fix = REFUSED_MEMBERS.get(name)
    if fix is not None:
        raise AttributeError(f"gradsync.accelerate.Accelerator has no {name} (Accelerate's "
                             f"Accelerator.{name}): {fix}")
