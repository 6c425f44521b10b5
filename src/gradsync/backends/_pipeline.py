"""Pipeline parallelism: the model cut into P stages along the mesh's outermost dim ("pp"), one
stage per rank, each stage sharded by FSDP2 (or replicated by DDP) over the data-parallel dims
of its pipeline coordinate.

One micro-step of gradsync's window is one schedule step of torch.distributed.pipelining
(``pp_microbatches`` micro-batches, GPipe or 1F1B). Inside a schedule step torch's stage
keeps the data-parallel reduction off for each micro-batch's backward and runs it with the
last one. gradsync's stage ends the schedule step with the flags the micro-step chose
instead (``_pipeline_sync``: how for each wrapper): off the boundary under "defer" each stage
keeps its gradients locally and adds the next schedule steps' to them, so the data-parallel
reduction runs once per window of k schedule steps; under "every_step" it runs at the end of
every schedule step.
The activations sent between stages are the computation (audited on their own ``pp`` line).
With ``pp_stages_per_rank`` V > 1 (Interleaved1F1B) the model is cut into P x V stages, rank
r keeping stages r, r + P, ... (by paths, a callable's P x V modules, or a decoder's layers:
``_pipeline_parts``): each one's steps become an FSDP2 unit of the rank's root, and the
schedule step ends (the flags above) once the last of them has ended its backward.

The split: ``pp_split`` names the module paths where each stage after the first begins, in an
``nn.Sequential`` model (nested ``nn.Sequential`` steps are opened where a path points into
them) or a Transformers decoder (``"model.layers.4"``: ``_pipeline_decoder``), or is a callable
``(model, num_stages) -> stage modules`` made of the model's own modules. Every rank keeps
only its own stage: the other steps are removed from their parents, so the stage's
parameter names are the whole model's (a callable's stage is run by its module). A decoder's ``inputs`` may be a mapping with its padding mask, which
every rank has (each is given the micro-batch) and hands to its stages as a keyword.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from gradsync import audit
from gradsync._plan.batch_plan import BatchPlan
from gradsync.backends import (
    _group,
    _pipeline_canary,
    _pipeline_compat,
    _pipeline_decoder,
    _pipeline_parts,
)
from gradsync.errors import ConfigError, UsageError
from gradsync.mesh import Parallelism

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from gradsync.backends._pipeline_sync import StageSync
    from gradsync.config import Config

__all__ = [
    "Cut",
    "Pipeline",
    "Settings",
    "check_microbatches",
    "is_stage",
    "of",
    "stage_plan",
    "whole_names",
    "whole_state",
]

#: The attribute of a prepared stage module that holds its pipeline (a reference cycle, freed
#: with the stage).
_ATTRIBUTE = "_gradsync_pipeline"
_SCHEDULES: dict[str, Any] = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
}
_CALL = "loss = accel.pipeline_step(model, inputs, targets, loss_fn)"


def of(model: nn.Module) -> Pipeline:
    """The pipeline that runs ``model`` (a stage prepared with pp > 1).

    Raises:
        UsageError: ``model`` is not a pipelined model.
    """
    pipeline = getattr(model, _ATTRIBUTE, None)
    if not isinstance(pipeline, Pipeline):
        raise UsageError(
            f"accel.pipeline_step() got a {type(model).__name__} that is no pipeline stage; "
            "prepare the model with parallelism={'pp': P, ...} and pp_split=..., and pass "
            "the model prepare() returned"
        )
    return pipeline


def stage_plan(stage: nn.Module, plan: Any) -> Any:
    """A tensor-parallel plan resolved on the whole model, kept to ``stage``'s modules (a
    callable plan is given the stage itself)."""
    if not isinstance(plan, dict):
        return plan
    held = {name for name, _ in stage.named_modules()}
    return {name: style for name, style in plan.items() if name in held}


def is_stage(model: nn.Module) -> bool:
    """Whether ``model`` is a prepared pipeline stage."""
    return isinstance(getattr(model, _ATTRIBUTE, None), Pipeline)


def whole_names(stage: nn.Module) -> list[str]:
    """The state dict names of the whole model a prepared ``stage`` was cut from (a stage
    keeps them)."""
    return of(stage).names


def whole_state(stage: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The whole model's state dict from each stage's ``state`` (on the CPU): gathered over
    the pipeline's group, on every rank (a collective), in the whole model's order."""
    pipeline = of(stage)
    parts: list[Any] = [None] * torch.distributed.get_world_size(pipeline.group)
    torch.distributed.all_gather_object(parts, state, group=pipeline.group)
    merged = {k: v for part in parts for k, v in part.items()}
    order = [k for k in pipeline.names if k in merged]
    return {k: merged[k] for k in order + sorted(merged.keys() - set(order))}


