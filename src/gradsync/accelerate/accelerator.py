"""``gradsync.accelerate.Accelerator``: Accelerate's ``Accelerator``, keyword for keyword, on
gradsync's core, following Accelerate's rule book where the two differ (``gradsync.rules``):
the loss is divided by ``gradient_accumulation_steps`` in every window, the prepared LR
scheduler steps once per process per update (unless ``split_batches``), loaders deal whole
batches. A script written for Accelerate ends with Accelerate's parameters.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gradsync import _dist as dist
from gradsync.accelerate import _layout
from gradsync.accelerate._names import refuse_member
from gradsync.accelerate.config import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    accelerate_trackers,
    translate,
)
from gradsync.accelerator import Accelerator as _Core
from gradsync.errors import ConfigError, UsageError, naming_collective


class GradientState:
    """Accelerate's ``GradientState`` of one Accelerator: read-only, read when asked."""

    def __init__(self, accel: Accelerator) -> None:
        self._accel = accel

    @classmethod
    def _reset_state(cls) -> None:
        """Nothing to reset: a GradientState belongs to one Accelerator, not to the process."""

    @property
    def sync_gradients(self) -> bool:
        return self._accel.sync_gradients

    @property
    def num_steps(self) -> int:
        return self._accel.gradient_accumulation_steps

    def _iterating(self) -> Any:
        return self._accel._loaders.iterating()

    @property
    def end_of_dataloader(self) -> bool:
        """The loader being iterated yielded its last batch (False between passes)."""
        it = self._iterating()
        return bool(it is not None and it.last)

    @property
    def remainder(self) -> int:
        """The real samples of the last global batch of the loader being iterated, when
        short; -1 when none is being iterated or its last round is not padded."""
        it = self._iterating()
        found = it.owner.dealt_remainder() if it is not None else None
        return -1 if found is None else found

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        return {
            "num_steps": self.num_steps,
            "sync_with_dataloader": self._accel.config.sync_with_dataloader,
        }


