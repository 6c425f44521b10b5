"""FSDP2 (``fully_shard``): defer the reduce-scatter off the boundary, or reduce every micro-step.

Deferring saves communication but holds every parameter's full, unsharded gradient on each
rank until the boundary; keeping the parameters gathered for the window as well saves the
all-gathers of all but the window's first micro-step. The policy says which: "defer",
"every_step", or "auto" (the deepest level whose extra bytes fit a memory budget). FSDP1
models wrapped by the user are deferred through their ``no_sync()``.

On a 2-D mesh (``fsdp_mesh``: R replicas x S shards, HSDP) "defer_replicate" reduce-scatters
inside the shard group every micro-step into a partial buffer (1/S of the gradients) and
all-reduces across the replicas only at the boundary; "auto" picks it when full deferral
does not fit the budget.

On an N-D mesh (``parallelism``: dp_replicate x dp_shard x tp) the model is first split over
the "tp" dim by ``tp_plan`` (``parallelize_module``), then sharded by FSDP2 over the
data-parallel dims, as above: only their reduce-scatter and all-reduce wait for the
boundary; tensor parallel's collectives are the forward and backward themselves. With a
"pp" dim the model is first cut into pipeline stages (``_pipeline``), each rank keeping its own
stage, and each stage is split and sharded as above over its pipeline coordinate's ranks.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.distributed.tensor import DTensor

from gradsync import audit
from gradsync import mesh as nd_mesh
from gradsync._plan.batch_plan import BatchPlan
from gradsync._support import dist, environment
from gradsync._support import torch_compat as _torch_compat
from gradsync.backends import (
    _amp,
    _compression,
    _fsdp_canary,
    _fsdp_checkpoint,
    _fsdp_compat,
    _group,
    _modules,
    _pipeline,
    _pipeline_sync,
    _save_pretrained,
    _tensor_parallel,
)
from gradsync.backends._fsdp_policy import (
    Keep,
    available_memory,
    check_replicate_policy,
    crosses_nodes,
    decide,
    deferral_cost,
    mesh_shape,
    mp_policy,
    partial_cost,
    select_units,
)
from gradsync.backends._memory import agreed_budget
from gradsync.backends.base import (
    AdapterDefaults,
    Held,
    RequestedPolicy,
    clear_grads,
    is_frozen,
    not_prepared,
    refuse_native,
)
from gradsync.config import Config
from gradsync.errors import ConfigError
from gradsync.storage.safety import allow_list

log = logging.getLogger("gradsync")

__all__ = ["FSDPBackend", "available_memory", "deferral_cost"]


class FSDPBackend(AdapterDefaults):
    """bf16 is FSDP2's MixedPrecisionPolicy; ``_dtype`` (the defaults' autocast) is fp16's
    only, with fp32 parameters and gradients."""

    name: ClassVar[str] = "fsdp"
    checkpoint_format: str = "dcp"  # torch.distributed.checkpoint, sharded
    accelerate_layout: str = "sharded_dcp"  # "full_state": fsdp_state_dict_type (setup)
    accelerate_reads: ClassVar[frozenset[str]] = frozenset({"sharded_dcp", "full_state"})
    save_accelerate = _fsdp_checkpoint.save_accelerate  # a method: it reads the layout
    load_accelerate = staticmethod(_fsdp_checkpoint.load_accelerate)
    reshardable: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.memory: dict[str, int] = {}
        self._mesh: DeviceMesh | None = None
        self._shape = (1, 1)  # (R replicas, S shards); R = 1: a 1-D mesh
        # Copied from the Config at setup (the adapter keeps no reference to it).
        self._asked: RequestedPolicy = "auto"
        self._bf16 = False  # bf16 through FSDP2's MixedPrecisionPolicy
        self._reduce: torch.dtype | None = None  # comm_hook's reduce dtype (None: as computed)
        self._wrap: Any = None
        self._budget: tuple[int | None, str] = (None, "sync_memory_budget")
        self._keep_option: bool | None = None  # fsdp_keep_params_in_window
        self._legacy_keep = False  # the deprecated fsdp_reshard_after_backward=False
        self.keep: Keep = "no"  # resolved at prepare
        # The N-D mesh (parallelism): its sizes, the whole named mesh, the tensor-parallel
        # plan and this rank's data-parallel ranks (None: plain FSDP2, the world).
        self._dims: nd_mesh.Parallelism | None = None
        self._world_mesh: DeviceMesh | None = None
        self._tp_plan: Any = None
        self._data: dist.DataParallel | None = None
        self._pp: _pipeline.Settings | None = None  # pp > 1: the pipeline's settings
        self._canary = _fsdp_canary.Canary()  # on a torch newer than the tested range

    def setup(self, config: Config) -> None:
        refuse_native(config.sync_policy, self.name)
        self._asked = config.sync_policy
        self._bf16 = config.mixed_precision == "bf16"
        if config.fsdp_state_dict_type == "FULL_STATE_DICT":
            self.accelerate_layout = "full_state"
        if config.mixed_precision == "fp16":
            self._dtype = _amp.check_autocast(_group.local_device(), "fp16")
        self._checkpointing = config.activation_checkpointing
        self._compile = _modules.compile_kwargs(config)
        self._wrap = config.fsdp_wrap
        if config.fsdp_keep_params_in_window and config.sync_policy in (
            "every_step",
            "defer_replicate",
        ):
            raise ConfigError(
                "fsdp_keep_params_in_window=True keeps the parameters gathered through a deferred "
                f"window, and sync_policy={config.sync_policy!r} "
                + (
                    "defers nothing"
                    if config.sync_policy == "every_step"
                    else "reduces every micro-step"
                )
                + "; use sync_policy='defer' or 'auto', or drop fsdp_keep_params_in_window"
            )
        # The mesh's size against the world, before any collective runs.
        self._dims = self._parallelism(config)
        self._shape = (
            self._mesh_shape(config.fsdp_mesh)
            if self._dims is None
            else (self._dims.dp_replicate, self._dims.dp_shard)
        )
        spec = config.fsdp_mesh if self._dims is None else self._dims.text()
        if self._asked == "defer_replicate":
            check_replicate_policy(spec, self._shape, nd=self._dims is not None)
        self._budget = config.memory_budget()
        self._keep_option = config.fsdp_keep_params_in_window
        self._legacy_keep = config.fsdp_reshard_after_backward is False
        self.policy = "every_step" if config.sync_policy == "auto" else config.sync_policy
        self.policy_reason = f"sync_policy={config.sync_policy!r} (auto decides at prepare)"
        self.owns_group = _group.ensure_process_group(  # "auto" may defer: decided at prepare
            self.name,
            want_audit=config.audit,
            self_check=config.self_check and self._asked != "every_step",
            timeout=config.timeout,
        )
        self._device = _group.local_device()
        hook = _compression.supported(config, self.name, ("fp16", "bf16"), "reduce_dtype")
        self._reduce = _compression.half_dtype(hook, self._device)
        if self._dims is not None:
            self._mesh = self._build_nd_mesh(self._dims)
        else:
            self._mesh = self._build_mesh(config.fsdp_mesh)
        if self._mesh.ndim == 2:  # the audit tells the mesh's groups apart by object, not by size
            audit.label_group(self._mesh.get_group(0), "replicate")
            audit.label_group(self._mesh.get_group(1), "shard")
        self.scaler = _amp.make_scaler(config, self._device, sharded=True)

    @property
    def mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards over: 1-D (shard), or 2-D (replicate, shard); under
        ``parallelism`` the whole named mesh (dp_replicate, dp_shard, tp)."""
        return self._world_mesh if self._world_mesh is not None else self._mesh

    @property
    def data_parallel(self) -> dist.DataParallel:
        return self._data if self._data is not None else dist.world_data_parallel()

    def _parallelism(self, config: Config) -> nd_mesh.Parallelism | None:
        """``parallelism`` on this world (None when not given); one line for a product that
        is not the world, an fsdp_mesh that contradicts it, or a tp without a plan."""
        if config.parallelism is None:
            if config.tp_plan is not None:
                raise ConfigError(
                    "tp_plan=... splits layers over the tensor-parallel dim, and no parallelism "
                    "gives one; set parallelism={'tp': T, 'dp_shard': -1}, or drop tp_plan"
                )
            return None
        dims = nd_mesh.parse(config.parallelism).resolve(dist.world_size())
        if isinstance(config.fsdp_mesh, tuple):
            replicas, shards = mesh_shape(config.fsdp_mesh, dims.data_parallel, 0)
            if (replicas, shards) != (dims.dp_replicate, dims.dp_shard):
                raise ConfigError(
                    f"parallelism={dims.text()!r} contradicts fsdp_mesh={tuple(config.fsdp_mesh)!r} "
                    f"= ({replicas}, {shards}) on this world: fsdp_mesh is (dp_replicate, dp_shard) = "
                    f"({dims.dp_replicate}, {dims.dp_shard}); drop fsdp_mesh, or make them agree"
                )
        if dims.tp > 1 and config.tp_plan is None:
            raise ConfigError(
                f"parallelism={dims.text()!r} has tp={dims.tp} and no tp_plan says which layers "
                "to split; give tp_plan ('auto' for a Transformers model, a dict of module-name "
                "patterns to styles, or a callable (model, tp_mesh) -> None)"
            )
        if dims.tp == 1 and config.tp_plan is not None:
            raise ConfigError(
                f"tp_plan=... splits layers over the tensor-parallel dim, and parallelism="
                f"{dims.text()!r} has tp=1; give tp > 1, or drop tp_plan"
            )
        self._tp_plan = config.tp_plan
        self._pp = _pipeline.Settings.of(config, dims)
        if self._pp is not None:
            self.accelerate_layout = ""  # Accelerate has no pipeline to resume
        return dims

    def _build_nd_mesh(self, dims: nd_mesh.Parallelism) -> DeviceMesh:
        """The named mesh (dp_replicate, dp_shard, tp), its groups labelled for the audit, and
        the data-parallel group of this rank's tensor-parallel coordinate; returns the mesh
        FSDP2 shards over (dp_shard, or (dp_replicate, dp_shard) with replicas)."""
        world_mesh = nd_mesh.build(dims, self._device.type)
        self._world_mesh = world_mesh
        audit.label_group(world_mesh.get_group("tp"), "tp")
        if self._pp is not None:  # the pipeline's group, labelled for the audit
            self._pp.bind(world_mesh)
        if dims.tp > 1 or dims.pp > 1:  # the R x S ranks of this (pp, tp) coordinate
            data_rank, group = nd_mesh.data_group(dims, dist.rank())
            audit.label_group(group, "dp")
            self._data = dist.DataParallel(data_rank, dims.data_parallel, group)
        if dims.dp_replicate == 1:
            shard_mesh = world_mesh["dp_shard"]
            audit.label_group(shard_mesh.get_group(), "shard")
            return shard_mesh
        return world_mesh["dp_replicate", "dp_shard"]

    def _mesh_shape(self, spec: Any) -> tuple[int, int]:
        """(R, S) of ``fsdp_mesh`` on this world; ConfigError / warning before any collective."""
        world = dist.world_size()
        per_node = environment.detect().local_world_size
        if isinstance(spec, DeviceMesh):
            if spec.size() != world:
                raise ConfigError(
                    f"fsdp_mesh=DeviceMesh(shape={tuple(spec.shape)}) holds {spec.size()} ranks, but "
                    f"the world has {world}; build the mesh over every rank, e.g. "
                    f"init_device_mesh(device, (-1, S), mesh_dim_names=('replicate', 'shard'))"
                )
            shape = (1, spec.size()) if spec.ndim == 1 else (spec.shape[0], spec.shape[1])
        else:
            shape = mesh_shape(spec, world, per_node)
        replicas, shards = shape
        if replicas > 1 and crosses_nodes(shards, per_node):
            log.warning(
                "gradsync fsdp: fsdp_mesh=(%d, %d) shards over %d ranks, which does not divide the "
                "%d processes per node: shard groups cross nodes (their reduce-scatters and "
                "all-gathers go over the network); pick S dividing %d, or fsdp_mesh='node'",
                replicas,
                shards,
                shards,
                per_node,
                per_node,
            )
        return replicas, shards

    def _build_mesh(self, spec: Any) -> DeviceMesh:
        replicas, shards = self._shape
        if isinstance(spec, DeviceMesh):
            names = spec.mesh_dim_names or ()
            return spec[names[1]] if spec.ndim == 2 and replicas == 1 else spec
        if replicas == 1:  # R = 1 is 1-D
            return init_device_mesh(self._device.type, (shards,))
        return init_device_mesh(
            self._device.type, (replicas, shards), mesh_dim_names=("replicate", "shard")
        )

    # -- prepare ------------------------------------------------------------
    def prepare(
        self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], plan: BatchPlan
    ) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
        given, model = (
            model,
            _torch_compat.uncompiled(model),
        )  # compiled before prepare: shard inside
        if not any(True for _ in model.parameters()):
            raise ConfigError(
                f"backend='fsdp' got a {type(model).__name__} with no parameters; there is "
                "nothing to shard: prepare the model that holds the trainable parameters"
            )
        for optimizer in optimizers:
            if optimizer.state:
                raise ConfigError(
                    f"the {type(optimizer).__name__} already has state for {len(optimizer.state)} "
                    "parameters; backend='fsdp' re-points the optimizer at the sharded parameters, "
                    "which would orphan that state: prepare before the first optimizer step"
                )
        split = None  # the tensor-parallel plan for this model (with pp: the whole model)
        if self._tp_plan is not None and not isinstance(model, FSDPModule | FSDP1):
            assert self._dims is not None
            split = _tensor_parallel.resolve(model, self._tp_plan)
            _tensor_parallel.check(model, split, self._dims.tp)
        if self._pp is not None and not isinstance(model, FSDPModule | FSDP1):
            given = model = self._pp.stage(model, plan, self._device, optimizers)
            split = _pipeline.stage_plan(model, split)
        if not isinstance(model, FSDPModule | FSDP1):
            names = {id(p): n for n, p in model.named_parameters()}
            self._shard(model, compile_units=given is model, plan=split)
            dropped = self._pp.dropped if self._pp is not None else set()  # another stage's
            _modules.repoint(optimizers, names, dict(model.named_parameters()), dropped)
            if self._pp is not None:
                self._pp.start(model, self._device, _pipeline_sync.FSDPSync())
        else:
            hooked = ("comm_hook",) if self._reduce is not None else ()
            _modules.refuse_wrapped(model, self.name, self._checkpointing, self._compile, hooked)
        if not is_frozen(model):  # a frozen model is sharded for its forward only
            self._decide(model)
        if isinstance(model, FSDPModule):  # its own state dict holds DTensor shards
            _save_pretrained.gather_in_save_pretrained(
                model, lambda: self.state_dict(model), self.barrier
            )
        return given, list(optimizers)

    def _shard(self, model: nn.Module, *, compile_units: bool, plan: Any = None) -> None:
        assert self._mesh is not None, "setup() first"
        if self._pp is None and not any(p.is_meta for p in model.parameters()):
            # Every rank shards its own copy: start them all from rank 0's weights.
            model.to(self._device)
            _group.broadcast_from_rank0(model)
        if plan is not None:  # tensor parallel first, then FSDP2 over the data-parallel dims
            assert self._world_mesh is not None
            _tensor_parallel.apply(model, plan, self._world_mesh["tp"])
        kwargs: dict[str, Any] = {"mesh": self._mesh}
        if self._bf16 or self._reduce is not None:
            kwargs["mp_policy"] = mp_policy(self._bf16, self._reduce, root=False)
        # Checkpointing, then compiling, happen to the blocks before they are sharded.
        _modules.checkpoint_modules(model, self._checkpointing)
        units = select_units(model, self._wrap)
        for unit in (units or [model]) if compile_units else []:  # not when compiled already
            _modules.compile_in_place(unit, self._compile)
        for unit in units:
            fully_shard(unit, **kwargs)
        for part in self._pp.parts or [] if self._pp is not None else []:
            # each stage of this rank is a unit (several per rank): the root never runs forward
            rest = [m for m in part if not isinstance(m, FSDPModule) and list(m.parameters())]
            if rest:
                fully_shard(rest, **kwargs)
        if "mp_policy" in kwargs:
            kwargs["mp_policy"] = mp_policy(self._bf16, self._reduce, root=True)
        fully_shard(model, **kwargs)

    def _decide(self, model: nn.Module) -> None:
        world = dist.world_size()
        replicas, shards = self._shape if not isinstance(model, FSDP1) else (1, world)
        if isinstance(model, FSDP1) and self._asked == "defer_replicate":
            raise ConfigError(
                "sync_policy='defer_replicate' needs FSDP2 on a 2-D mesh, and the model is wrapped "
                "in FSDP1; pass the unwrapped model to prepare(), or use sync_policy='defer'"
            )
        grad_bytes = 4 if self._bf16 else None
        grads = deferral_cost(model, shards, grad_bytes=grad_bytes, keep_params=False)
        full = deferral_cost(model, shards, grad_bytes=grad_bytes, keep_params=True)
        partial = partial_cost(model, shards, grad_bytes=grad_bytes) if replicas > 1 else 0
        budget = agreed_budget(*self._budget, self._device) if self._asked == "auto" else None
        # FSDP1: no_sync only; a pipeline stage reshards after each schedule step's backward
        keep = False if isinstance(model, FSDP1) or self._pp else self._keep_option
        self.policy, self.keep, extra, self.policy_reason = decide(
            self._asked,
            keep,
            self._legacy_keep and keep is not False,
            grads=grads,
            full=full,
            budget=budget,
            world=shards,
            replicas=replicas,
            partial=partial,
        )
        self.memory = {"deferral_extra_bytes": extra, "world_size": world}
        if replicas > 1:
            self.memory.update(replicas=replicas, shards=shards)
        if budget is not None:
            self.memory["budget_bytes"] = budget.nbytes
        if self.keep == "window":
            _fsdp_compat.lazy_init(model)  # before any flags are saved (it resets the root's)
        if dist.rank() == 0:
            log.info("gradsync fsdp: sync_policy %s", self.policy_reason)

    # -- the micro-step -------------------------------------------------------
    @contextlib.contextmanager
    def micro_step(self, model: nn.Module, *, boundary: bool) -> Iterator[None]:
        reduce = boundary or self.policy == "every_step"
        model = _torch_compat.uncompiled(model)
        if isinstance(model, FSDP1):
            with contextlib.nullcontext() if reduce else model.no_sync(), self.autocast():
                yield
            return
        if not isinstance(model, FSDPModule):
            raise not_prepared(model, "sharded model", why="gradient sync cannot be controlled")
        saved = _fsdp_compat.save_flags(model)
        if self.policy == "defer_replicate":  # reduce-scatter always, all-reduce at the boundary
            model.set_requires_gradient_sync(True)
            model.set_requires_all_reduce(boundary)
        else:
            model.set_requires_gradient_sync(reduce)
        if self.keep == "window" and self.policy == "defer" and not is_frozen(model):
            # Gathered from the window's first forward until the boundary's backward reshards.
            _fsdp_compat.keep_gathered(model, after_forward=True, after_backward=not reduce)
        elif not reduce and self.keep == "after_backward":
            model.set_reshard_after_backward(False)
        try:
            with self.autocast():
                yield
        finally:  # put back exactly what FSDP held before, not a value derived from `boundary`
            _fsdp_compat.restore_flags(saved)

    def gathering_modules(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if isinstance(m, FSDPModule | FSDP1)]

    def oom_split_refusal(self) -> str | None:
        return None if self._dims is None else self._dims.oom_split_refusal()

    def forward_gathers(self, module: nn.Module) -> bool:
        return isinstance(module, FSDP1) or _fsdp_compat.gathers_in_forward(module)

    def backward_communicates(self, boundary: bool) -> bool:
        # Only a window that keeps its parameters gathered runs its backward without an
        # all-gather; every other backward re-gathers (or reduces) each unit.
        return boundary or self.policy != "defer" or self.keep != "window"

    def abort_window(self, models: Sequence[nn.Module]) -> None:
        if self.policy != "every_step":
            self._canary.refuse("dropping a window", partial=self.policy == "defer_replicate")
        # Reduced gradients sit on the sharded parameters; a deferred window's gradients sit
        # unsharded inside FSDP2's own state (FSDP1's no_sync: on its flat parameters).
        # On a 2-D mesh a window whose all-reduce was deferred sits in partial buffers.
        clear_grads(models)
        for model in map(_torch_compat.uncompiled, models):
            if isinstance(model, FSDPModule):
                # A forward or backward broken off midway (an error, or an out-of-memory
                # error on_oom="split" recovers from) leaves FSDP2's per-iteration state half
                # run; on a 2-D mesh the partial buffers too.
                _fsdp_compat.reset_iter_state(model)
                _fsdp_compat.clear_unsharded_grads(model)
                if self.keep != "no":  # the window kept its parameters gathered: free them
                    _fsdp_compat.reshard(model)
        if self.policy != "every_step":
            self._canary.refuse_uncleared(
                [_torch_compat.uncompiled(m) for m in models],
                partial=self.policy == "defer_replicate",
            )

    def clip_grad_norm_(
        self,
        model: nn.Module,
        parameters: Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        model = _torch_compat.uncompiled(model)
        if isinstance(model, FSDP1):
            return model.clip_grad_norm_(max_norm, norm_type).detach()
        params = list(parameters)
        stages = self._pp.group if self._pp is not None else None  # every stage's gradients
        if stages is not None or (self._dims is not None and self._dims.tp > 1):  # several meshes
            return _tensor_parallel.clip_grad_norm_(params, max_norm, norm_type, stages).detach()
        # Over DTensor gradients the norm is a DTensor of the global norm; make it plain.
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        return (norm.full_tensor() if isinstance(norm, DTensor) else norm).detach()

    def clip_grad_value_(
        self, model: nn.Module, parameters: Iterable[torch.Tensor], clip_value: float
    ) -> None:
        if self._dims is not None and self._dims.tp > 1:  # gradients on several meshes
            _tensor_parallel.clip_grad_value_(parameters, clip_value)
            return
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def unwrap(self, model: nn.Module) -> nn.Module:
        model = _torch_compat.uncompiled(model)  # FSDP2 shards in place
        return _torch_compat.uncompiled(model.module if isinstance(model, FSDP1) else model)

    def state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The full state dict on CPU, on every rank (each tensor gathered in turn; a
        pipeline's stages then gathered over the pipeline group)."""
        state = _fsdp_checkpoint.full_state_dict(_torch_compat.uncompiled(model), self._device)
        return _pipeline.whole_state(model, state) if self._pp is not None else state

    def save(
        self,
        path: Path,
        models: Sequence[nn.Module],
        optimizers: Sequence[Held],
        *,
        window_open: bool,
    ) -> None:
        if window_open and self.policy != "every_step":  # every rank saves together
            self._canary.run(self._mesh, self._device)  # type: ignore[arg-type]
            self._canary.refuse("a mid-window save", partial=self.policy == "defer_replicate")
        _fsdp_checkpoint.save(
            path, models, optimizers, window_open=window_open, device=self._device
        )

    def load(
        self,
        path: Path,
        models: Sequence[nn.Module],
        optimizers: Sequence[Held],
        *,
        window_open: bool,
        trusted: bool = False,
    ) -> None:
        if window_open and self.policy != "every_step":  # every rank loads together
            self._canary.run(self._mesh, self._device)  # type: ignore[arg-type]
            self._canary.refuse(
                "resuming inside a window", partial=self.policy == "defer_replicate"
            )
        _fsdp_checkpoint.load(
            path,
            models,
            optimizers,
            window_open=window_open,
            device=self._device,
            trusted=trusted,
            allowed=allow_list(self.checkpoint_globals).__contains__,
        )