def check_microbatches(microbatches: int, micro_batch_size: int | None, stages: int) -> None:
    """``pp_microbatches`` against the batch plan's micro-batch (when known), at prepare."""
    if micro_batch_size is not None and micro_batch_size % microbatches:
        raise ConfigError(
            f"pp_microbatches={microbatches} does not divide micro_batch_size="
            f"{micro_batch_size}: each schedule step splits one micro-batch into "
            f"pp_microbatches equal parts; pick a divisor of {micro_batch_size}"
        )
    if microbatches < stages:
        raise ConfigError(
            f"pp_microbatches={microbatches} is fewer than the pp={stages} stages: the "
            f"schedules need at least one micro-batch per stage; give pp_microbatches >= {stages}"
        )


def _units(seq: nn.Sequential, prefix: str, paths: Sequence[str]) -> list[tuple[str, Any, str]]:
    """The steps of ``seq`` in the order its forward runs them: (path, parent, key); a nested
    ``nn.Sequential`` is opened when a split path points inside it."""
    out: list[tuple[str, Any, str]] = []
    for key, child in seq._modules.items():
        path = f"{prefix}{key}"
        if isinstance(child, nn.Sequential) and any(p.startswith(path + ".") for p in paths):
            out += _units(child, path + ".", paths)
        else:
            out.append((path, seq, key))
    return out


def _cuts(model: nn.Module, paths: Sequence[str], stages: int) -> list[tuple[int, Any, str]]:
    """The model's steps as (stage, parent, key), having checked that ``paths`` cut them into
    ``stages`` non-empty stages; one ConfigError line otherwise (before any collective)."""
    name = f"pp_split={list(paths)!r}"
    if len(paths) != stages - 1:
        raise ConfigError(
            f"{name} names {len(paths)} module(s), and pp={stages} needs {stages - 1} (where "
            "each stage after the first begins)"
        )
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"{name} cuts an nn.Sequential, whose forward runs its modules in order, or a "
            f"Transformers decoder ('model.layers.i'), and got a "
            f"{type(model).__name__}; give pp_split a callable (model, num_stages) -> stages"
        )
    for path in paths:
        try:
            model.get_submodule(path)
        except AttributeError:
            raise ConfigError(
                f"{name}: {path!r} names no module of the {type(model).__name__}; use the "
                "paths of model.named_modules(), e.g. '4' or 'blocks.2'"
            ) from None
    units = _units(model, "", paths)
    where = {path: i for i, (path, _, _) in enumerate(units)}
    starts = [0]
    for path in paths:
        if path not in where:
            raise ConfigError(
                f"{name}: {path!r} lies inside a module that is not an nn.Sequential, whose "
                "forward order is unknown; cut at a step of the sequence, or give a callable"
            )
        if where[path] <= starts[-1]:
            raise ConfigError(
                f"{name} leaves stage {len(starts) - 1} empty: {path!r} does not come after "
                "the previous cut; name the paths in the model's order"
            )
        starts.append(where[path])
    starts.append(len(units))
    for s in range(stages):
        held = [units[i][1]._modules[units[i][2]] for i in range(starts[s], starts[s + 1])]
        if not any(p.requires_grad for m in held for p in m.parameters()):
            raise ConfigError(
                f"{name} leaves stage {s} without trainable parameters; move the cut so that "
                "each stage holds a layer"
            )
    owner = [s for s in range(stages) for _ in range(starts[s], starts[s + 1])]
    return [(owner[i], parent, key) for i, (_, parent, key) in enumerate(units)]


