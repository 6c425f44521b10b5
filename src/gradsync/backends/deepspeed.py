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
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from gradsync import _torch_compat
from gradsync.backends import (
    _deepspeed_checkpoint,
    _deepspeed_compat,
    _deepspeed_policy,
    _group,
    _modules,
)
from gradsync.backends._amp import WindowScaler
from gradsync.backends._deepspeed_config import (
    build_config,
    check_batch,
    check_precision,
    load_ds_config,
)
from gradsync.backends.base import RequestedPolicy, SyncPolicy, clear_grads, is_frozen
from gradsync.batching import BatchPlan, solve_with_schedule
from gradsync.config import Config
from gradsync.errors import ConfigError

log = logging.getLogger("gradsync")

_INSTALL_HINT = "backend='deepspeed' needs DeepSpeed: pip install 'gradsync[deepspeed]'"


def import_deepspeed() -> Any:
    """The deepspeed module, or a one-line error that says how to install it."""
    try:
        import deepspeed
    except ImportError:
        raise ImportError(_INSTALL_HINT) from None
    return deepspeed


class DeepSpeedBackend:
    name: ClassVar[str] = "deepspeed"
    checkpoint_format: ClassVar[str] = "deepspeed"  # the engine's own checkpoints
    reshardable: ClassVar[bool] = False

    def __init__(self) -> None:
        self.policy: SyncPolicy = "native"
        self.policy_reason = ""
        self.owns_group = False
        self.scaler: WindowScaler | None = None  # DeepSpeed scales fp16 losses itself (its config's fp16 section)
        self._device = torch.device("cpu")
        self._mixed_precision = "no"
        self._checkpointing: Any = None
        self._compile: dict[str, Any] | None = None
        self._ds: dict[str, Any] = {}
        self.stage = 0
        self.engine: Any = None
        # The window's coalesce_grad_reduction() block, open from begin_window until the
        # boundary's backward (or end_window / abort_window) closes it.
        self._coalescing: contextlib.ExitStack | None = None
        self._clip: float | None = None  # gradient_clipping once fixed (config or first clip call)
        self.memory: dict[str, int] = {}

    @property
    def device(self) -> torch.device:
        return self._device

    # -- setup and prepare --------------------------------------------------
    def setup(self, config: Config) -> None:
        if not _group.use_cuda():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import_deepspeed()
        self._mixed_precision = check_precision(config.mixed_precision)
        self._checkpointing = config.activation_checkpointing
        self._compile = _modules.compile_kwargs(config)
        self._ds = load_ds_config(config.deepspeed_config)
        self.stage = int(self._ds.get("zero_optimization", {}).get("stage", 0))
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"deepspeed_config zero_optimization.stage={self.stage} must be 0, 1, 2 or 3")
        self._asked: RequestedPolicy = config.sync_policy
        self._budget = config.memory_budget()
        self.policy, self.policy_reason = _deepspeed_policy.resolve(config.sync_policy, self.stage)
        # A contradicting batch key is reported now, not later at prepare (the first window's
        # k under a schedule: gradsync drives DeepSpeed's boundary itself after that).
        world = _group.rank_info()[1]
        plan, _ = solve_with_schedule(
            data_parallel_size=world, global_batch_size=config.global_batch_size,
            micro_batch_size=config.micro_batch_size,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
        )
        check_batch(self._ds, micro=plan.micro_batch_size, steps=plan.gradient_accumulation_steps,
                    world=world)
        if "gradient_clipping" in self._ds:
            self._clip = float(self._ds["gradient_clipping"])
        # auto may defer on ZeRO 2/3 (decided at prepare): let the self-check count then too.
        self.owns_group = _group.ensure_process_group(
            self.name, want_audit=config.audit, self_check=config.self_check and self.policy != "every_step",
            timeout=config.timeout,
        )
        self._device = _group.local_device()

    def prepare(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, plan: BatchPlan
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
        deepspeed = import_deepspeed()
        if isinstance(model, deepspeed.DeepSpeedEngine):
            _modules.refuse_wrapped(model, self.name, self._checkpointing, self._compile)
            return model, model.optimizer
        if is_frozen(model) and optimizer is None:
            # A reference / teacher model: no engine, kept whole on every rank (see docs).
            model = model.to(self._device)
            _group.broadcast_from_rank0(model)
            return model, None
        if self.engine is not None:
            raise ConfigError(
                "backend='deepspeed' trains one model per Accelerator (one engine); a second "
                "model with trainable parameters was prepared: freeze it (requires_grad=False) "
                "if it is a reference or teacher model, or train it with another backend"
            )
        ds = build_config(self._ds, given_optimizer=optimizer is not None, plan=plan,
                          world=dist.get_world_size(), mixed_precision=self._mixed_precision,
                          cpu=not _group.use_cuda())
        _modules.checkpoint_modules(_torch_compat.uncompiled(model), self._checkpointing)
        if not _group.use_cuda() and os.environ.get("GRADSYNC_DEEPSPEED_BUILD_OPS") != "1":
            import deepspeed.ops as ds_ops

            ds_ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of shm on CPU
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, model_parameters=list(model.parameters()),
            config=ds, dist_init_required=False,
        )
        if self.policy == "defer" and self.stage in (2, 3) and not _deepspeed_compat.can_coalesce(engine):
            raise ConfigError(
                f"sync_policy='defer' on ZeRO stage {self.stage} needs engine.coalesce_grad_reduction() "
                f"for {type(engine.optimizer).__name__}, which deepspeed {deepspeed.__version__} does "
                "not offer (its BF16/FP16 optimizer wrappers cannot coalesce); use "
                "sync_policy='native', or fp32 / a DeepSpeed that supports it (constraints.txt pins 0.19.8)"
            )
        if self._compile is not None and _torch_compat.uncompiled(model) is model:
            kwargs = dict(self._compile)
            engine.compile(**({"backend": kwargs.pop("backend")} if "backend" in kwargs else {}),
                           compile_kwargs=kwargs)
        self.engine = engine
        self._ds = ds
        if self._asked == "auto" and self.stage in (2, 3):
            self.policy, self.policy_reason, self.memory = _deepspeed_policy.decide(
                engine, self.stage, self._budget, self._device, deepspeed.__version__)
        if dist.get_rank() == 0:
            log.info("gradsync deepspeed: sync_policy %s", self.policy_reason)
        return engine, ds_optimizer

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

    def abort_window(self, models: Sequence[torch.nn.Module]) -> None:
        if self.engine is None:
            return
        # Closing the coalesce block reduces what it holds (a collective: every rank aborts
        # together); then everything the window accumulated is dropped, on every stage.
        self._flush()
        _deepspeed_compat.clear_window_gradients(self.engine)

    def _engine(self, model: torch.nn.Module) -> Any:
        if self.engine is None or model is not self.engine:
            raise RuntimeError(
                f"accumulate() got a {type(model).__name__}, not the DeepSpeed engine that "
                "accel.prepare() returned; pass the prepared model: `model = accel.prepare(model, ...)`"
            )
        return self.engine

    def _flush(self) -> None:
        """Close the window's coalesce block: one reduction of the accumulated gradients."""
        if self._coalescing is not None:
            block, self._coalescing = self._coalescing, None
            block.close()
            self.engine.set_gradient_accumulation_boundary(True)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # the engine's module computes in the config's dtype

    def backward(self, loss: torch.Tensor) -> None:
        # gradsync already divided the loss by this window's size.
        self.engine.backward(loss, scale_wrt_gas=False)
        if self.engine.is_gradient_accumulation_boundary():
            self._flush()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        return None  # DeepSpeed unscales fp16 gradients inside step()

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
        self, model: torch.nn.Module, parameters: Iterable[torch.Tensor], max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        if float(norm_type) != 2.0:
            raise ConfigError(
                f"clip_grad_norm_(norm_type={norm_type}) with backend='deepspeed': DeepSpeed "
                "clips by the 2-norm inside step(); use norm_type=2.0"
            )
        self._set_clipping(float(max_norm))
        from deepspeed.utils import safe_get_full_grad

        # The reduced gradients as DeepSpeed holds them before step(); step() clips by this norm.
        total = torch.zeros((), dtype=torch.float64)
        for p in parameters:
            grad = safe_get_full_grad(p)
            if grad is not None:
                total += grad.detach().double().pow(2).sum().cpu()
        return total.sqrt().float()

    def clip_grad_value_(
        self, model: torch.nn.Module, parameters: Iterable[torch.Tensor], clip_value: float
    ) -> None:
        raise ConfigError(
            f"clip_grad_value_({clip_value}) with backend='deepspeed': DeepSpeed keeps the reduced "
            "gradients in its own partitions and clips only by norm inside step(); use "
            "accel.clip_grad_norm_(params, max_norm)"
        )

    def _set_clipping(self, max_norm: float) -> None:
        if self._clip is not None and self._clip > 0 and not math.isclose(self._clip, max_norm):
            raise ConfigError(
                f"clip_grad_norm_(max_norm={max_norm}) contradicts DeepSpeed gradient_clipping="
                f"{self._clip} set earlier; DeepSpeed clips inside step() with one value, so "
                "use the same max_norm every time (or the value in deepspeed_config)"
            )
        if self._clip == max_norm:
            return
        self._clip = max_norm
        _deepspeed_compat.set_clipping(self.engine, max_norm)

    # -- models and state ------------------------------------------------------
    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        model = _torch_compat.uncompiled(model)
        return _torch_compat.uncompiled(model.module if model is self.engine else model)

    def state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """The full fp32 weights on every rank (a collective: call it on all ranks)."""
        from deepspeed.utils import safe_get_full_fp32_param

        module = self.unwrap(model)
        params = dict(module.named_parameters())
        masters = _deepspeed_compat.flat_fp32_masters(self.engine)
        out: dict[str, Any] = {}
        for key, value in module.state_dict(keep_vars=True).items():
            if key in params:
                full = safe_get_full_fp32_param(params[key])
                full = masters.get(id(params[key])) if full is None else full
                out[key] = (full if full is not None else params[key]).detach().float().cpu().clone()
            else:
                out[key] = value.detach().cpu().clone()
        return out

    def barrier(self) -> None:
        dist.barrier()

    def save(self, path: Path, models: Sequence[torch.nn.Module],
             optimizers: Sequence[torch.optim.Optimizer | None], *, window_open: bool) -> None:
        if window_open:
            _deepspeed_checkpoint.refuse_open_window()
        _deepspeed_checkpoint.save(path, self.engine, models)

    def load(self, path: Path, models: Sequence[torch.nn.Module],
             optimizers: Sequence[torch.optim.Optimizer | None], *, window_open: bool) -> None:
        _deepspeed_checkpoint.load(path, self.engine, models)
