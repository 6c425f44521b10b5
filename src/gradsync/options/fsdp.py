"""The FSDP2 backend's options (read by backends/fsdp.py as ``config.<name>``). No torch here."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from gradsync import mesh
from gradsync._support.declaration import ModuleSelector, check_bytes, setting
from gradsync.errors import ConfigError
from gradsync.options.pipeline import PPSplit, check_schedule, check_split, split_from_text

#: The policy that needs a 2-D mesh: reduce-scatter every micro-step, all-reduce across the
#: replicas once per window.
REPLICATE_POLICY = "defer_replicate"
_MESH_FIX = (
    "give (R, S) with R x S = the world size (one of them may be -1: inferred), "
    "'node', or a DeviceMesh with named dimensions (replicate, shard)"
)


@runtime_checkable
class DeviceMeshLike(Protocol):
    """A ``torch.distributed.device_mesh.DeviceMesh`` as the settings see it (no torch here)."""

    @property
    def ndim(self) -> int: ...

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None: ...


#: ``fsdp_mesh``: "node" (shard inside a node, replicate across nodes), (R, S) replicas x
#: shards, or a DeviceMesh (dimension 0 replicates, dimension 1 shards).
MeshSpec = Literal["node"] | tuple[int, int] | DeviceMeshLike


def check_replicate_policy(name: str, value: Any, config: Any) -> None:
    """sync_policy='defer_replicate' belongs to FSDP2 on a 2-D mesh: refused on any other
    backend here; on FSDP, a 1-D mesh is refused at setup (it needs the world size)."""
    if value == REPLICATE_POLICY and config.backend != "fsdp":
        raise ConfigError(
            f"{name}='defer_replicate' defers the all-reduce across the replicas of FSDP2's "
            f"2-D mesh, and backend={config.backend!r} has none; use backend='fsdp' with "
            "fsdp_mesh=(R, S), or sync_policy='defer'"
        )


def mesh_from_text(raw: str, source: str) -> str | tuple[int, int]:
    """``GRADSYNC_FSDP_MESH`` / ``--fsdp-mesh``: "R,S" (one may be -1) or "node"."""
    text = raw.strip().lower()
    if text == "node":
        return "node"
    parts = [p.strip() for p in text.replace("x", ",").split(",")]
    if len(parts) == 2 and all(p.lstrip("-").isdigit() for p in parts):
        return int(parts[0]), int(parts[1])
    raise ConfigError(
        f"{source}={raw!r} is not a mesh; give 'R,S' (replicas, shards), e.g. '2,8', or 'node'"
    )


def _check_mesh(name: str, value: Any, config: Any) -> Any:
    """The mesh's form (its size against the world is checked at setup, before any collective)."""
    if config.backend != "fsdp":
        raise ConfigError(
            f"{name}={_show(value)} shapes FSDP2's device mesh, and backend={config.backend!r} "
            "shards nothing; use backend='fsdp', or drop fsdp_mesh"
        )
    if isinstance(value, str):
        if value.strip().lower() == "node":
            return "node"
        return mesh_from_text(value, name)
    if isinstance(value, list | tuple):
        if len(value) != 2 or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ConfigError(f"{name}={value!r} must be two whole numbers (R, S); {_MESH_FIX}")
        shape = (int(value[0]), int(value[1]))
        if any(v == 0 or v < -1 for v in shape):
            raise ConfigError(f"{name}={shape!r} has an entry that is not positive; {_MESH_FIX}")
        if shape == (-1, -1):
            raise ConfigError(f"{name}={shape!r} has two -1: only one can be inferred; {_MESH_FIX}")
        return shape
    if isinstance(value, DeviceMeshLike):
        if value.ndim > 2:
            raise ConfigError(
                f"{name}={_show(value)} has {value.ndim} dimensions; FSDP2 takes 1 (shard) or 2 "
                "(replicate, shard): pass mesh[('replicate', 'shard')] or build a 2-D mesh"
            )
        if value.mesh_dim_names is None:
            raise ConfigError(
                f"{name}={_show(value)} has no dimension names; build it with "
                "init_device_mesh(..., mesh_dim_names=('replicate', 'shard')) (or ('shard',) for 1-D)"
            )
        return value
    raise ConfigError(f"{name}={value!r} is not a mesh; {_MESH_FIX}")


