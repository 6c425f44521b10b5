"""Model preparation the adapters share: activation checkpointing and torch.compile.

Each adapter calls these at its own place in ``prepare`` (e.g. fsdp checkpoints and
compiles the blocks before ``fully_shard``; ddp compiles the wrapped model).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradsync._support import torch_compat as _torch_compat
from gradsync.config import Config
from gradsync.errors import ConfigError

_MARK = "_gradsync_checkpointed"


def compile_kwargs(config: Config) -> dict[str, Any] | None:
    """torch.compile's keyword arguments for ``Accelerator(compile=...)`` (None: do not compile)."""
    if config.compile is None or config.compile is False:
        return None
    return {} if config.compile is True else dict(config.compile)


def compile_in_place(module: nn.Module, kwargs: dict[str, Any] | None) -> None:
    """``module.compile(**kwargs)`` (the module keeps its type and state_dict keys), unless
    no compile was asked for or the user already compiled it."""
    if kwargs is not None and _torch_compat.uncompiled(module) is module:
        module.compile(**kwargs)


def refuse_wrapped(
    model: nn.Module,
    backend: str,
    config_checkpointing: Any,
    compile_kwargs: dict[str, Any] | None,
    also: tuple[str, ...] = (),
) -> None:
    """A model the user already wrapped for the backend is taken as it is; checkpointing or
    compiling it (or the settings named in ``also``) would have to happen before that
    wrapping, so asking for any of them is an error."""
    asked = [
        name
        for name, value in (
            ("activation_checkpointing", config_checkpointing),
            ("compile", compile_kwargs),
        )
        if value is not None
    ] + list(also)
    if asked:
        raise ConfigError(
            f"{' and '.join(asked)} with a model already wrapped in {type(model).__name__}: "
            f"backend={backend!r} applies them before wrapping; pass the unwrapped module to "
            "prepare(), or apply them yourself before you wrap it"
        )


def _picker(model: nn.Module, spec: Any) -> Callable[[nn.Module], bool]:
    if callable(spec) and not isinstance(spec, type):
        return lambda m: bool(spec(m))
    wanted = [spec] if isinstance(spec, str | type) else list(spec)
    names = {w for w in wanted if isinstance(w, str)}
    classes = tuple(w for w in wanted if isinstance(w, type))
    present = sorted({type(m).__name__ for m in model.modules()})

    def pick(m: nn.Module) -> bool:
        return type(m).__name__ in names or (bool(classes) and isinstance(m, classes))

    missing = sorted(names - set(present)) + sorted(
        c.__name__ for c in classes if not any(isinstance(m, c) for m in model.modules())
    )
    if missing:
        raise ConfigError(
            f"activation_checkpointing={missing} names no module of this "
            f"{type(model).__name__}; use class names from: {', '.join(present)} (or a callable "
            "module -> bool)"
        )
    return pick


def checkpoint_modules(model: nn.Module, spec: Any) -> list[nn.Module]:
    """Make the forward of each module ``spec`` selects recompute in backward instead of
    keeping its activations; returns those modules (outermost only: a selected module's
    own submodules are recomputed with it). ``spec``: a class name, a class, a list of
    those, or a callable ``module -> bool``; None selects nothing."""
    if spec is None:
        return []
    pick = _picker(model, spec)
    chosen: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        if pick(module):
            chosen.append(module)
            return
        for child in module.children():
            walk(child)

    walk(model)
    for module in chosen:
        if not getattr(module, _MARK, False):
            module.forward = _recomputed(module.forward)
            setattr(module, _MARK, True)
    return chosen


def _recomputed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is kept, nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def repoint(
    optimizers: Sequence[torch.optim.Optimizer],
    names: dict[int, str],
    now: dict[str, nn.Parameter],
    dropped: set[int],
) -> None:
    """Point each optimizer at the parameters a wrapper put in place of the ones it was given
    (``names``: id of a given parameter -> its name; ``now``: name -> the new parameter);
    those in ``dropped`` (another pipeline stage's) leave it, another model's stay as they
    are."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [
                now[names[id(p)]] if id(p) in names else p
                for p in group["params"]
                if id(p) in names or id(p) not in dropped
            ]
