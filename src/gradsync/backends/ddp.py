"""DistributedDataParallel: ``no_sync()`` around forward and backward off the boundary. With
``parallelism={"pp": P, "dp_replicate": R}`` each rank's pipeline stage is the DDP model
(``_ddp_pipeline``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync._plan.batch_plan import BatchPlan
from gradsync._support import dist
from gradsync._support import torch_compat as _torch_compat
from gradsync.backends import (
    _amp,
    _ddp_comm,
    _ddp_compat,
    _ddp_pipeline,
    _fsdp_checkpoint,
    _group,
    _modules,
    _pipeline,
    _plain_state,
)
from gradsync.backends.base import AdapterDefaults, Held, is_frozen, not_prepared, refuse_native
from gradsync.config import Config
from gradsync.errors import ConfigError
from gradsync.storage.folder import load_file, save_file


class DDPBackend(AdapterDefaults):
    """Deferred gradients live on the parameters (DDP's reducer keeps no copy between
    backward passes), so the defaults clear and clip them; what differs is the wrapping
    and ``no_sync()``."""

    name: ClassVar[str] = "ddp"
    checkpoint_format: str = "plain"
    accelerate_layout: str = "plain"
    reshardable: ClassVar[bool] = True  # every rank holds everything

    def __init__(self) -> None:
        super().__init__()
        self.ddp_kwargs: dict[str, Any] = {}
        self._hook: _ddp_comm.HookSettings | None = None  # comm_hook (None: none)
        self._hooked: dict[int, _ddp_comm.Hooked] = {}  # id(prepared DDP model) -> its hook
        self._pp: _ddp_pipeline.DDPPipeline | None = None  # pp > 1: the pipeline

    def setup(self, config: Config) -> None:
        refuse_native(config.sync_policy, self.name)
        # Deferring costs DDP no memory, so "auto" defers.
        self.policy = "every_step" if config.sync_policy == "every_step" else "defer"
        if config.sync_policy == "auto":
            self.policy_reason = "auto -> defer: no_sync() costs DDP no extra memory"
        self.ddp_kwargs = dict(config.ddp_kwargs or {})
        self._checkpointing = config.activation_checkpointing
        self._compile = _modules.compile_kwargs(config)
        self._dtype = _amp.autocast_dtype(config, _group.local_device())
        if config.find_unused_parameters:
            if self.ddp_kwargs.get("find_unused_parameters", True) is not True:
                raise ConfigError(
                    "find_unused_parameters=True contradicts ddp_kwargs={'find_unused_parameters': "
                    "False}; keep one of them"
                )
            self.ddp_kwargs["find_unused_parameters"] = True
        self._pp = _ddp_pipeline.DDPPipeline.of(config)  # its settings checked before any group
        self.owns_group = _group.ensure_process_group(
            self.name,
            want_audit=config.audit,
            self_check=config.self_check and self.policy == "defer",
            timeout=config.timeout,
        )
        self._device = _group.local_device()
        if self._pp is not None:
            self._pp.build(self._device)
            # Each stage writes its own part through torch.distributed.checkpoint.
            self.checkpoint_format = "dcp"
            self.accelerate_layout = ""  # Accelerate has no pipeline to resume
        self._hook = _ddp_comm.settings(config, self._device)
        # At the boundary every rank holds the same all-reduced gradients, which carry any
        # rank's inf/NaN: each rank's own check sees the same overflow, no extra collective.
        self.scaler = _amp.make_scaler(config, self._device, sharded=False)

    def prepare(
        self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], plan: BatchPlan
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        if isinstance(_torch_compat.uncompiled(model), DDP):
            _modules.refuse_wrapped(model, self.name, self._checkpointing, self._compile)
            return model, list(optimizers)
        compiled = _torch_compat.uncompiled(model) is not model  # by the user, before prepare
        _modules.checkpoint_modules(_torch_compat.uncompiled(model), self._checkpointing)
        model = model.to(self._device)
        if is_frozen(model):
            # Nothing to synchronise (a reference or teacher model): never wrapped in DDP.
            _group.broadcast_from_rank0(model)
            return model, list(optimizers)
        device_ids = [self._device.index] if self._device.type == "cuda" else None
        if self._pp is not None:
            wrapped = self._pp.wrap(
                model, optimizers, plan, self._device, device_ids=device_ids, **self.ddp_kwargs
            )
        else:
            wrapped = DDP(model, device_ids=device_ids, **self.ddp_kwargs)
        if self._hook is not None:  # DDP runs it where it would all-reduce: at the boundary
            self._hooked[id(wrapped)] = _ddp_comm.Hooked(wrapped, self._hook)
        # Compiling the wrapped model lets torch split the graph at DDP's buckets.
        _modules.compile_in_place(wrapped, None if compiled else self._compile)
        return wrapped, list(optimizers)

    @contextlib.contextmanager
    def micro_step(self, model: torch.nn.Module, *, boundary: bool) -> Iterator[None]:
        model = _torch_compat.uncompiled(model)
        if not isinstance(model, DDP):
            if is_frozen(model):  # a prepared frozen model: it has no gradient to defer
                with self.autocast():
                    yield
                return
            raise not_prepared(
                model,
                "DistributedDataParallel model",
                why="gradients would sync on every micro-step",
            )
        # no_sync() saves require_backward_grad_sync and puts the saved value back on exit.
        defer = not boundary and self.policy != "every_step"
        try:
            with model.no_sync() if defer else contextlib.nullcontext(), self.autocast():
                yield
        except RuntimeError as err:
            if not _ddp_compat.is_unfinished_reduction(err) or model.find_unused_parameters:
                raise  # with the flag on, torch's own advice is the one that applies
            raise RuntimeError(_unused_message(model, str(err))) from None

    def user_paused_sync(self, model: torch.nn.Module) -> bool:
        # Off the boundary gradsync's own no_sync() has exited when this is asked; at a
        # boundary it enters none: a flag still off is the user's.
        model = _torch_compat.uncompiled(model)
        return isinstance(model, DDP) and not model.require_backward_grad_sync

    def pause_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        model = _torch_compat.uncompiled(model)
        if not isinstance(model, DDP):
            if is_frozen(model):
                return contextlib.nullcontext()  # nothing to synchronise
            raise ConfigError(
                f"LocalSGD got a {type(model).__name__}, not the DistributedDataParallel model "
                "that accel.prepare() returned; pass the prepared model"
            )
        return model.no_sync()

    def sync_next_backward(self, model: torch.nn.Module) -> None:
        model = _torch_compat.uncompiled(model)
        if isinstance(model, DDP) and self.policy != "every_step" and not _pipeline.is_stage(model):
            _ddp_compat.expect_backward(model)  # a stage's schedule step prepares its own

    @property
    def data_parallel(self) -> dist.DataParallel:
        data = self._pp.data if self._pp is not None else None
        return data if data is not None else super().data_parallel

    @property
    def mesh(self) -> Any:
        """With a pipeline: the named mesh (pp, dp_replicate, dp_shard, tp); None otherwise."""
        return self._pp.mesh if self._pp is not None else None

    def oom_split_refusal(self) -> str | None:
        return None if self._pp is None else self._pp.dims.oom_split_refusal()

    def clip_grad_norm_(
        self,
        model: torch.nn.Module,
        parameters: Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        if self._pp is not None:  # every stage's gradients
            return self._pp.clip_grad_norm_(parameters, max_norm, norm_type)
        return super().clip_grad_norm_(model, parameters, max_norm, norm_type)

    def end_window(self, models: Sequence[torch.nn.Module]) -> None:
        for hooked in self._hooks_of(models):
            hooked.window_ended()

    def abort_window(self, models: Sequence[torch.nn.Module]) -> None:
        super().abort_window(models)  # the window's gradients live on the parameters
        for model in map(_torch_compat.uncompiled, models):
            if isinstance(model, DDP):
                _ddp_compat.start_window_again(model)
        for hooked in self._hooks_of(models):
            hooked.window_dropped()  # PowerSGD's state as the window found it

    def _hooks_of(self, models: Sequence[torch.nn.Module]) -> list[_ddp_comm.Hooked]:
        found = (self._hooked.get(id(_torch_compat.uncompiled(m))) for m in models)
        return [h for h in found if h is not None]

    def gathering_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        model = _torch_compat.uncompiled(model)
        return [model] if isinstance(model, DDP) else []

    def forward_gathers(self, module: torch.nn.Module) -> bool:
        # The first forward after a synchronised one broadcasts the buffers from rank 0.
        return isinstance(module, DDP) and module.will_sync_module_buffers()

    def state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        state = super().state_dict(model)  # a pipeline: this rank's stage, then every stage's
        return _pipeline.whole_state(model, state) if self._pp is not None else state

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        model = _torch_compat.uncompiled(model)  # compiled after prepare, or before it
        return _torch_compat.uncompiled(model.module if isinstance(model, DDP) else model)

    def save(
        self,
        path: Path,
        models: Sequence[torch.nn.Module],
        optimizers: Sequence[Held],
        *,
        window_open: bool,
    ) -> None:
        if self._pp is not None:
            _fsdp_checkpoint.save(
                path, models, optimizers, window_open=window_open, device=self._device
            )
        else:
            _plain_state.save(
                path, models, optimizers, self.unwrap, dist.rank(), window_open=window_open
            )
        states = [h.state_dict() if h else None for h in map(self._hooked.get, _ids(models))]
        if any(s is not None for s in states):  # each rank's own error feedback
            save_file(states, _comm_file(path, dist.rank()))

    def load(
        self,
        path: Path,
        models: Sequence[torch.nn.Module],
        optimizers: Sequence[Held],
        *,
        window_open: bool,
        trusted: bool = False,
    ) -> None:
        file = _comm_file(path, dist.rank())
        hooks = [self._hooked.get(i) for i in _ids(models)]
        wanted = any(h is not None and h.state is not None for h in hooks)
        states = load_file(file, trusted=trusted) if wanted and file.is_file() else None
        if self._pp is not None:  # each stage reads its own part
            _fsdp_checkpoint.load(
                path,
                models,
                optimizers,
                window_open=window_open,
                device=self._device,
                trusted=trusted,
            )
        else:
            _plain_state.load(
                path,
                models,
                optimizers,
                self.unwrap,
                dist.rank(),
                window_open=window_open,
                trusted=trusted,
            )
        for hooked, saved in zip(hooks, states or []):
            if hooked is not None and hooked.state is not None and saved is not None:
                _ddp_comm.load_saved(hooked, saved, file)


def _ids(models: Sequence[torch.nn.Module]) -> list[int]:
    return [id(_torch_compat.uncompiled(m)) for m in models]


def _comm_file(path: Path, rank: int) -> Path:
    """The rank's communication-hook state (PowerSGD's error feedback and matrices)."""
    return path / f"comm_rank{rank}.pt"


def _unused_message(model: DDP, torch_message: str) -> str:
    """One line for DDP's "Expected to have finished reduction" error: which parameters got
    no gradient in the last synchronised backward, and the fix."""
    ignored = frozenset(getattr(model, "parameters_to_ignore", ()) or ())
    rank, names = _ddp_compat.unused_parameters(torch_message, model.module, ignored)
    if names:
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        which = f"parameter(s) {shown} got no gradient"
    else:
        which = "some parameters got no gradient (torch did not say which)"
    where = f" on rank {rank}" if rank is not None else ""
    return (
        f"DDP: {which}{where} in the last synchronised backward (used only in some micro-steps, "
        "or not at all), so DDP could not finish reducing; pass "
        "Accelerator(find_unused_parameters=True) or ddp_kwargs={'find_unused_parameters': True}"
    )
