"""fairscale (legacy): ShardedDataParallel + OSS, with ``no_sync()`` off the boundary.

fairscale 0.4.13 (2022) is unmaintained; FSDP2 (``backend="fsdp"``) is the supported
sharded path. ``prepare`` wraps the optimizer in ``OSS`` (each rank keeps the optimizer
state of its shard of the parameters) and the model in ``ShardedDataParallel``, which
reduces each gradient to the rank that owns it and leaves the others' copies stale. Two
rules keep that correct under accumulation (see docs/fairscale.md):

* gradients are zeroed in place, never set to None: ShardedDataParallel's reduce buckets
  are views of the gradients, and a fresh gradient tensor is silently never reduced;
* ``no_sync()`` wraps forward and backward off the boundary.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from gradsync._plan.batch_plan import BatchPlan
from gradsync._support import dist
from gradsync.backends import _amp, _compression, _fairscale_compat, _group, _plain_state
from gradsync.backends._fairscale_compat import OSS, FullyShardedDataParallel, ShardedDataParallel
from gradsync.backends.base import (
    AdapterDefaults,
    Held,
    clear_grads,
    is_frozen,
    not_prepared,
    refuse_native,
    single_optimizer,
)
from gradsync.config import Config
from gradsync.errors import ConfigError


class ConsolidatingOSS(OSS):  # type: ignore[valid-type,misc,unused-ignore]  # untyped
    """OSS whose ``state_dict()`` is the full optimizer state on every rank (a collective:
    call it on all ranks), and whose ``load_state_dict`` leaves the caller's dict intact."""

    def state_dict(self, all_ranks: bool = True) -> dict[str, Any]:
        state: dict[str, Any] = super().state_dict(all_ranks=all_ranks)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # OSS empties the entries of the parameters this rank does not own, in place.
        super().load_state_dict({**state_dict, "state": dict(state_dict["state"])})


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (OSS builds its shard with them)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


