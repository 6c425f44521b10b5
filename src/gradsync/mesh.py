"""The N-D mesh: ``parallelism={"pp": P, "dp_replicate": R, "dp_shard": S, "tp": T}`` as named
dims.

P pipeline stages x R replicas x S shards x T tensor-parallel ranks = the world, the pipeline
outermost. The data-parallel ranks are the R x S ranks of one (pipeline, tensor-parallel)
coordinate: they read distinct micro-batches, and the P x T ranks of one pipeline and its
tensor-parallel groups read the same ones. The global batch is micro x k x (R x S).
Accelerate's ``ParallelismConfig`` has no pipeline dim: pp is given as a mapping or as text.

The spelling is read here (a mapping, text such as ``"dp_shard=2,tp=2"``, JSON, or
Accelerate's ``ParallelismConfig``), with one entry that may be -1 (inferred from the world
size). Building the torch ``DeviceMesh`` is :func:`build` (torch is imported there only:
the settings and the launcher read this module without it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gradsync.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "COMPUTE_DIMS",
    "DATA_PARALLEL_DIMS",
    "DIMS",
    "MESH_DIMS",
    "Parallelism",
    "build",
    "data_group",
    "data_parallel_size",
    "from_text",
    "parse",
]

#: The dims a ``parallelism`` mapping names, in the mesh's order (outermost first) and "cp",
#: recognised and refused above 1 (context parallel needs a GPU).
DIMS = ("pp", "dp_replicate", "dp_shard", "tp", "cp")
#: The data-parallel dims: their ranks read distinct micro-batches, and their gradient
#: collectives (reduce-scatter over dp_shard, all-reduce over dp_replicate) may wait for the
#: boundary.
DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard")
#: The dims whose collectives are the computation (forward and backward of split layers, the
#: pipeline's activations): they run on every micro-step, and their ranks read the same
#: micro-batches.
COMPUTE_DIMS = ("pp", "tp", "cp")
#: The dims of the DeviceMesh :func:`build` makes (size-1 dims included, so the names always
#: exist): replicas outermost, tensor parallel innermost (neighbouring ranks). With pp > 1 a
#: "pp" dim comes first (outermost): ``PIPELINE_MESH_DIMS``.
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
PIPELINE_MESH_DIMS = ("pp", *MESH_DIMS)
#: Accelerate's names: ``ParallelismConfig``'s attributes and its config file's keys.
ACCELERATE_ATTRIBUTES = {
    "dp_replicate_size": "dp_replicate",
    "dp_shard_size": "dp_shard",
    "tp_size": "tp",
    "cp_size": "cp",
}
_FIX = (
    "give the sizes of pp, dp_replicate, dp_shard and tp (one may be -1: inferred), whose "
    "product is the world size, e.g. {'dp_shard': 2, 'tp': 2} or 'pp=2,dp_shard=2'"
)


@dataclass(frozen=True)
class Parallelism:
    """The sizes of the mesh's dims (one may be -1 until :meth:`resolve` fills it in)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1  # last here (positional forms stay (R, S, T)); outermost in the mesh

    @property
    def sizes(self) -> dict[str, int]:
        """dim -> size, in ``DIMS`` order (pp left out when it is 1: no pipeline)."""
        return {d: getattr(self, d) for d in DIMS if d != "pp" or self.pp != 1}

    def oom_split_refusal(self) -> str | None:
        """Why ``on_oom="split"`` cannot work on this mesh (None: it can): tensor
        parallelism and the pipeline run collectives inside every forward and backward,
        where a rank that ran out of memory would leave the others waiting."""
        inside = [f"{d}={getattr(self, d)}" for d in ("tp", "pp") if getattr(self, d) > 1]
        if not inside:
            return None
        return (
            f"{' and '.join(inside)} run collectives inside every forward and backward, where "
            "a rank that ran out of memory would leave the others waiting; use "
            "on_oom='raise' with tp > 1 or pp > 1"
        )

    @property
    def data_parallel(self) -> int:
        """R x S: the ranks that read distinct micro-batches (``DATA_PARALLEL_DIMS``)."""
        return math.prod(getattr(self, d) for d in DATA_PARALLEL_DIMS)

    @property
    def shape(self) -> tuple[int, ...]:
        """(R, S, T), the shape of the DeviceMesh over ``MESH_DIMS``; (P, R, S, T) over
        ``PIPELINE_MESH_DIMS`` when pp > 1."""
        inner = (self.dp_replicate, self.dp_shard, self.tp)
        return (self.pp, *inner) if self.pp > 1 else inner

    @property
    def names(self) -> tuple[str, ...]:
        """The DeviceMesh's dim names, in the order of :attr:`shape`."""
        return PIPELINE_MESH_DIMS if self.pp > 1 else MESH_DIMS

    def text(self) -> str:
        """The text form, e.g. ``dp_replicate=2,dp_shard=2,tp=2`` (dims of size 1 left out)."""
        shown = [f"{d}={n}" for d, n in self.sizes.items() if n != 1]
        return ",".join(shown) or "dp_shard=1"

    def resolve(self, world: int, name: str = "parallelism") -> Parallelism:
        """The sizes on ``world`` processes: the -1 inferred; a ConfigError (naming the value
        and the fix) when the product is not the world."""
        sizes = self.sizes
        unknown = [d for d, n in sizes.items() if n == -1]
        known = 1
        for n in sizes.values():
            known *= n if n != -1 else 1
        if unknown:
            if world % known:
                raise ConfigError(
                    f"{name}={self.text()!r}: {known} does not divide the world of {world} "
                    f"processes, so {unknown[0]}=-1 cannot be inferred; {_FIX}"
                )
            sizes[unknown[0]] = world // known
            return Parallelism(**sizes)
        if known != world:
            product = " x ".join(str(n) for n in sizes.values())
            raise ConfigError(
                f"{name}={self.text()!r} holds {product} = {known} processes, but the world "
                f"has {world}; {_FIX}"
            )
        return self


