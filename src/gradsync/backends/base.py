"""The Backend protocol: what every adapter offers the Accelerator, and nothing more.

The Accelerator drives one accumulation window at a time through four hooks:

* ``begin_window(models)`` before the window's first micro-step,
* ``micro_step(model, boundary=...)`` around each micro-step's forward and backward,
* ``end_window(models)`` after the boundary micro-step,
* ``abort_window(models)`` when a micro-step raised or the window was broken off: the
  adapter clears every gradient the window accumulated, wherever the backend keeps it,
  so nothing of it reaches a later update.

What an adapter does in each hook is its own business.

``AdapterDefaults`` holds what most adapters do the same way (plain autograd gradients, a
``WindowScaler`` for fp16, ``torch.nn.utils`` clipping); each adapter derives from it once
and overrides only what differs. No adapter derives from another.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from gradsync._support import dist
from gradsync._support import torch_compat as _torch_compat
from gradsync.backends import _amp
from gradsync.config import RequestedPolicy, SyncPolicy
from gradsync.errors import CheckpointError, ConfigError, UsageError

if TYPE_CHECKING:
    from gradsync._plan.batch_plan import BatchPlan
    from gradsync.backends._amp import WindowScaler
    from gradsync.config import Config

__all__ = [
    "AdapterDefaults",
    "Backend",
    "Held",
    "RequestedPolicy",
    "SyncPolicy",
    "clear_grads",
    "is_frozen",
    "not_prepared",
    "refuse_native",
    "single_optimizer",
]


@dataclass(frozen=True)
class Held:
    """A prepared optimizer as a checkpoint sees it: its number in the checkpoint (``index``),
    the torch optimizer, and the indices of the prepared models whose parameters it holds.
    ``legacy``: the checkpoint was written by gradsync 0.1, whose files paired the optimizer
    with model ``index`` (one optimizer per model)."""

    index: int
    optimizer: torch.optim.Optimizer
    models: tuple[int, ...]
    legacy: bool = False


def single_optimizer(
    backend: str, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], why: str
) -> torch.optim.Optimizer | None:
    """The one optimizer of ``model`` on a backend that wraps model and optimizer together
    (``why``): a ConfigError for several, or for one that also holds another model's
    parameters."""
    if len(optimizers) > 1:
        raise ConfigError(
            f"backend={backend!r} takes one optimizer per model ({why}); {len(optimizers)} "
            f"optimizers hold parameters of the {type(model).__name__}: use one optimizer with "
            "several parameter groups instead"
        )
    if not optimizers:
        return None
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizers[0].param_groups for p in g["params"] if id(p) not in own)
    if foreign:
        raise ConfigError(
            f"backend={backend!r} cannot run one optimizer over several models ({why}): the "
            f"{type(optimizers[0]).__name__} also holds {foreign} parameters of another model; "
            "give each trained model its own optimizer, or put the models in one nn.Module"
        )
    return optimizers[0]


class Backend(Protocol):
    """One distributed backend, seen through what accumulation needs."""

    name: ClassVar[str]
    #: The layout of its checkpoints: backends of one format load each other's (a setting
    #: may choose it, set at ``setup``: DDP stages of a pipeline write DCP).
    checkpoint_format: str
    #: Its checkpoints saved at a boundary load on another world size.
    reshardable: ClassVar[bool]
    #: Globals (``module.name``) its checkpoint files may name besides torch's
    #: ``weights_only`` set: a checkpoint naming any other is refused before loading.
    checkpoint_globals: ClassVar[frozenset[str]]
    #: Accelerate's checkpoint layout it writes beside its own: "plain" (the full
    #: weights and optimizer state of one process or DDP), "sharded_dcp" (Accelerate's
    #: FSDP2 ``SHARDED_STATE_DICT`` folders), "full_state" (Accelerate's FSDP2
    #: ``FULL_STATE_DICT`` files) or "engine_tag" (a DeepSpeed engine's own checkpoint under
    #: Accelerate's tag), both through ``save_accelerate`` / ``load_accelerate``; or ""
    #: (none). A setting may choose it (set at ``setup``).
    accelerate_layout: str
    #: The other Accelerate layouts ``load_accelerate`` reads besides ``accelerate_layout``.
    accelerate_reads: ClassVar[frozenset[str]]
    policy: SyncPolicy
    policy_reason: str  # why the adapter resolved that policy, with its numbers ("" if nothing)
    owns_group: bool  # gradsync created the process group (and releases it)
    scaler: (
        WindowScaler | None
    )  # the fp16 loss scaler the adapter drives (None: none / the backend's own)

    @property
    def device(self) -> torch.device: ...

    @property
    def data_parallel(self) -> dist.DataParallel:
        """The ranks that read distinct micro-batches (after ``setup``): the world, or on an
        N-D mesh the data-parallel ranks of this rank's tensor-parallel coordinate."""

    def setup(self, config: Config) -> None:
        """Join (or create) the process group and pick the device. ``config`` is read here
        and not kept for later: what the adapter needs of it, it copies."""

    def prepare(
        self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], plan: BatchPlan
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        """Wrap the model (DDP / FSDP2 / engine). ``optimizers`` are those that hold any of its
        parameters (an optimizer may also hold other models'); the adapter re-points them at
        what it made of the parameters and returns them in order (an adapter that builds
        the optimizer itself returns its own in that place, or a new one when none was
        given), or refuses in one line what the backend cannot do."""

    def attach(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> torch.optim.Optimizer:
        """An optimizer prepared in a later call than ``model`` (already wrapped), holding its
        parameters: the optimizer to use, or a one-line refusal where the backend builds its
        wrapper from model and optimizer together."""

    def sync_next_backward(self, model: torch.nn.Module) -> None:
        """Inside a boundary ``micro_step`` forced by the user (``trigger_sync_in_backward``):
        make the next backward of ``model`` reduce even if its forward ran off the boundary."""

    def user_paused_sync(self, model: torch.nn.Module) -> bool:
        """The user turned ``model``'s own gradient synchronisation off around the
        micro-steps (DDP's ``no_sync()`` entered by them, a LocalSGD): a boundary that
        reduces nothing is then what they asked for, not a deferral gone wrong."""

    def pause_sync(self, model: torch.nn.Module) -> AbstractContextManager[None]:
        """Keep ``model``'s gradients local for as long as the block lasts, boundaries
        included (LocalSGD: each process steps on its own gradients and the parameters are
        averaged now and then). A ConfigError where the processes do not each hold the
        whole model."""

    def begin_window(self, models: Sequence[torch.nn.Module]) -> None:
        """A window starts: clear the gradients ``models`` hold, the way the backend needs
        (the prepared optimizers' were cleared already)."""

    def micro_step(self, model: torch.nn.Module, *, boundary: bool) -> AbstractContextManager[None]:
        """Around one micro-step: backward accumulates locally unless ``boundary`` (or the
        policy reduces every micro-step); the backend's prior state is restored on exit."""

    def end_window(self, models: Sequence[torch.nn.Module]) -> None:
        """The boundary micro-step finished without error."""

    def abort_window(self, models: Sequence[torch.nn.Module]) -> None:
        """Drop the open window: clear every gradient it accumulated. Called on every rank
        together (it may run a collective)."""

    def autocast(self) -> AbstractContextManager[Any]:
        """The autocast the micro-steps run under (a no-op context when there is none)."""

    def gathering_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The modules of ``model`` whose forward runs a collective (FSDP2's units gather
        their parameters): ``on_oom="split"`` agrees before each of them."""

    def forward_gathers(self, module: torch.nn.Module) -> bool:
        """Whether the next forward of ``module`` (one of ``gathering_modules``) runs its
        collective (parameters already gathered need none)."""

    def backward_communicates(self, boundary: bool) -> bool:
        """Whether the backward of a micro-step (a boundary's or not) runs a collective."""

    def oom_split_refusal(self) -> str | None:
        """Why ``on_oom="split"`` cannot work here, in a few words (None: it can)."""

    def backward(self, loss: torch.Tensor, factor: float = 1.0, **kwargs: Any) -> None:
        """Run the backward pass of ``loss * factor`` (``factor``: gradsync's scaling, e.g.
        1 / the window's size; an fp16 adapter also multiplies by the loss scale);
        ``kwargs`` go to torch's backward (``retain_graph``, ``inputs``, ...)."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """At a boundary, before clipping: bring the optimizer's gradients back to their true
        scale (fp16; once per window however often it is called; a no-op otherwise)."""

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Apply the optimizer step at a boundary; return whether it was really applied
        (False: skipped, e.g. an fp16 overflow on some rank)."""

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        """Clear the gradients the optimizer holds."""

    def clip_grad_norm_(
        self,
        model: torch.nn.Module,
        parameters: Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        """Clip to ``max_norm`` and return the GLOBAL gradient norm (equal on all ranks)."""

    def clip_grad_value_(
        self, model: torch.nn.Module, parameters: Iterable[torch.Tensor], clip_value: float
    ) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]`` (at a boundary)."""

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module inside whatever wrapper ``prepare`` put around it."""

    def state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """The full, unsharded state dict on CPU (at least on rank 0)."""

    def barrier(self) -> None:
        """Wait until every rank reaches this point."""

    def save(
        self,
        path: Path,
        models: Sequence[torch.nn.Module],
        optimizers: Sequence[Held],
        *,
        window_open: bool,
    ) -> None:
        """Write the models and the optimizers (each with the models whose parameters it
        holds) into the folder ``path`` (collective). With ``window_open``, also the open
        window's local gradients of this rank, or a one-line error where the backend cannot."""

    def load(
        self,
        path: Path,
        models: Sequence[torch.nn.Module],
        optimizers: Sequence[Held],
        *,
        window_open: bool,
        trusted: bool = False,
    ) -> None:
        """Read back what ``save`` wrote (collective); check before changing anything. Files
        are read without running code from them unless ``trusted``. A ``Held`` with
        ``legacy`` set was written by gradsync 0.1 (one optimizer per model, stored with it)."""

    def save_accelerate(
        self, path: Path, models: Sequence[torch.nn.Module], optimizers: Sequence[Held]
    ) -> None:
        """Write the models and optimizers in Accelerate's layout of this backend
        (``accelerate_layout`` other than "plain"; collective)."""

    def load_accelerate(
        self,
        path: Path,
        models: Sequence[torch.nn.Module],
        optimizers: Sequence[Held],
        *,
        trusted: bool = False,
    ) -> None:
        """Read back what ``save_accelerate`` (or Accelerate) wrote (collective); check
        before changing anything."""


_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def _seed(loss: torch.Tensor, factor: float) -> torch.Tensor | None:
    """``factor`` as a new scalar tensor like ``loss``, to seed its backward with; None where
    that would not be the same as ``(loss * factor).backward()``: a loss that is not a
    scalar, or a leaf. New on every call, never cached: autograd may keep the seed (or a
    view of it, for a loss that is a view of a parameter) as a gradient and add into it."""
    if loss.dim() != 0 or loss.grad_fn is None:
        return None
    return torch.full((), factor, dtype=loss.dtype, device=loss.device)


class AdapterDefaults:
    """The hooks most adapters share. An adapter derives from this class once, sets what it
    needs in ``__init__`` and ``setup``, and overrides only the hooks that differ.

    The defaults are those of a backend whose gradients live on the parameters (plain
    autograd, nothing sharded): a window starts and is dropped by clearing them, the
    micro-steps run under ``autocast()`` of ``_dtype``, fp16 goes through ``scaler`` (a
    :class:`~gradsync.backends._amp.WindowScaler`, or None), clipping is
    ``torch.nn.utils``' on the local (already reduced) gradients, and the state dict is the
    unwrapped module's, on the CPU.
    """

    checkpoint_globals: ClassVar[frozenset[str]] = frozenset()
    accelerate_layout: str = ""
    accelerate_reads: ClassVar[frozenset[str]] = frozenset()
    policy: SyncPolicy
    policy_reason: str  # why the adapter resolved that policy, with its numbers ("" if nothing)
    owns_group: bool  # gradsync created the process group (and releases it)
    scaler: WindowScaler | None

    def __init__(self) -> None:
        self.policy = "defer"
        self.policy_reason = ""
        self.owns_group = False
        self.scaler = None
        self._device = torch.device("cpu")
        self._dtype: torch.dtype | None = None  # the micro-steps' autocast dtype (None: none)
        # What prepare does to the modules, copied from the Config at setup by the adapters
        # that do it: activation_checkpointing, and torch.compile's arguments (None: off).
        self._checkpointing: Any = None
        self._compile: dict[str, Any] | None = None

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def data_parallel(self) -> dist.DataParallel:
        return dist.world_data_parallel()

    def attach(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> torch.optim.Optimizer:
        return optimizer  # the wrapper left the parameters (or replaced them before it was built)

    def sync_next_backward(self, model: torch.nn.Module) -> None:
        return None  # the boundary micro_step's state is read when backward runs

    def user_paused_sync(self, model: torch.nn.Module) -> bool:
        return False  # a boundary micro-step reduces whatever the user set before it

    def pause_sync(self, model: torch.nn.Module) -> AbstractContextManager[None]:
        name = getattr(self, "name", type(self).__name__)
        raise ConfigError(
            f"LocalSGD needs every process to hold the whole model and step it alone; the "
            f"{name} backend shards it or reduces inside its engine: use backend='ddp', or "
            "pass LocalSGD(..., enabled=False)"
        )

    def begin_window(self, models: Sequence[torch.nn.Module]) -> None:
        clear_grads(models)

    def end_window(self, models: Sequence[torch.nn.Module]) -> None:
        return None

    def abort_window(self, models: Sequence[torch.nn.Module]) -> None:
        # The window's gradients live on the parameters: clearing them drops the window.
        clear_grads(models)

    def autocast(self) -> AbstractContextManager[Any]:
        return _amp.autocast(self._device, self._dtype)

    def gathering_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return []  # the parameters are whole on every rank: a forward runs no collective

    def forward_gathers(self, module: torch.nn.Module) -> bool:
        return True

    def backward_communicates(self, boundary: bool) -> bool:
        return boundary or self.policy != "defer"

    def oom_split_refusal(self) -> str | None:
        return None

    def backward(self, loss: torch.Tensor, factor: float = 1.0, **kwargs: Any) -> None:
        scaled = loss if self.scaler is None else self.scaler.scale(loss)
        if factor != 1.0:
            seed = _seed(scaled, factor)
            if seed is None:  # not a plain scalar with a graph: scale the loss itself
                scaled = scaled * factor
            else:  # the scaling as backward's seed: no extra op in the graph
                kwargs["gradient"] = seed
        scaled.backward(**kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self.scaler is not None:  # skips on every rank when any rank found inf/NaN
            return self.scaler.step(optimizer)
        optimizer.step()
        return True

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        if set_to_none and type(optimizer).zero_grad is _TORCH_ZERO_GRAD:
            # What torch's zero_grad(set_to_none=True) does, without its profiler record
            # (tens of microseconds on the CPU, once per window).
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
            return
        optimizer.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(
        self,
        model: torch.nn.Module,
        parameters: Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        # At a boundary the gradients are reduced: the local norm is the global one.
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(
        self, model: torch.nn.Module, parameters: Iterable[torch.Tensor], clip_value: float
    ) -> None:
        torch.nn.utils.clip_grad_value_(parameters, clip_value)  # element-wise

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return _torch_compat.uncompiled(model)

    def state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        return {k: v.detach().cpu() for k, v in self.unwrap(model).state_dict().items()}

    def barrier(self) -> None:
        dist.barrier()

    def save_accelerate(
        self, path: Path, models: Sequence[torch.nn.Module], optimizers: Sequence[Held]
    ) -> None:
        raise CheckpointError(f"{type(self).__name__} writes no Accelerate layout of its own")

    def load_accelerate(
        self,
        path: Path,
        models: Sequence[torch.nn.Module],
        optimizers: Sequence[Held],
        *,
        trusted: bool = False,
    ) -> None:
        raise CheckpointError(f"{type(self).__name__} reads no Accelerate layout of its own")


def not_prepared(
    model: torch.nn.Module,
    expected: str,
    *,
    why: str = "",
    fix: str = "`model = accel.prepare(model)`",
) -> UsageError:
    """The UsageError for ``accumulate()`` given a model other than the one ``prepare``
    returned: what it got, what it expected (``expected``), what would go wrong (``why``)
    and the fix."""
    so = f", so {why}" if why else ""
    return UsageError(
        f"accumulate() got a {type(model).__name__}, not the {expected} that accel.prepare() "
        f"returned{so}; pass the prepared model: {fix}"
    )


def refuse_native(policy: str, backend_name: str) -> None:
    """ "native" names DeepSpeed's own accumulation: a ConfigError on any other backend."""
    if policy == "native":
        raise ConfigError(
            f"sync_policy='native' is DeepSpeed's; with backend={backend_name!r} use 'defer', "
            "'every_step' or 'auto'"
        )


def is_frozen(model: torch.nn.Module) -> bool:
    """No parameter of ``model`` is trained (a reference or teacher model)."""
    return not any(p.requires_grad for p in model.parameters())


def clear_grads(models: Iterable[torch.nn.Module]) -> None:
    """Drop the ``.grad`` of every parameter of ``models`` (where plain autograd keeps them)."""
    for model in models:
        for p in model.parameters():
            p.grad = None
