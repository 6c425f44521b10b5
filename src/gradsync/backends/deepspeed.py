"""DeepSpeed (ZeRO 0-3): DeepSpeed accumulates natively; gradsync drives the boundary.

gradsync's window decides the boundary (``engine.set_gradient_accumulation_boundary``),
scales the loss itself (``engine.backward(loss, scale_wrt_gas=False)``) and calls
``engine.step()`` only at the boundary. The DeepSpeed config's batch sizes are filled from
gradsync's plan; a contradiction is a ConfigError. ``sync_policy="auto"`` coalesces ZeRO 2/3's
per-micro-step reduction into one per window when the window's gradients fit the memory
budget. See docs/deepspeed.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from gradsync._plan.batch_plan import BatchPlan
from gradsync._support import dist
from gradsync._support import torch_compat as _torch_compat
from gradsync.backends import (
    _compression,
    _deepspeed_checkpoint,
    _deepspeed_compat,
    _deepspeed_policy,
    _group,
    _modules,
)
from gradsync.backends._deepspeed_clip import Clipping, global_norm, refuse_clip_by_value
from gradsync.backends._deepspeed_config import (
    build_config,
    check_hpz,
    check_precision,
    check_removed_keys,
    check_setup_batch,
    fill_communication,
    load_ds_config,
)
from gradsync.backends.base import (
    AdapterDefaults,
    Held,
    RequestedPolicy,
    clear_grads,
    is_frozen,
    not_prepared,
    single_optimizer,
)
from gradsync.config import Config
from gradsync.errors import CheckpointError, ConfigError

log = logging.getLogger("gradsync")

_INSTALL_HINT = "backend='deepspeed' needs DeepSpeed: pip install 'gradsync[deepspeed]'"


def import_deepspeed() -> Any:
    """The deepspeed module, or a one-line error that says how to install it."""
    try:
        import deepspeed
    except ImportError:
        raise ImportError(_INSTALL_HINT) from None
    return deepspeed


class DeepSpeedBackend(AdapterDefaults):
    """The engine owns gradients, loss scaling and clipping: ``scaler`` stays None (DeepSpeed
    scales fp16 losses itself, from its config's fp16 section, and unscales them inside
    ``step()``), so the defaults' ``unscale_`` does nothing; ``barrier`` is the default."""

    name: ClassVar[str] = "deepspeed"
    checkpoint_format: str = "deepspeed"  # the engine's own checkpoints
    accelerate_layout: str = "engine_tag"  # the engine's own, tagged pytorch_model
    reshardable: ClassVar[bool] = False
    checkpoint_globals: ClassVar[frozenset[str]] = _deepspeed_compat.CHECKPOINT_GLOBALS

    def __init__(self) -> None:
        super().__init__()
        self.policy = "native"
        self._mixed_precision = "no"
        self._ds: dict[str, Any] = {}
        self.stage = 0
        self.engine: Any = None
        # The window's coalesce_grad_reduction() block, open from begin_window until the
        # boundary's backward (or end_window / abort_window) closes it.
        self._coalescing: contextlib.ExitStack | None = None
        self._clipping = Clipping({})  # gradient_clipping: the config's, or the first clip call's
        self.memory: dict[str, int] = {}

    # -- setup and prepare --------------------------------------------------
    @property
    def ds_config(self) -> dict[str, Any]:
        """The DeepSpeed config in use (``accel.deepspeed_plugin.deepspeed_config``)."""
        return self._ds

    def setup(self, config: Config) -> None:
        if not _group.use_cuda():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import_deepspeed()
        self._mixed_precision = check_precision(config.mixed_precision)
        self._checkpointing = config.activation_checkpointing
        self._compile = _modules.compile_kwargs(config)
        hook = _compression.supported(
            config, self.name, ("fp16", "bf16"), "communication_data_type"
        )
        _compression.half_dtype(hook, _group.local_device())
        self._ds = fill_communication(load_ds_config(config.deepspeed_config), hook)
        self.stage = int(self._ds.get("zero_optimization", {}).get("stage", 0))
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(
                f"deepspeed_config zero_optimization.stage={self.stage} must be 0, 1, 2 or 3"
            )
        check_removed_keys(self._ds)
        check_hpz(self._ds, self.stage, dist.world_size())
        self._asked: RequestedPolicy = config.sync_policy
        self._budget = config.memory_budget()
        self.policy, self.policy_reason = _deepspeed_policy.resolve(config.sync_policy, self.stage)
        check_setup_batch(self._ds, config, dist.world_size())
        self._clipping = Clipping(self._ds)
        # auto may defer on ZeRO 2/3 (decided at prepare): let the self-check count then too.
        self.owns_group = _group.ensure_process_group(
            self.name,
            want_audit=config.audit,
            self_check=config.self_check and self.policy != "every_step",
            timeout=config.timeout,
        )
        self._device = _group.local_device()

    def prepare(
        self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], plan: BatchPlan
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        deepspeed = import_deepspeed()
        optimizer = single_optimizer(
            self.name, model, optimizers, "one engine holds one model and its optimizer"
        )
        if isinstance(model, deepspeed.DeepSpeedEngine):
            _modules.refuse_wrapped(model, self.name, self._checkpointing, self._compile)
            return model, [model.optimizer] if model.optimizer is not None else []
        if is_frozen(model) and optimizer is None:
            # A reference / teacher model: no engine, kept whole on every rank (see docs).
            model = model.to(self._device)
            _group.broadcast_from_rank0(model)
            return model, []
        if self.engine is not None:
            raise ConfigError(
                "backend='deepspeed' trains one model per Accelerator (one engine); a second "
                "model with trainable parameters was prepared: freeze it (requires_grad=False) "
                "if it is a reference or teacher model, or train it with another backend"
            )
        ds = build_config(
            self._ds,
            given_optimizer=optimizer is not None,
            plan=plan,
            world=dist.world_size(),
            mixed_precision=self._mixed_precision,
            cpu=not _group.use_cuda(),
        )
        _modules.checkpoint_modules(_torch_compat.uncompiled(model), self._checkpointing)
        if not _group.use_cuda() and os.environ.get("GRADSYNC_DEEPSPEED_BUILD_OPS") != "1":
            import deepspeed.ops as ds_ops

            ds_ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of shm on CPU
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=list(model.parameters()),
            config=ds,
            dist_init_required=False,
        )
        if (
            self.policy == "defer"
            and self.stage in (2, 3)
            and not _deepspeed_compat.can_coalesce(engine)
        ):
            raise ConfigError(
                f"sync_policy='defer' on ZeRO stage {self.stage} needs engine.coalesce_grad_reduction() "
                f"for {type(engine.optimizer).__name__}, which deepspeed {deepspeed.__version__} does "
                "not offer (its BF16/FP16 optimizer wrappers cannot coalesce); use "
                "sync_policy='native', or fp32 / a DeepSpeed that supports it (constraints.txt pins 0.19.8)"
            )
        if self._compile is not None and _torch_compat.uncompiled(model) is model:
            kwargs = dict(self._compile)
            engine.compile(
                **({"backend": kwargs.pop("backend")} if "backend" in kwargs else {}),
                compile_kwargs=kwargs,
            )
        self.engine = engine
        self._ds = ds
        if self._asked == "auto" and self.stage in (2, 3):
            self.policy, self.policy_reason, self.memory = _deepspeed_policy.decide(
                engine, self.stage, self._budget, self._device, deepspeed.__version__
            )
        if dist.rank() == 0:
            log.info("gradsync deepspeed: sync_policy %s", self.policy_reason)
        return engine, [ds_optimizer] if ds_optimizer is not None else []

    def attach(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> torch.optim.Optimizer:
        raise ConfigError(
            f"backend={self.name!r} got the {type(optimizer).__name__} in a later prepare() call "
            "than its model (DeepSpeed builds its engine from the model and its optimizer together); prepare both in one call: "
            "`model, optimizer = accel.prepare(model, optimizer)`"
        )

    # -- the window -------------------------------------------------------------
    def begin_window(self, models: Sequence[torch.nn.Module]) -> None:
        clear_grads(models)  # the module's own; engine.step() cleared ZeRO's
        if self.policy == "defer" and self.stage in (2, 3):
            # One coalesce block per window: DeepSpeed's flush overwrites, so it must not split.
            stack = contextlib.ExitStack()
            stack.enter_context(self._engine(self.engine).coalesce_grad_reduction())
            self._coalescing = stack

    @contextlib.contextmanager
    def micro_step(self, model: torch.nn.Module, *, boundary: bool) -> Iterator[None]:
        if model is not self.engine and is_frozen(model):  # a prepared reference model
            yield
            return
        engine = self._engine(_torch_compat.uncompiled(model))
        prior = bool(engine.is_gradient_accumulation_boundary())
        engine.set_gradient_accumulation_boundary(boundary)
        try:
            yield
        finally:
            engine.set_gradient_accumulation_boundary(prior)  # step() sets its own boundary

    def end_window(self, models: Sequence[torch.nn.Module]) -> None:
        self._flush()

    def oom_split_refusal(self) -> str | None:
        return (
            "DeepSpeed builds the micro-batch into its engine (train_micro_batch_size_per_gpu) "
            "and counts its own accumulation steps, which cannot change during a run; set "
            "on_oom='raise' with backend='deepspeed'"
        )

    def abort_window(self, models: Sequence[torch.nn.Module]) -> None:
        if self.engine is None:
            return
        # Closing the coalesce block reduces what it holds (a collective: every rank aborts
        # together); then everything the window accumulated is dropped, on every stage.
        self._flush()
        _deepspeed_compat.clear_window_gradients(self.engine)

    def _engine(self, model: torch.nn.Module) -> Any:
        if self.engine is None or model is not self.engine:
            raise not_prepared(model, "DeepSpeed engine", fix="`model = accel.prepare(model, ...)`")
        return self.engine

    def _flush(self) -> None:
        """Close the window's coalesce block: one reduction of the accumulated gradients."""
        if self._coalescing is not None:
            block, self._coalescing = self._coalescing, None
            block.close()
            self.engine.set_gradient_accumulation_boundary(True)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # the engine's module computes in the config's dtype

    def backward(self, loss: torch.Tensor, factor: float = 1.0, **kwargs: Any) -> None:
        # gradsync's own scaling (1 / this window's size), not DeepSpeed's.
        self.engine.backward(
            loss * factor if factor != 1.0 else loss, scale_wrt_gas=False, **kwargs
        )
        if self.engine.is_gradient_accumulation_boundary():
            self._flush()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        # Called only at a boundary, inside the accumulate block or after it (where the
        # engine's flag is back to its prior value), so the step sets the boundary itself.
        self._flush()
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        return bool(self.engine.was_step_applied())

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        # engine.step() clears the gradients on every stage (applied or skipped); nothing to do.
        return None

    def clip_grad_norm_(
        self,
        model: torch.nn.Module,
        parameters: Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        self._clipping.set(self.engine, max_norm, norm_type)
        return global_norm(parameters)  # the norm step() clips by

    def clip_grad_value_(
        self, model: torch.nn.Module, parameters: Iterable[torch.Tensor], clip_value: float
    ) -> None:
        raise refuse_clip_by_value(clip_value)

    # -- models and state ------------------------------------------------------
    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        model = _torch_compat.uncompiled(model)
        return _torch_compat.uncompiled(model.module if model is self.engine else model)

    def state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """The full fp32 weights on every rank (a collective: call it on all ranks)."""
        return _deepspeed_checkpoint.full_weights(self.engine, self.unwrap(model))

    def save(
        self,
        path: Path,
        models: Sequence[torch.nn.Module],
        optimizers: Sequence[Held],
        *,
        window_open: bool,
    ) -> None:
        if window_open:
            _deepspeed_checkpoint.refuse_open_window()
        _deepspeed_checkpoint.save(path, self.engine, models)

    def load(
        self,
        path: Path,
        models: Sequence[torch.nn.Module],
        optimizers: Sequence[Held],
        *,
        window_open: bool,
        trusted: bool = False,
    ) -> None:
        _deepspeed_checkpoint.load(path, self.engine, models, trusted=trusted)

    def save_accelerate(
        self, path: Path, models: Sequence[torch.nn.Module], optimizers: Sequence[Held]
    ) -> None:
        if any(model is not self.engine for model in models):
            raise CheckpointError(
                "Accelerate's DeepSpeed layout holds the engine's model only; this run "
                "prepared a model outside it"
            )
        _deepspeed_checkpoint.save_accelerate(path, self.engine)

    def load_accelerate(
        self,
        path: Path,
        models: Sequence[torch.nn.Module],
        optimizers: Sequence[Held],
        *,
        trusted: bool = False,
    ) -> None:
        _deepspeed_checkpoint.load_accelerate(path, self.engine, trusted=trusted)