def _size(name: str, dim: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        else:
            raise ConfigError(f"{name}: {dim}={value!r} is not a whole number; {_FIX}")
    if value == 0 or value < -1:
        raise ConfigError(f"{name}: {dim}={value} must be positive (or -1: inferred); {_FIX}")
    return int(value)


def _from_mapping(value: Mapping[Any, Any], name: str) -> Parallelism:
    sizes: dict[str, int] = {}
    for key, raw in value.items():
        dim = str(key).strip().lower()
        dim = dim.removeprefix("parallelism_config_")
        dim = ACCELERATE_ATTRIBUTES.get(dim, dim)
        if dim not in DIMS:
            if str(key).startswith("parallelism_config_") and not dim.endswith("_size"):
                continue  # Accelerate's options of a dim (cp_comm_strategy ...): not a size
            raise ConfigError(
                f"{name} names {key!r}, which is no dim; use {', '.join(DIMS)} "
                "(or Accelerate's dp_replicate_size, dp_shard_size, tp_size, cp_size; its "
                "ParallelismConfig has no pipeline dim: give pp as {'pp': P, ...} or 'pp=P,...')"
            )
        if raw is None:
            continue
        sizes[dim] = _size(name, dim, raw)
    if sum(1 for n in sizes.values() if n == -1) > 1:
        raise ConfigError(
            f"{name}={dict(value)!r} has more than one -1: only one can be inferred; {_FIX}"
        )
    return Parallelism(**sizes)


def from_text(raw: str, source: str = "parallelism") -> Parallelism:
    """``GRADSYNC_PARALLELISM`` / ``--parallelism``: ``"dp_shard=2,tp=2"`` (also ``:`` for
    ``=``), or a JSON object."""
    text = raw.strip()
    if text.startswith("{"):
        try:
            loaded = json.loads(text)
        except ValueError:
            raise ConfigError(f"{source}={raw!r} is not JSON; {_FIX}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{source}={raw!r} is not a JSON object; {_FIX}")
        return _from_mapping(loaded, source)
    pairs: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.replace(":", "=").partition("=")
        if not sep:
            raise ConfigError(f"{source}={raw!r}: {part!r} is not dim=size; {_FIX}")
        pairs[key.strip()] = value.strip()
    if not pairs:
        raise ConfigError(f"{source}={raw!r} names no dim; {_FIX}")
    return _from_mapping(pairs, source)


def parse(value: Any, name: str = "parallelism") -> Parallelism:
    """The ``parallelism`` setting's value as a :class:`Parallelism` (sizes unresolved).

    Args:
        value: a mapping dim -> size, text (``"dp_shard=2,tp=2"`` or JSON), a
            :class:`Parallelism`, or Accelerate's ``ParallelismConfig`` (read by its
            attributes ``dp_replicate_size``, ``dp_shard_size``, ``tp_size``, ``cp_size``;
            it has no pipeline dim, so pp is given as a mapping or text).
        name: the setting's name, for messages.

    Returns:
        The sizes.

    Raises:
        ConfigError: anything else, a dim that does not exist, a size that is not positive
            (or -1), or more than one -1.
    """
    if isinstance(value, Parallelism):
        return value
    if isinstance(value, str):
        return from_text(value, name)
    if isinstance(value, Mapping):
        return _from_mapping(value, name)
    if any(hasattr(value, a) for a in ACCELERATE_ATTRIBUTES):
        found = {a: getattr(value, a) for a in ACCELERATE_ATTRIBUTES if hasattr(value, a)}
        return _from_mapping(found, f"{name}={type(value).__name__}")
    raise ConfigError(f"{name}={value!r} is not a parallelism; {_FIX}")


def data_parallel_size(value: Any, world: int) -> int:
    """R x S on ``world`` processes for the ``parallelism`` setting's value (None: the world)."""
    if value is None:
        return world
    return parse(value).resolve(world).data_parallel


def data_group(dims: Parallelism, rank: int) -> tuple[int, Any]:
    """``rank``'s data-parallel rank and group: the R x S ranks of its (pp, tp) coordinate
    (collective: every rank makes every group, in the same order)."""
    import torch.distributed

    inner = dims.data_parallel * dims.tp
    groups = [
        torch.distributed.new_group(list(range(p * inner + t, (p + 1) * inner, dims.tp)))
        for p in range(dims.pp)
        for t in range(dims.tp)
    ]
    return rank % inner // dims.tp, groups[rank // inner * dims.tp + rank % dims.tp]


def build(dims: Parallelism, device_type: str) -> DeviceMesh:
    """The DeviceMesh over ``MESH_DIMS`` (R, S, T), or (P, R, S, T) with pp > 1, on every rank
    (collective: every rank builds it, in the same order)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, dims.shape, mesh_dim_names=dims.names)