def _show(value: Any) -> str:
    if isinstance(value, DeviceMeshLike):
        shape = getattr(value, "shape", "?")
        return f"DeviceMesh(shape={tuple(shape)}, names={value.mesh_dim_names})"
    return repr(value)


@runtime_checkable
class ParallelismConfigLike(Protocol):
    """Accelerate's ``ParallelismConfig`` as the settings see it (read by its sizes)."""

    @property
    def tp_size(self) -> int: ...


#: ``parallelism``: dim -> size ({"pp": P, "dp_replicate": R, "dp_shard": S, "tp": T}, one may
#: be -1),
#: text ("dp_shard=2,tp=2" or JSON), or Accelerate's ``ParallelismConfig``.
ParallelismSpec = Mapping[str, int] | str | ParallelismConfigLike
#: ``tp_plan``: module-name pattern -> style (a word of ``TP_STYLES`` or a torch
#: ParallelStyle), a callable ``(model, tp_mesh) -> None``, or "auto" (the model's own plan).
TPPlan = Literal["auto"] | Mapping[str, Any] | Callable[[Any, Any], None]
#: The words a ``tp_plan`` mapping may use (Transformers' words for torch's ParallelStyles).
TP_STYLES = (
    "colwise",
    "rowwise",
    "colwise_rep",
    "rowwise_rep",
    "colwise_gather_output",
    "embedding_rowwise",
    "sequence_parallel",
    "replicate",
)
_CP_NEEDS_GPU = (
    "context parallel needs a GPU (CUDA): torch's context_parallel has no CPU "
    "attention kernel to split (gloo on the CPU cannot run it); set cp to 1 (or leave "
    "it out)"
)


def _check_parallelism(name: str, value: Any, config: Any) -> dict[str, int]:
    """The N-D mesh's form, kept as dim -> size (its product against the world is checked at
    setup, before any collective)."""
    dims = mesh.parse(value, name)
    if config.backend == "ddp" and dims.pp != 1:
        if dims.dp_shard != 1 or dims.tp != 1 or dims.cp != 1:
            raise ConfigError(
                f"{name}={dims.text()!r} shards or splits the pipeline's stages, and "
                "backend='ddp' replicates each stage over its data-parallel ranks: give pp and "
                "dp_replicate only (e.g. 'pp=2,dp_replicate=-1'), or use backend='fsdp'"
            )
        return dims.sizes
    if config.backend != "fsdp" and dims.pp != 1:
        raise ConfigError(
            f"{name}={dims.text()!r} asks for pipeline parallelism (pp={dims.pp}), whose stages "
            f"run on FSDP2 or DDP, and backend={config.backend!r} cannot pipeline (DeepSpeed's "
            "own pipeline engine is not supported); use backend='fsdp' or 'ddp', or drop pp"
        )
    if config.backend != "fsdp":
        what = f"tensor parallelism (tp={dims.tp})" if dims.tp != 1 else "an N-D mesh"
        raise ConfigError(
            f"{name}={dims.text()!r} asks for {what}, which runs on FSDP2, and "
            f"backend={config.backend!r} has none; use backend='fsdp', or drop parallelism"
        )
    if dims.cp not in (1,):
        raise ConfigError(f"{name}={dims.text()!r} asks for cp={dims.cp}: {_CP_NEEDS_GPU}")
    given = config.fsdp_mesh
    if given is not None:
        if not isinstance(given, tuple):
            raise ConfigError(
                f"{name}={dims.text()!r} together with fsdp_mesh={_show(given)}: give one of "
                "them (parallelism's dp_replicate and dp_shard are fsdp_mesh's (R, S))"
            )
        asked = (dims.dp_replicate, dims.dp_shard)
        if -1 not in given and -1 not in asked and tuple(given) != asked:
            raise ConfigError(
                f"{name}={dims.text()!r} contradicts fsdp_mesh={tuple(given)!r}: fsdp_mesh is "
                f"(dp_replicate, dp_shard) = {asked}; drop fsdp_mesh, or make them agree"
            )
    return dims.sizes


