"""Every name an Accelerate script imports or reads, and what ``gradsync.accelerate`` makes
of it: the same name with Accelerate's meaning, or one line that says what to use. The
migration guide's table is generated from these tables (``docs/hooks.py``)."""

from __future__ import annotations

#: module -> name -> what it is in gradsync.accelerate (Accelerate's meaning unless said)
SUPPORTED: dict[str, dict[str, str]] = {
    "accelerate": {
        "Accelerator": "Accelerate's rule book where gradsync's differs: the loss divided by "
        "k in every window, the scheduler stepped once per process, whole batches dealt",
        "PartialState": "read when asked (no shared singleton); `wait_for_everyone` and "
        "`main_process_first` create the process group an Accelerator then joins",
        "DistributedType": "the same members, equal to Accelerate's (`TPU` kept as `XLA`'s old name)",
        "DataLoaderConfiguration": "`split_batches`, `even_batches`, `use_seedable_sampler`, "
        "`data_seed`; `dispatch_batches` and `use_stateful_dataloader` refused",
        "DistributedDataParallelKwargs": "becomes `ddp_kwargs`; its `comm_hook`, `comm_wrapper` and "
        "`comm_state_option` become the settings of those names (fp16/bf16 also on FSDP2 and "
        "DeepSpeed, PowerSGD on DDP only); Accelerate's own kwargs handler classes are read too",
        "DDPCommunicationHookType": "the values of `comm_hook` and `comm_wrapper`",
        "InitProcessGroupKwargs": "its `timeout` becomes `timeout`",
        "GradScalerKwargs": "becomes `grad_scaler`",
        "AutocastKwargs": "accepted; autocast follows `mixed_precision`",
        "find_executable_batch_size": "the ranks agree on each retry (90 % steps, or `reduce_batch_size_fn`)",
        "skip_first_batches": "after `load_state` it never skips twice",
    },
    "accelerate.utils": {
        "set_seed": "",
        "gather": "",
        "gather_object": "",
        "broadcast": "",
        "broadcast_object_list": "",
        "reduce": "",
        "pad_across_processes": "",
        "send_to_device": "",
        "tqdm": "on the local main process only (`main_process_only`)",
        "find_executable_batch_size": "as above",
        "LoggerType": "",
        "PrecisionType": "",
        "DistributedType": "as above",
        "ProjectConfiguration": "`project_dir`, `logging_dir`, `automatic_checkpoint_naming`, `total_limit`",
        "DataLoaderConfiguration": "as above",
        "GradientAccumulationPlugin": "`num_steps`, `sync_with_dataloader`; `sync_each_batch` is "
        "`sync_policy='every_step'`",
        "DistributedDataParallelKwargs": "as above",
        "DDPCommunicationHookType": "as above",
        "InitProcessGroupKwargs": "as above",
        "GradScalerKwargs": "as above",
        "AutocastKwargs": "as above",
        "release_memory": "",
        "extract_model_from_parallel": "",
        "wait_for_everyone": "",
        "patch_environment": "",
        "check_os_kernel": "does nothing",
        "is_tensorboard_available": "",
        "is_wandb_available": "",
        "is_mlflow_available": "",
        "is_deepspeed_available": "",
    },
    "accelerate.logging": {
        "get_logger": "`main_process_only=` (default True) and `in_order=`; needs no state first",
    },
    "accelerate.state": {
        "PartialState": "as above",
        "AcceleratorState": "as `PartialState`; `accelerator.state` gives one run's settings",
        "GradientState": "`accelerator.gradient_state` (`sync_gradients`, `end_of_dataloader`, `remainder`)",
    },
    "accelerate.data_loader": {"skip_first_batches": "as above"},
    "accelerate.local_sgd": {
        "LocalSGD": "the gradient sync off inside its block (DDP), the parameters averaged every "
        "`local_sgd_steps` calls of `step()` and when the block ends; the self-check knows the "
        "sync is off on purpose",
    },
}

#: Accelerator members whose meaning differs, or that exist in gradsync.accelerate only
MEMBERS: dict[str, str] = {
    "state": "`accelerator.state` (`num_processes`, `distributed_type`, `deepspeed_plugin`, ...)",
    "distributed_type": "`MULTI_CPU` / `MULTI_GPU` / `FSDP` / `DEEPSPEED` / `NO`; also on `gradsync.Accelerator`",
    "save_state": "with automatic checkpoint naming, `checkpoints/checkpoint_{i}` and `total_limit`",
    "load_state": "also puts every prepared loader where the checkpoint was saved",
    "skip_first_batches": "after `load_state`: the restored count is a no-op, another is one warning",
    "gradient_state": "a view of the window; `_set_sync_gradients(flag)` declares whether the "
    "next micro-batch closes it (Transformers' Trainer, which accumulates by itself)",
    "set_trigger / check_trigger": "one small all-reduce in `check_trigger`",
    "prepare_model / prepare_optimizer / prepare_data_loader / prepare_scheduler": "`prepare(obj)`",
    "clip_grad_norm_": "a no-op (None) off the boundary, as in `gradsync.Accelerator`",
}

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
        "prepare_pippy": "`gradsync.Accelerator(backend='fsdp', parallelism={'pp': P, ...}, pp_split=[...])` and `loss = accel.pipeline_step(model, inputs, targets, loss_fn)`",
        "synchronize_rng_states": "nothing to call: prepared loaders keep every rank's generator equal",
        "DeepSpeedPlugin": "`Accelerator(backend='deepspeed', deepspeed_config=...)` or `gradsync launch --use_deepspeed`",
        "FullyShardedDataParallelPlugin": "`Accelerator(backend='fsdp', fsdp_...=...)` or `gradsync launch --use_fsdp`",
        "ParallelismConfig": "`parallelism={'pp': P, 'dp_replicate': R, 'dp_shard': S, 'tp': T}` on `backend='fsdp'` (gradsync.Accelerator also takes Accelerate's ParallelismConfig object there, which has no pp)",
        "ProfileKwargs": "`torch.profiler.profile(...)` around the loop",
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
    "verify_device_map": "big-model inference is not gradsync's: use Accelerate for it",
    "deepspeed_engine_wrapped": "`accel.unwrap_model(model)` is the DeepSpeed engine's module",
    "fp8_backend": "fp8 is not supported; use mixed_precision='bf16'",
    "torch_device_mesh": "`accel.mesh` (FSDP2's DeviceMesh)",
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
        raise AttributeError(
            f"gradsync.accelerate.Accelerator has no {name} (Accelerate's "
            f"Accelerator.{name}): {fix}"
        )


def table_markdown() -> str:
    """The migration guide's table: every name above, where it is, and what it is."""
    rows = ["| Accelerate | gradsync | status |", "|---|---|---|"]
    for module, names in SUPPORTED.items():
        ours = "gradsync." + module
        for name, note in names.items():
            rows.append(
                f"| `{module}.{name}` | `{ours}.{name}` | the same{'; ' + note if note else ''} |"
            )
    for module, refused in REFUSED.items():
        for name, fix in refused.items():
            rows.append(f"| `{module}.{name}` | refused in one line | use {fix} |")
    rows += ["", "| `Accelerator` member | in gradsync.accelerate |", "|---|---|"]
    rows += [f"| `{name}` | {note} |" for name, note in MEMBERS.items()]
    rows += [f"| `{name}` | refused in one line: {fix} |" for name, fix in REFUSED_MEMBERS.items()]
    return "\n".join(rows)