class Cut:
    """Where ``split`` cuts ``model`` into ``stages`` stages, checked when made (one
    ConfigError line, before any collective); :meth:`stage` then keeps one of them."""

    def __init__(self, model: nn.Module, split: Any, stages: int) -> None:
        self._model = model
        self._made: list[nn.Module] | None = None
        self._steps: list[tuple[int, Any, str]] = []
        self._bounds: list[int] = []  # a Transformers decoder's: its first layer per stage
        self._what = "pp_split's callable" if callable(split) else f"pp_split={list(split)!r}"
        if callable(split):
            self._made = cast_modules(split(model, stages), stages)
        elif _pipeline_decoder.is_decoder(model):
            if len(split) != stages - 1:
                _cuts(model, list(split), stages)  # the same line as for a Sequential
            self._bounds = _pipeline_decoder.starts(model, list(split), stages)
        else:
            self._steps = _cuts(model, list(split), stages)

    def stage(self, index: int) -> nn.Module:
        """Stage ``index``: the model with every other stage's modules removed (the parameter
        names stay the whole model's), run by the callable's module where one made it."""
        if self._made is not None:
            root, _, runs = self.keep([index])
            return _pipeline_parts.Named(root, runs[0])
        if self._bounds:
            return _pipeline_decoder.stage(self._model, self._bounds, index)
        return self.keep([index])[0]

    @property
    def is_decoder(self) -> bool:
        """Whether the model is a Transformers decoder cut by layer names."""
        return bool(self._bounds)

    def keep(
        self, indices: Sequence[int]
    ) -> tuple[nn.Module, list[list[nn.Module]], list[nn.Module]]:
        """The model with every module of the stages not in ``indices`` removed (its root),
        each kept stage's steps (sharded as one unit each) and the module that runs it."""
        if self._made is not None or self._bounds:
            runs = self._made or _pipeline_decoder.parts(self._model, self._bounds)
            steps = _pipeline_parts.keep(self._model, runs, indices, self._what)
            return self._model, steps, [runs[i] for i in indices]
        parts = [
            [parent._modules[key] for owner, parent, key in self._steps if owner == index]
            for index in indices
        ]
        for owner, parent, key in self._steps:
            if owner not in indices:
                del parent._modules[key]
        return self._model, parts, [nn.Sequential(*steps) for steps in parts]


def cast_modules(made: Any, stages: int) -> list[nn.Module]:
    """A callable split's result, checked: ``stages`` modules, each with a trainable parameter."""
    found = list(made) if isinstance(made, Sequence | nn.ModuleList) else None
    if found is None or len(found) != stages or not all(isinstance(m, nn.Module) for m in found):
        raise ConfigError(
            f"pp_split's callable returned {type(made).__name__}, and pp={stages} needs a list "
            f"of {stages} nn.Modules (one per stage, in order)"
        )
    for s, module in enumerate(found):
        if not any(p.requires_grad for p in module.parameters()):
            raise ConfigError(
                f"pp_split's callable left stage {s} without trainable parameters; each stage "
                "must hold a layer"
            )
    return found