def parallelism_from_text(raw: str, source: str) -> dict[str, int]:
    """``GRADSYNC_PARALLELISM`` / ``--parallelism``: "dp_shard=2,tp=2" or a JSON object."""
    return mesh.from_text(raw, source).sizes


def _check_tp_plan(name: str, value: Any, config: Any) -> Any:
    """The plan's form; what it names is checked against the model at prepare."""
    if config.backend != "fsdp":
        raise ConfigError(
            f"{name}=... shards layers for tensor parallelism, which runs on FSDP2, and "
            f"backend={config.backend!r} has none; use backend='fsdp' with parallelism="
            "{'tp': T, ...}, or drop tp_plan"
        )
    if isinstance(value, str):
        if value.strip().lower() != "auto":
            raise ConfigError(
                f"{name}={value!r} is not a plan; give 'auto' (the model's own plan), a dict "
                "of module-name patterns to styles, or a callable (model, tp_mesh) -> None"
            )
        return "auto"
    if isinstance(value, Mapping):
        if not value:
            raise ConfigError(f"{name}={{}} names no module; give module-name patterns and styles")
        for pattern, style in value.items():
            if not isinstance(pattern, str):
                raise ConfigError(
                    f"{name}: the key {pattern!r} is not a module-name pattern (text)"
                )
            if isinstance(style, str) and style not in TP_STYLES:
                raise ConfigError(
                    f"{name}: {pattern!r}: {style!r} is no style; use one of "
                    f"{', '.join(TP_STYLES)} or a torch ParallelStyle"
                )
        return dict(value)
    if callable(value):
        return value
    raise ConfigError(
        f"{name}={value!r} is not a plan; give 'auto', a dict of module-name patterns to "
        "styles, or a callable (model, tp_mesh) -> None"
    )


def _tp_plan_from_text(raw: str, source: str) -> Any:
    text = raw.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except ValueError:
            raise ConfigError(
                f"{source}={raw!r} is not JSON; give 'auto' or a JSON object"
            ) from None
    return text


def _check_old_budget(name: str, value: Any, config: Any) -> int:
    """fsdp_memory_budget, the old name of sync_memory_budget: bytes, and no contradiction."""
    budget = check_bytes(name, value, config)
    if config.sync_memory_budget is not None and config.sync_memory_budget != budget:
        raise ConfigError(
            f"fsdp_memory_budget={budget} contradicts sync_memory_budget="
            f"{config.sync_memory_budget}; fsdp_memory_budget is the old name of "
            "sync_memory_budget: set only sync_memory_budget"
        )
    return budget


