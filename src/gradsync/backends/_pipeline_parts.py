"""Pipeline stages from stage modules that share the model's parameters: a callable split's
modules, or the parts of a Transformers decoder (``_pipeline_decoder.parts``), several on one
rank (``pp_stages_per_rank`` V > 1) or one (a callable split's stage, run by ``Named``).

The rank's root is the model itself with every module of the other ranks' stages removed,
so its parameter names are the whole model's (a checkpoint reshards to one process by
name). Each kept stage is run by its own module; its *steps* are the outermost modules of
the root that hold only that stage's parameters, sharded by FSDP2 as one unit each (the
root never runs forward, so no stage parameter may be left to the root's own unit).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from gradsync.errors import ConfigError

__all__ = ["Named", "keep"]


class Named(nn.Module):
    """One stage of a callable split, named as in the whole model: it holds the model's root
    (the other stages removed) under the root's own names, so its state dict names are the
    whole model's (two stages' fresh ``nn.Sequential`` would both be numbered from 0), and its
    forward runs the stage's module."""

    _run: Callable[..., Any]

    def __init__(self, root: nn.Module, run: nn.Module) -> None:
        super().__init__()
        for attr in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            object.__setattr__(self, attr, getattr(root, attr))
        object.__setattr__(self, "_run", run)  # not a child: its modules are the root's

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(*args, **kwargs)


def _ids(module: nn.Module) -> set[int]:
    return {id(p) for p in module.parameters()}


def keep(
    model: nn.Module, runs: Sequence[nn.Module], indices: Sequence[int], what: str
) -> list[list[nn.Module]]:
    """Remove from ``model`` every module that the stages in ``indices`` do not run
    (``runs[s]`` runs stage s); return the steps of each kept stage, in the order of
    ``indices``. One ConfigError line (``what`` names the split) when a parameter belongs to
    two stages, is not the model's, or shares a module with another stage's, or a parameter
    or buffer of the model is in no stage."""
    owner: dict[int, int] = {}
    for s, run in enumerate(runs):
        for p in run.parameters():
            if owner.setdefault(id(p), s) != s:
                raise ConfigError(
                    f"{what}: stages {owner[id(p)]} and {s} share a parameter (tied weights), "
                    "which cannot cross stages; untie it or keep both uses in one stage"
                )
    if not owner.keys() <= _ids(model):
        raise ConfigError(
            f"{what} made a stage with parameters that are not the model's; each stage must "
            "be made of the model's own modules (submodules, or an nn.Sequential slice of them)"
        )
    run_tensors = {id(t) for run in runs for t in (*run.parameters(), *run.buffers())}
    named = [*model.named_parameters(), *model.named_buffers()]
    left = [n for n, t in named if id(t) not in run_tensors]
    if left:
        raise ConfigError(
            f"{what} leaves {len(left)} of the model's parameters and buffers in no stage "
            f"({left[0]!r} first), which the pipeline would never run; give every module to "
            "a stage"
        )
    others = {i for i, s in owner.items() if s not in indices}
    _prune(model, {id(m) for i in indices for m in runs[i].modules()})
    if _ids(model) & others:
        raise ConfigError(
            f"{what} puts the parameters of one module in two stages; cut between modules"
        )
    steps = []
    for s in indices:
        wanted = {i for i, o in owner.items() if o == s}
        found = _outermost(model, wanted)
        if set().union(*map(_ids, found)) != wanted:
            raise ConfigError(
                f"{what}: stage {s} holds a parameter set directly on a module that also "
                "holds another stage's; cut between modules"
            )
        steps.append(found)
    return steps


def _prune(parent: nn.Module, kept: set[int]) -> None:
    """Remove from ``parent`` every module that is neither one of ``kept`` (ids of the modules
    the kept stages run) nor holds one: the other stages' modules, parameter-less ones (and
    their buffers) included."""
    for key, child in list(parent._modules.items()):
        if child is None or id(child) in kept:
            continue
        if any(id(m) in kept for m in child.modules()):
            _prune(child, kept)
        else:
            del parent._modules[key]


def _outermost(parent: nn.Module, wanted: set[int]) -> list[nn.Module]:
    out: list[nn.Module] = []
    for child in parent.children():
        held = _ids(child)
        if held and held <= wanted:
            out.append(child)
        elif held & wanted:
            out += _outermost(child, wanted)
    return out