class Accelerator(_Core):
    """Accelerate's ``Accelerator`` on gradsync (see the module). It takes Accelerate's
    keywords, and gradsync's settings besides (``backend=``, ``sync_policy=``, ...).

    Raises:
        ConfigError: a keyword gradsync does not take, or a value it cannot follow, in one
            line that says what to use.
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        rng_types: list[str] | None = None,
        log_with: Any = None,
        project_dir: str | os.PathLike[str] | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[Any] | None = None,
        dynamo_backend: Any = None,
        dynamo_plugin: Any = None,
        deepspeed_plugins: Any = None,
        parallelism_config: Any = None,
        **options: Any,
    ) -> None:
        for name, value, fix in (
            (
                "deepspeed_plugin",
                deepspeed_plugin,
                "backend='deepspeed', deepspeed_config=... (or gradsync launch --use_deepspeed)",
            ),
            ("deepspeed_plugins", deepspeed_plugins, "backend='deepspeed', deepspeed_config=..."),
            (
                "fsdp_plugin",
                fsdp_plugin,
                "backend='fsdp' with the fsdp_* settings (or gradsync launch --use_fsdp)",
            ),
            ("torch_tp_plugin", torch_tp_plugin, "FSDP2 (backend='fsdp')"),
            ("megatron_lm_plugin", megatron_lm_plugin, "FSDP2 (backend='fsdp') or DeepSpeed"),
            (
                "dynamo_plugin",
                dynamo_plugin,
                "compile=True or compile={...torch.compile arguments}",
            ),
        ):
            if value is not None:
                raise ConfigError(
                    f"Accelerator({name}=...) is not taken by gradsync.accelerate; use {fix}"
                )
        if parallelism_config is not None:  # read by its sizes (gradsync.mesh)
            options.setdefault("backend", "fsdp")
            if options.setdefault("parallelism", parallelism_config) is not parallelism_config:
                raise ConfigError(
                    "Accelerator got parallelism_config and parallelism; give one of them"
                )
        if not step_scheduler_with_optimizer:
            raise ConfigError(
                "Accelerator(step_scheduler_with_optimizer=False): do not prepare the "
                "scheduler; step it yourself"
            )
        if not device_placement:
            raise ConfigError(
                "Accelerator(device_placement=False) is not supported: prepared models "
                "and batches are placed on accel.device"
            )
        if rng_types not in (None, ["generator"]):
            raise ConfigError(
                f"Accelerator(rng_types={rng_types!r}): gradsync keeps every rank's "
                "loader generator equal itself; leave rng_types unset"
            )
        found = translate(
            split_batches=split_batches,
            cpu=cpu,
            dataloader_config=dataloader_config,
            project_dir=None if project_dir is None else os.fspath(project_dir),
            project_config=project_config,
            gradient_accumulation_steps=gradient_accumulation_steps,
            gradient_accumulation_plugin=gradient_accumulation_plugin,
            kwargs_handlers=kwargs_handlers,
            dynamo_backend=dynamo_backend,
        )
        if found.settings.pop("device", None) == "cpu":
            os.environ["GRADSYNC_DEVICE"] = "cpu"
        self._rules = found.rules
        self.project_configuration = found.project
        for key, value in found.settings.items():
            if options.setdefault(key, value) != value:
                raise ConfigError(
                    f"Accelerator got {key} twice, with different values; give it once"
                )
        super().__init__(
            mixed_precision=mixed_precision,  # type: ignore[arg-type]
            log_with=accelerate_trackers(log_with),
            **options,
        )
        self.gradient_state = GradientState(self)
        self._trigger = False
        self.dataloader_config = dataloader_config or DataLoaderConfiguration(
            split_batches=bool(split_batches)
        )
        # Every checkpoint holds Accelerate's files too (``_layout``), so that Accelerate
        # resumes it; gradsync resumes it from its own files, exactly.
        self._safe_serialization = True
        self._p.state.save_hooks[id(_layout)] = lambda folder: _layout.write(
            self._p, folder, self._safe_serialization
        )

    # -- Accelerate's names for what the core has --------------------------
    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def split_batches(self) -> bool:
        return self._rules.split_batches

    @property
    def even_batches(self) -> bool:
        return self._rules.even_batches

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    @property
    def step(self) -> int:
        """Micro-steps of the window in progress (Accelerate's counter)."""
        return self._window.index

    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> Any:
        return self.prepare(model)

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> Any:
        return self.prepare(optimizer)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        return self.prepare(scheduler)

    def prepare_data_loader(
        self,
        data_loader: Any,
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Any = None,
    ) -> Any:
        return self.prepare(data_loader)

    def set_trigger(self) -> None:
        """Raise this process's flag (``check_trigger`` sees it on every process)."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """Whether any process raised its flag since the last check (a collective: call it
        on every process); the flags are lowered."""
        raised = dist.any_rank(self._trigger, self.device)
        self._trigger = False
        return raised

    def clear(self, *objects: Any) -> list[None]:
        return self.free_memory(*objects)

    @contextlib.contextmanager
    def join_uneven_inputs(
        self, joinables: Any, even_batches: bool | None = None
    ) -> Iterator[None]:
        """Every rank gets the same number of batches already (``even_batches``): nothing to join."""
        yield

    # -- automatic checkpoint naming ------------------------------------------
    def save_state(  # type: ignore[override]
        self,
        output_dir: str | os.PathLike[str] | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> str:
        """Accelerate's ``save_state``: with ``ProjectConfiguration(automatic_checkpoint_naming=
        True)`` and no folder, ``project_dir/checkpoints/checkpoint_{iteration}``, keeping
        ``total_limit`` of them."""
        project = self.project_configuration
        keep_last = save_model_func_kwargs.pop("keep_last", None)
        background = bool(save_model_func_kwargs.pop("background", False))
        if save_model_func_kwargs:
            raise ConfigError(
                f"save_state() got {', '.join(save_model_func_kwargs)}, which gradsync "
                "does not take (models are saved with the checkpoint)"
            )
        if project.automatic_checkpoint_naming:
            if output_dir is None:
                if project.project_dir is None:
                    raise ConfigError(
                        "automatic_checkpoint_naming needs project_dir in the ProjectConfiguration"
                    )
                output_dir = os.path.join(
                    project.project_dir, "checkpoints", f"checkpoint_{project.iteration}"
                )
            keep_last = keep_last if keep_last is not None else project.total_limit
        self._safe_serialization = bool(safe_serialization)
        folder = super().save_state(output_dir, keep_last=keep_last, background=background)
        if project.automatic_checkpoint_naming:
            project.iteration += 1
        return folder

    def load_state(  # type: ignore[override]
        self,
        input_dir: str | os.PathLike[str] | None = None,
        *,
        trusted: bool = False,
        **load_model_func_kwargs: Any,
    ) -> None:
        """Accelerate's ``load_state``: with automatic checkpoint naming and no folder, the
        newest ``checkpoint_{i}``; then the next save is ``checkpoint_{i + 1}``."""
        project = self.project_configuration
        if input_dir is None and project.automatic_checkpoint_naming and project.project_dir:
            root = Path(project.project_dir) / "checkpoints"
            numbered = sorted(
                (int(m.group(1)), p)
                for p in root.glob("checkpoint_*")
                if (m := re.fullmatch(r"checkpoint_(\d+)", p.name))
            )
            if not numbered:
                raise ConfigError(f"load_state(): no checkpoint_N folder under {root}")
            input_dir = numbered[-1][1]
        folder = Path(os.fspath(input_dir)) if input_dir is not None else None
        if folder is not None and _layout.is_accelerate_folder(folder):
            self._load_accelerate_layout(folder, trusted)
        else:
            super().load_state(input_dir, trusted=trusted)
        name = Path(os.fspath(input_dir)).name if input_dir is not None else ""
        if project.automatic_checkpoint_naming and (m := re.fullmatch(r"checkpoint_(\d+)", name)):
            project.iteration = int(m.group(1)) + 1

    def _load_accelerate_layout(self, folder: Path, trusted: bool) -> None:
        """A folder Accelerate's ``save_state`` wrote (see ``_layout``)."""
        if self._window.current is not None:
            raise UsageError(
                "load_state() was called inside `with accel.accumulate(model):`; call it before the loop"
            )
        self.wait_for_checkpoint()
        state = self._p.state

        def before() -> None:
            for hook in list(state.load_hooks.values()):
                hook(folder)

        def then() -> None:
            for after in state.after_load:
                after()

        with naming_collective(f"load_state({str(folder)!r})", self.config.timeout):
            _layout.load(self._p, folder, trusted, before, then)

    def __getattr__(self, name: str) -> Any:
        refuse_member(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