class FairscaleBackend(AdapterDefaults):
    """fp16 is refused, so ``scaler`` stays None: the defaults' backward and step are the
    plain ones (OSS's step updates this rank's shard, then broadcasts the parameters), and
    the defaults' ``clip_grad_value_`` clamps the owners' reduced gradients (the other
    ranks' stale copies are not used by their step). Gradients are zeroed in place, never
    set to None (see the module's docstring)."""

    #: Plain files from rank 0, the OSS optimizer state gathered first (its own layout).
    checkpoint_format: str = "plain-oss"
    reshardable: ClassVar[bool] = False
    name: ClassVar[str] = "fairscale"

    def __init__(self) -> None:
        super().__init__()
        self.sdp_kwargs: dict[str, Any] = {}
        self._oss: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()
        self._reduced: set[int] = set()  # ids of the models that reduced in the open window

    def setup(self, config: Config) -> None:
        refuse_native(config.sync_policy, self.name)
        self.policy = "every_step" if config.sync_policy == "every_step" else "defer"
        if config.sync_policy == "auto":
            self.policy_reason = (
                "auto -> defer: each rank holds its full local gradients during backward either "
                "way; deferring keeps them until the boundary, as DDP's no_sync() does"
            )
        if config.mixed_precision == "fp16":
            raise ConfigError(
                "mixed_precision='fp16' is not supported with backend='fairscale' (its sharded "
                "loss scaling is not driven by gradsync's window); use 'bf16' or 'no'"
            )
        self._dtype = _amp.autocast_dtype(config, _group.local_device())
        _compression.supported(config, self.name, (), "ShardedDataParallel reduces in fp32")
        self.sdp_kwargs = dict(config.fairscale_kwargs or {})
        self.owns_group = _group.ensure_process_group(
            self.name,
            want_audit=config.audit,
            self_check=config.self_check and self.policy == "defer",
            timeout=config.timeout,
        )
        self._device = _group.local_device()

    def prepare(
        self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], plan: BatchPlan
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        optimizer = single_optimizer(
            self.name,
            model,
            optimizers,
            "ShardedDataParallel reduces to the owner of each OSS shard",
        )
        if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            raise ConfigError(
                "backend='fairscale' got a model wrapped in fairscale's FullyShardedDataParallel, "
                "which gradsync does not support (unmaintained, CUDA only); pass the plain model "
                "with backend='fsdp' (PyTorch FSDP2) to shard parameters"
            )
        if isinstance(model, ShardedDataParallel) or isinstance(optimizer, OSS):
            raise ConfigError(
                f"backend='fairscale' got an already wrapped {type(model).__name__} / "
                f"{type(optimizer).__name__}; pass the plain model and the plain torch optimizer: "
                "prepare() wraps them in ShardedDataParallel and OSS"
            )
        if optimizer is None and is_frozen(model):
            # A reference / teacher model: nothing to reduce, never wrapped.
            model = model.to(self._device)
            _group.broadcast_from_rank0(model)
            return model, []
        if optimizer is None:
            raise ConfigError(
                "backend='fairscale' needs the optimizer in the same prepare() call "
                "(ShardedDataParallel reduces each gradient to the rank whose OSS shard owns it): "
                "`model, optimizer = accel.prepare(model, optimizer)`"
            )
        if optimizer.state:
            raise ConfigError(
                f"the {type(optimizer).__name__} already has state for {len(optimizer.state)} "
                "parameters; backend='fairscale' rebuilds it as a sharded OSS optimizer, which "
                "would drop that state: prepare before the first optimizer step"
            )
        model = model.to(self._device)
        groups = [{**group, "params": list(group["params"])} for group in optimizer.param_groups]
        oss = ConsolidatingOSS(groups, optim=type(optimizer), **_constructor_defaults(optimizer))
        # Broadcasts rank 0's parameters and buffers, so every rank starts from the same weights.
        wrapped = ShardedDataParallel(model, oss, **self.sdp_kwargs)
        self._oss[wrapped] = oss
        return wrapped, [oss]

    def _sharded_optimizer(self, model: torch.nn.Module) -> Any:
        if not isinstance(model, ShardedDataParallel) or model not in self._oss:
            raise not_prepared(
                model,
                "ShardedDataParallel model",
                why="gradients cannot be deferred or reduced correctly",
                fix="`model, optimizer = accel.prepare(model, optimizer)`",
            )
        return self._oss[model]

    def attach(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> torch.optim.Optimizer:
        raise ConfigError(
            f"backend={self.name!r} got the {type(optimizer).__name__} in a later prepare() call "
            "than its model (ShardedDataParallel is built from the model and its OSS optimizer together); prepare both in one call: "
            "`model, optimizer = accel.prepare(model, optimizer)`"
        )

    def begin_window(self, models: Sequence[torch.nn.Module]) -> None:
        for model in models:  # in place: a gradient set to None falls out of its reduce bucket
            model.zero_grad(set_to_none=False)
        self._reduced.clear()

    @contextlib.contextmanager
    def micro_step(self, model: torch.nn.Module, *, boundary: bool) -> Iterator[None]:
        if not isinstance(model, ShardedDataParallel) and is_frozen(model):
            with self.autocast():  # a prepared reference model: nothing to defer
                yield
            return
        oss = self._sharded_optimizer(model)
        if self.policy == "every_step" and id(model) in self._reduced:
            self._rescale_for_next_reduction(oss)
        defer = not boundary and self.policy != "every_step"
        with (
            _fairscale_compat.no_sync(model) if defer else contextlib.nullcontext(),
            self.autocast(),
        ):
            yield
        if not defer:
            self._reduced.add(id(model))

    @staticmethod
    @torch.no_grad()
    def _rescale_for_next_reduction(oss: Any) -> None:
        """Make a second reduction in one window add up instead of overwrite.

        A reduction leaves on the owner ``mean over ranks`` of the gradient and garbage (or
        None) elsewhere, and the next one multiplies every rank's gradient by 1/world before
        summing onto the owner. Scaling the owner's reduced gradient by world and zeroing
        the stale copies makes that next reduction yield reduced + mean(new micro-step).
        """
        owned = {id(p) for group in oss.partition_parameters()[oss.rank] for p in group["params"]}
        for group in oss.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if id(p) in owned:
                    p.grad.mul_(oss.world_size)
                else:
                    p.grad.zero_()

    def abort_window(self, models: Sequence[torch.nn.Module]) -> None:
        for model in models:
            if isinstance(model, ShardedDataParallel):
                _fairscale_compat.finish_reductions(model)
                model.zero_grad(set_to_none=False)  # zeroes its reduce buckets too
            else:
                clear_grads([model])
        self._reduced.clear()

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        # Always in place: a gradient set to None falls out of its reduce bucket (see above).
        optimizer.zero_grad(set_to_none=False)

    def clip_grad_norm_(
        self,
        model: torch.nn.Module,
        parameters: Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        oss = self._sharded_optimizer(model)
        given = {id(p) for p in parameters}
        held = [p for group in oss.param_groups for p in group["params"]]
        left_out = sum(1 for p in held if id(p) not in given)
        if left_out:
            raise ConfigError(
                f"clip_grad_norm_() got {len(held) - left_out} of the optimizer's {len(held)} "
                "parameters; backend='fairscale' clips through OSS.clip_grad_norm, which covers "
                "all of them: pass model.parameters()"
            )
        # Each rank's norm of the gradients it owns, combined over the ranks: the global norm.
        norm: torch.Tensor = oss.clip_grad_norm(max_norm, norm_type)
        return norm.detach()

    def gathering_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [model] if isinstance(model, ShardedDataParallel) else []

    def forward_gathers(self, module: torch.nn.Module) -> bool:
        # Off the boundary no buffer is broadcast; at it, every buffer from rank 0.
        return _fairscale_compat.broadcasts_buffers(module)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module if isinstance(model, ShardedDataParallel) else model

    def state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        # A copy: OSS keeps the parameters as views of its flat broadcast buffers.
        return {
            k: v.detach().to("cpu", copy=True) for k, v in self.unwrap(model).state_dict().items()
        }

    def save(
        self,
        path: Path,
        models: Sequence[torch.nn.Module],
        optimizers: Sequence[Held],
        *,
        window_open: bool,
    ) -> None:
        if window_open:  # ShardedDataParallel's reduce buckets are views of the window's gradients
            _plain_state.refuse_open_window(
                self.name, "its window gradients live in its reduce buckets"
            )
        _plain_state.save(
            path,
            models,
            optimizers,
            self.unwrap,
            dist.rank(),
            window_open=False,
            gathered_optimizers=True,
        )

    def load(
        self,
        path: Path,
        models: Sequence[torch.nn.Module],
        optimizers: Sequence[Held],
        *,
        window_open: bool,
        trusted: bool = False,
    ) -> None:
        _plain_state.load(
            path, models, optimizers, self.unwrap, dist.rank(), window_open=False, trusted=trusted
        )