class Pipeline:
    """One rank's stage of a pipelined model and the schedule that runs it."""

    def __init__(
        self,
        module: nn.Module,
        *,
        index: int,
        stages: int,
        device: torch.device,
        group: Any,
        schedule: str,
        microbatches: int,
        sync: StageSync,
        parts: list[nn.Module] | None = None,
        masked: bool = False,
        names: list[str],
        orders: dict[int, list[list[str | None]]] | None = None,
    ) -> None:
        self.module = module
        self.group = group  # the pipeline's process group
        self.sync = sync  # the data-parallel side: the wrapper's flags around a schedule step
        #: the whole model's state dict names
        self.names = names
        #: id of each optimizer given with the model -> each of its groups' parameter names
        #: in the order it was given them, before the cut (None: another model's parameter)
        self.orders = orders or {}
        self.index = index
        self.stages = stages
        self.microbatches = microbatches
        self.is_first = index == 0
        self.is_last = index == stages - 1
        #: the stage's gradients when a schedule step starts
        self.grads: dict[nn.Parameter, torch.Tensor | None] = {}
        self._running = False
        self._factor = 1.0
        self._loss_fn: Callable[..., torch.Tensor] | None = None
        #: more than one stage on this rank (``parts``: the module running each): stages
        #: index, index + P, ... of P x len(parts), each ending its backward once per step
        self.parts = parts
        #: the stages take an ``attention_mask`` (a Transformers decoder's)
        self.masked = masked
        self._ended = 0
        #: on a torch newer than the tested range: checks the first window's schedule steps
        self.canary = _pipeline_canary.Canary()
        if parts is None:
            made: Any = _pipeline_compat.Stage(
                self._end_backward,
                self._put_back_grads,
                module,
                index,
                stages,
                device,
                group=group,
                reduces=sync.reduces,
            )
        else:
            made = [
                _pipeline_compat.Stage(
                    self._end_backward,
                    self._put_back_grads,
                    run,
                    index + j * stages,
                    stages * len(parts),
                    device,
                    group=group,
                    reduces=sync.reduces,
                )
                for j, run in enumerate(parts)
            ]
        self._schedule = _SCHEDULES[schedule](
            made, n_microbatches=microbatches, loss_fn=self._loss, scale_grads=False
        )
        module.register_forward_pre_hook(self._guard, prepend=True)
        object.__setattr__(module, _ATTRIBUTE, self)

    def _end_backward(self) -> None:
        self._ended += 1
        if self._ended == len(self.parts or [None]):  # every stage of this rank is done
            self._ended = 0
            try:
                self.sync.end_backward(self.module)
            except (AssertionError, RuntimeError) as error:  # torch's state is not as meant
                self.canary.failed(error)  # one line on an untested torch
                raise
            self.canary.closed += 1

    def _put_back_grads(self) -> None:
        # The first schedule step infers the shapes with a real forward and backward and
        # then drops every gradient; a window's gradients from before it (a resumed window)
        # are put back.
        for param, grad in self.grads.items():
            param.grad = grad

    def _guard(self, module: nn.Module, args: Any) -> None:
        if not self._running:
            raise UsageError(
                f"this model is pipeline stage {self.index} of {self.stages}: a plain forward "
                f"cannot run the pipeline; inside `with accel.accumulate(model):` call {_CALL}"
            )

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target) * self._factor

    def step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[..., torch.Tensor],
        factor: float,
        *,
        mean: bool = True,
    ) -> torch.Tensor | None:
        """One schedule step over one micro-batch: forward and backward of its
        ``microbatches`` parts, each part's loss times ``factor``.

        Returns:
            On the last stage the micro-batch's loss, unscaled and detached: the mean of the
            parts' losses (``mean``), else their sum; None on the other stages.
        """
        inputs, keywords = self._feed(inputs)
        size = _rows(targets if self.is_last else inputs)
        if size is not None and size % self.microbatches:
            raise ConfigError(
                f"pp_microbatches={self.microbatches} does not divide this micro-batch of {size} "
                "samples; give a loader whose batches it divides (drop_last=True for the last)"
            )
        self.sync.begin(self.module, self.parts is not None)
        self.grads = {p: p.grad for p in self.module.parameters()}  # see _put_back_grads
        self._factor = factor
        self._loss_fn = loss_fn
        losses: list[torch.Tensor] = []  # each part's, as scaled (torch's schedule fills it)
        self._running = True
        self.canary.start()
        try:
            args = (inputs,) if self.is_first else ()
            target = targets if self.is_last else None
            self._schedule.step(
                *args, target=target, losses=losses, return_outputs=False, **keywords
            )
            self.canary.check(self.module, self.sync.flags, self.grads)
        finally:
            self._running = False
            self.grads = {}
            self.sync.finish()
        if not self.is_last:
            return None
        parts = torch.stack([loss.detach() for loss in losses])
        if factor == 0:  # a window without items: nothing was learned, nothing to unscale
            return parts.sum()
        return (parts.mean() if mean else parts.sum()) / factor

    def _feed(self, inputs: Any) -> tuple[Any, dict[str, Any]]:
        """The first stage's input, and the keywords every stage is given (each rank has
        the micro-batch, so the padding mask reaches every stage without being sent)."""
        if not isinstance(inputs, Mapping):
            return inputs, {}
        if not self.masked:
            raise UsageError(
                f"accel.pipeline_step() got inputs as a mapping (keys {sorted(inputs)}), which "
                "a Transformers decoder split takes; give this pipeline's first stage its input"
            )
        ids, mask = _pipeline_decoder.feed(inputs)
        return ids, ({} if mask is None else {"attention_mask": mask})


def _rows(value: Any) -> int | None:
    return int(value.shape[0]) if isinstance(value, torch.Tensor) and value.ndim else None