def _check_reshard(name: str, value: Any, config: Any) -> bool:
    """The deprecated fsdp_reshard_after_backward: its False is fsdp_keep_params_in_window's
    True; a contradiction is an error, any use a DeprecationWarning."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be True, False or None")
    keep = config.fsdp_keep_params_in_window
    if keep is not None and keep == value:
        raise ConfigError(
            f"fsdp_reshard_after_backward={value} contradicts fsdp_keep_params_in_window={keep}; "
            "fsdp_reshard_after_backward is deprecated: set only fsdp_keep_params_in_window"
        )
    warnings.warn(
        "fsdp_reshard_after_backward is deprecated; use fsdp_keep_params_in_window=True "
        "(keeps the parameters gathered for the whole window: no all-gather after the "
        "window's first micro-step) or False",
        DeprecationWarning,
        stacklevel=6,  # the caller of Accelerator() / load_config()
    )
    return value


@dataclass
class FSDPOptions:
    """Settings that only the ``fsdp`` backend reads."""

    fsdp_wrap: ModuleSelector | None = field(
        default=None,
        metadata=setting(
            "the submodules sharded as their own unit: class names, classes or a callable "
            "module -> bool (None: the children of every ModuleList / Sequential)",
            backend="fsdp",
        ),
    )
    fsdp_keep_params_in_window: bool | None = field(
        default=None,
        metadata=setting(
            "keep the parameters gathered for the rest of a deferred window (None: decided by "
            "sync_memory_budget)",
            backend="fsdp",
        ),
    )
    fsdp_reshard_after_backward: bool | None = field(
        default=None,
        metadata=setting(
            "deprecated: False keeps the parameters gathered only after backward; use "
            "fsdp_keep_params_in_window",
            backend="fsdp",
            check=_check_reshard,
        ),
    )
    fsdp_mesh: MeshSpec | None = field(
        default=None,
        metadata=setting(
            "the device mesh: None (1-D, shard over all ranks), (R, S) replicas x shards (HSDP; "
            "one may be -1), 'node' (shard inside a node, replicate across nodes), or a 2-D "
            "DeviceMesh (replicate, shard); from text 'R,S' or 'node'",
            backend="fsdp",
            flag=True,
            check=_check_mesh,
            parse=mesh_from_text,
            metavar="R,S",
        ),
    )
    parallelism: ParallelismSpec | None = field(
        default=None,
        metadata=setting(
            "the N-D mesh: {'pp': P, 'dp_replicate': R, 'dp_shard': S, 'tp': T} (one may be -1; "
            "P x R x S x T = the world), Accelerate's ParallelismConfig (which has no pp), or "
            "text 'pp=2,dp_shard=2'; the data parallel ranks are R x S (backend 'ddp' takes "
            "pp and dp_replicate: a pipeline of DDP stages)",
            backend="fsdp",
            flag=True,
            check=_check_parallelism,
            parse=parallelism_from_text,
            metavar="DIMS",
        ),
    )
    tp_plan: TPPlan | None = field(
        default=None,
        metadata=setting(
            "tensor parallelism's plan: module-name pattern -> style ('colwise', 'rowwise', ...), "
            "a callable (model, tp_mesh) -> None, or 'auto' (a Transformers model's own plan)",
            backend="fsdp",
            check=_check_tp_plan,
            parse=_tp_plan_from_text,
        ),
    )
    pp_split: PPSplit | None = field(
        default=None,
        metadata=setting(
            "where the pipeline splits the model: the module paths where each stage after the "
            "first begins (e.g. ['4'] or ['blocks.2']), or a callable (model, num_stages) -> "
            "the stage modules; needs parallelism with pp > 1 (from text: comma-separated "
            "paths); the pipeline settings apply to backend 'ddp' too",
            backend="fsdp",
            flag=True,
            check=check_split,
            parse=split_from_text,
            metavar="PATHS",
        ),
    )
    pp_schedule: str = field(
        default="1F1B",
        metadata=setting(
            "the pipeline schedule of one micro-step: 'GPipe' (every forward, then every "
            "backward), '1F1B' (one forward, one backward: fewer activations held) or "
            "'Interleaved1F1B' (pp_stages_per_rank stages on each rank)",
            backend="fsdp",
            flag=True,
            check=check_schedule,
            metavar="NAME",
        ),
    )
    pp_microbatches: int | None = field(
        default=None,
        metadata=setting(
            "the pipeline's micro-batches per micro-step (they divide the micro-batch); None: "
            "one per stage",
            backend="fsdp",
            flag=True,
            minimum=1,
            metavar="M",
        ),
    )
    pp_stages_per_rank: int = field(
        default=1,
        metadata=setting(
            "the pipeline stages each rank runs (pp x this many in all); more than 1 needs "
            "pp_schedule='Interleaved1F1B'",
            backend="fsdp",
            flag=True,
            minimum=1,
            metavar="V",
        ),
    )
    fsdp_state_dict_type: Literal["SHARDED_STATE_DICT", "FULL_STATE_DICT"] | None = field(
        default=None,
        metadata=setting(
            "the Accelerate layout gradsync.accelerate's save_state writes beside gradsync's "
            "own: 'SHARDED_STATE_DICT' (None: the default) or 'FULL_STATE_DICT' (rank 0 "
            "writes the full weights and optimizer state); load_state reads both",
            backend="fsdp",
        ),
    )
    fsdp_memory_budget: int | None = field(
        default=None,
        metadata=setting(
            "the old name of sync_memory_budget", backend="fsdp", check=_check_old_budget, minimum=0
        ),
    )