class Settings:
    """The pipeline's settings for an adapter that shards stages (pp > 1)."""

    def __init__(
        self, stages: int, split: Any, schedule: str, microbatches: int, per_rank: int = 1
    ) -> None:
        self.stages = stages
        self.per_rank = per_rank
        #: with several stages per rank: the steps of each of this rank's stages (``stage``),
        #: sharded as one unit each, and the module that runs each
        self.parts: list[list[nn.Module]] | None = None
        self.runs: list[nn.Module] | None = None
        self.masked = False  # the stages take an attention_mask (a Transformers decoder)
        self.split = split
        self.schedule = schedule
        self.microbatches = microbatches
        self._mesh: Any = None  # the named mesh (bind)
        #: ids of the parameters of the other stages (``stage``): they leave the optimizer
        self.dropped: set[int] = set()
        #: the whole model's state dict names (``stage``)
        self.names: list[str] = []
        #: the optimizers' parameter names in their given order (``stage``: ``Pipeline.orders``)
        self.orders: dict[int, list[list[str | None]]] = {}
        self.group: Any = None  # the pipeline's process group (bind)

    @classmethod
    def of(cls, config: Config, dims: Parallelism) -> Settings | None:
        """The settings when ``dims`` has pp > 1 (None otherwise); a ConfigError line when
        pp and ``pp_split`` do not come together."""
        if (dims.pp > 1) != (config.pp_split is not None):
            raise ConfigError(
                f"parallelism={dims.text()!r} has pp={dims.pp} and no pp_split says where the "
                "stages begin; give pp_split (module paths, or a callable (model, num_stages) "
                "-> stages)"
                if dims.pp > 1
                else f"pp_split=... cuts the model into pipeline stages, and parallelism="
                f"{dims.text()!r} has pp=1; give pp > 1, or drop pp_split"
            )
        if dims.pp == 1:
            return None
        microbatches = config.pp_microbatches or dims.pp
        per_rank = config.pp_stages_per_rank
        _check_per_rank(per_rank, config.pp_schedule)
        return cls(dims.pp, config.pp_split, config.pp_schedule, microbatches, per_rank)

    def bind(self, mesh: DeviceMesh) -> None:
        """The named mesh with its "pp" dim; its pipeline group labelled for the audit."""
        self._mesh = mesh
        group = mesh.get_group("pp")
        if group.size() == torch.distributed.get_world_size():
            # The mesh hands out the world group itself: label a copy, not the world.
            group = torch.distributed.new_group(list(range(group.size())))
        self.group = group
        audit.label_group(group, "pp")

    def stage(
        self,
        model: nn.Module,
        plan: BatchPlan,
        device: torch.device,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> nn.Module:
        """This rank's stage of ``model``, every rank starting from rank 0's weights; the
        split and the micro-batches checked before any collective. The names of the
        ``optimizers``' parameters are kept in their order before the cut (``orders``)."""
        check_microbatches(self.microbatches, plan.micro_batch_size, self.stages)
        cut = Cut(model, self.split, self.stages * self.per_rank)
        self.masked = cut.is_decoder
        self.names = list(model.state_dict())
        named = {id(p): n for n, p in model.named_parameters()}
        self.orders = {
            id(o): [[named.get(id(p)) for p in g["params"]] for g in o.param_groups]
            for o in optimizers
        }
        model.to(device)
        _group.broadcast_from_rank0(model)
        every = {id(p) for p in model.parameters()}
        rank = self._mesh.get_local_rank("pp")
        if self.per_rank > 1:  # stages rank, rank + P, ...: Interleaved1F1B's loop order
            held = range(rank, self.stages * self.per_rank, self.stages)
            stage, self.parts, self.runs = cut.keep(list(held))
        else:
            stage = cut.stage(rank)
        self.dropped = every - {id(p) for p in stage.parameters()}
        return stage

    def start(self, stage: nn.Module, device: torch.device, sync: StageSync) -> None:
        """The pipeline of the wrapped ``stage`` (``of(stage)`` finds it); ``sync``: what
        the wrapper does around a schedule step."""
        Pipeline(
            stage,
            index=self._mesh.get_local_rank("pp"),
            stages=self.stages,
            device=device,
            group=self.group,
            schedule=self.schedule,
            microbatches=self.microbatches,
            sync=sync,
            parts=self.runs,
            masked=self.masked,
            names=self.names,
            orders=self.orders,
        )


def _check_per_rank(per_rank: int, schedule: str) -> None:
    """``pp_stages_per_rank`` against the schedule: one ConfigError line."""
    if (per_rank > 1) != (schedule == "Interleaved1F1B"):
        raise ConfigError(
            f"pp_schedule={schedule!r} runs one stage per rank, and pp_stages_per_rank="
            f"{per_rank}; give pp_schedule='Interleaved1F1B' for several"
            if per_rank > 1
            else "pp_schedule='Interleaved1F1B' runs several stages on each rank, and "
            "pp_stages_per_rank=1; give pp_stages_per_rank >= 2"
        )
