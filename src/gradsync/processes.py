"""Where code runs across processes: each rank's share of a list of work, a function run on
one rank only, a block one rank runs first.

Accelerate's ``split_between_processes``, its ``on_*_process`` decorators and its
``*_process_first`` blocks, as functions: the ``Accelerator`` exposes them as methods,
and they work without one. The decorators read where this process stands (a
:class:`Ranks`: an ``Accelerator`` is one; by default ``gradsync._support.dist``) each time the
decorated function is called, not when it is decorated, so a function decorated before
the process group exists runs where it should. Nothing here is a collective except
:func:`goes_first` (one barrier).

No torch at import: a tensor is split with torch only when one is given.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ParamSpec, Protocol, TypeVar, overload

from gradsync.errors import ConfigError

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")


class Ranks(Protocol):
    """Where this process stands, read at each call of a decorated function (an
    ``Accelerator`` has these properties)."""

    @property
    def rank(self) -> int:
        """This process's rank (0 in one process)."""
        ...

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine."""
        ...

    @property
    def world_size(self) -> int:
        """The number of processes."""
        ...


class CurrentRanks:
    """:class:`Ranks` from ``gradsync._support.dist``: the process group's rank and size where there
    is one, else what the launcher says (one process when nothing does)."""

    @property
    def rank(self) -> int:
        """This process's rank (0 in one process)."""
        return _rank_info()[0]

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine."""
        return _rank_info()[2]

    @property
    def world_size(self) -> int:
        """The number of processes."""
        return _rank_info()[1]


def _rank_info() -> tuple[int, int, int]:
    from gradsync._support import dist  # torch, only when the ranks are asked for

    return dist.rank_info()


# -- split_between_processes ----------------------------------------------------------


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only once torch is imported
    return torch is not None and isinstance(value, torch.Tensor)


def _length(value: Any, what: str) -> int:
    if _is_tensor(value):
        if value.dim() == 0:
            raise ConfigError(
                f"split_between_processes cannot split {what}, a 0-d tensor; "
                "give a tensor with a first dimension, or a list"
            )
        return int(value.shape[0])
    if isinstance(value, list | tuple) or callable(getattr(value, "select", None)):
        return len(value)
    raise ConfigError(
        f"split_between_processes cannot split {what}, a {type(value).__name__}; "
        "give a list, a tuple, a tensor, a dataset with select() or a dict of them"
    )


def _slice(value: Any, start: int, end: int, target: int) -> Any:
    """``value[start:end]``, padded to ``target`` entries by repeating its last entry."""
    length = _length(value, "it")
    missing = target - (end - start) if length else 0
    if callable(getattr(value, "select", None)) and not _is_tensor(value):
        return value.select(list(range(start, end)) + [length - 1] * max(missing, 0))
    part = value[start:end]
    if missing <= 0:
        return part
    if isinstance(value, list):
        return part + [value[-1]] * missing
    if isinstance(value, tuple):
        return part + (value[-1],) * missing
    import torch

    last = value[-1:]
    return torch.cat([part, last.expand(missing, *last.shape[1:])])


def process_share(inputs: S, rank: int, world: int, apply_padding: bool = False) -> S:
    """Rank ``rank``'s contiguous share of ``inputs`` out of ``world`` processes (what
    :func:`split_between_processes` yields there).

    The first ``len(inputs) % world`` ranks get one entry more than the others; with
    ``apply_padding`` the shorter shares repeat the last entry of ``inputs`` so every rank
    gets as many (drop those after gathering). A dict's values are split alike and must
    have the same length. In one process ``inputs`` itself comes back (checked all the
    same, so a script that fails on several processes fails on one).

    Args:
        inputs: a list, a tuple, a tensor (split along its first dimension), a dataset with
            ``select`` (a Hugging Face ``datasets.Dataset``), or a dict of them.
        rank: the rank whose share to give.
        world: the number of processes.
        apply_padding: repeat the last entry so every share has the same length.

    Returns:
        The share, of the same type as ``inputs`` (a new dict for a dict).

    Raises:
        ConfigError: an input that cannot be split, a dict with values of different
            lengths, or a rank outside ``range(world)``.
    """
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(
            f"split_between_processes: rank {rank} is not one of the {world} "
            "process(es); give 0 <= rank < world"
        )
    if isinstance(inputs, Mapping):
        lengths = {key: _length(value, f"the value of {key!r}") for key, value in inputs.items()}
        if len(set(lengths.values())) > 1:
            sizes = ", ".join(f"{key!r}: {n}" for key, n in lengths.items())
            raise ConfigError(
                f"split_between_processes takes a dict whose values have one "
                f"length; these have {sizes}"
            )
        length = next(iter(lengths.values()), 0)
    else:
        length = _length(inputs, "the inputs")
    if world == 1:
        return inputs
    per, extras = divmod(length, world)
    start = rank * per + min(rank, extras)
    end = start + per + (1 if rank < extras else 0)
    target = per + (1 if extras else 0) if apply_padding else end - start
    if isinstance(inputs, Mapping):
        return {key: _slice(value, start, end, target) for key, value in inputs.items()}  # type: ignore[return-value]
    return _slice(inputs, start, end, target)  # type: ignore[no-any-return]


@contextlib.contextmanager
def split_between_processes(
    inputs: S, rank: int | None = None, world: int | None = None, apply_padding: bool = False
) -> Iterator[S]:
    """This rank's contiguous share of ``inputs``, as Accelerate's
    ``split_between_processes`` gives it (e.g. prompts for distributed inference)::

        with split_between_processes(["A", "B", "C"]) as prompts:
            ...  # rank 0 of 2: ["A", "B"]; rank 1: ["C"] (["C", "C"] with apply_padding)

    Not a collective. The first ``len(inputs) % world`` ranks get one entry more; with
    ``apply_padding`` the others repeat the last entry of ``inputs`` so every rank has as
    many, which ``gather`` needs (drop the repeats afterwards). A tensor's share stays on
    the tensor's device (Accelerate moves a padded share to its device). A dict is not
    changed in place (Accelerate's is).

    Args:
        inputs: a list, a tuple, a tensor (split along its first dimension), a dataset with
            ``select`` (a Hugging Face ``datasets.Dataset``), or a dict of them with one
            length.
        rank: this process's rank; by default ``gradsync._support.dist``'s.
        world: the number of processes; by default ``gradsync._support.dist``'s.
        apply_padding: repeat the last entry so every share has the same length.

    Yields:
        The share (``inputs`` itself in one process).

    Raises:
        ConfigError: see :func:`process_share`.
    """
    if rank is None or world is None:
        here, size, _ = _rank_info()
        rank = here if rank is None else rank
        world = size if world is None else world
    yield process_share(inputs, rank, world, apply_padding)


# -- on_*_process ---------------------------------------------------------------------


class Decorator(Protocol):
    """What ``on_process(process_index=...)`` returns: a decorator."""

    def __call__(self, function: Callable[P, R], /) -> Callable[P, R | None]:
        """The function, run only where the decorator says.

        Args:
            function: the function to decorate.

        Returns:
            The decorated function.
        """
        ...


def _only_where(
    function: Callable[P, R], runs_here: Callable[[Ranks], bool], ranks: Ranks | None
) -> Callable[P, R | None]:
    if not callable(function):
        raise ConfigError(
            f"a process decorator takes a function, not {function!r}; write "
            "@on_main_process above a def, or on_process(process_index=N)"
        )
    where = ranks if ranks is not None else CurrentRanks()

    @functools.wraps(function)
    def only_there(*args: P.args, **kwargs: P.kwargs) -> R | None:
        if where.world_size == 1 or runs_here(where):  # one process runs everything (Accelerate)
            return function(*args, **kwargs)
        return None

    return only_there


def on_main_process(
    function: Callable[P, R], *, ranks: Ranks | None = None
) -> Callable[P, R | None]:
    """``function``, run on the main process (rank 0) only; elsewhere a call returns None.

    Args:
        function: the function to decorate.
        ranks: where this process stands (an ``Accelerator``); by default ``gradsync._support.dist``.

    Returns:
        The decorated function.
    """
    return _only_where(function, lambda r: r.rank == 0, ranks)


def on_local_main_process(
    function: Callable[P, R], *, ranks: Ranks | None = None
) -> Callable[P, R | None]:
    """``function``, run on the first process of each machine (local rank 0) only;
    elsewhere a call returns None.

    Args:
        function: the function to decorate.
        ranks: where this process stands (an ``Accelerator``); by default ``gradsync._support.dist``.

    Returns:
        The decorated function.
    """
    return _only_where(function, lambda r: r.local_rank == 0, ranks)


def on_last_process(
    function: Callable[P, R], *, ranks: Ranks | None = None
) -> Callable[P, R | None]:
    """``function``, run on the last process (rank ``world_size - 1``) only; elsewhere a
    call returns None.

    Args:
        function: the function to decorate.
        ranks: where this process stands (an ``Accelerator``); by default ``gradsync._support.dist``.

    Returns:
        The decorated function.
    """
    return _only_where(function, lambda r: r.rank == r.world_size - 1, ranks)


def _index(value: int | None, name: str, decorator: str) -> int:
    if value is None:
        raise ConfigError(f"{decorator} needs {name}: write @{decorator}({name}=N)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{decorator}({name}={value!r}) is not a process index; give an int >= 0")
    return value


def _in_range(index: int, name: str, decorator: str, where: Ranks) -> None:
    world = where.world_size
    if world > 1 and index >= world:
        raise ConfigError(
            f"{decorator}({name}={index}) names no process: there are {world} "
            f"(indices 0 to {world - 1})"
        )


@overload
def on_process(
    function: Callable[P, R], *, process_index: int | None = ..., ranks: Ranks | None = ...
) -> Callable[P, R | None]: ...
@overload
def on_process(
    function: None = ..., *, process_index: int | None = ..., ranks: Ranks | None = ...
) -> Decorator: ...
def on_process(
    function: Callable[..., Any] | None = None,
    *,
    process_index: int | None = None,
    ranks: Ranks | None = None,
) -> Callable[..., Any] | Decorator:
    """``function``, run on the process of rank ``process_index`` only; elsewhere a call
    returns None. Without ``function`` it is the decorator: ``@on_process(process_index=1)``.

    In one process the function runs whatever the index (as in Accelerate), so a script
    written for several processes runs unchanged on one.

    Args:
        function: the function to decorate.
        process_index: the rank that runs it.
        ranks: where this process stands (an ``Accelerator``); by default ``gradsync._support.dist``.

    Returns:
        The decorated function, or without ``function`` the decorator.

    Raises:
        ConfigError: no ``process_index`` or a negative one; at a call, an index that no
            process has (there are more than one).
    """
    index = _index(process_index, "process_index", "on_process")
    if function is None:

        def decorate(fn: Callable[P, R], /) -> Callable[P, R | None]:
            return on_process(fn, process_index=index, ranks=ranks)

        return decorate

    def runs_here(where: Ranks) -> bool:
        _in_range(index, "process_index", "on_process", where)
        return where.rank == index

    return _only_where(function, runs_here, ranks)


@overload
def on_local_process(
    function: Callable[P, R], *, local_process_index: int | None = ..., ranks: Ranks | None = ...
) -> Callable[P, R | None]: ...
@overload
def on_local_process(
    function: None = ..., *, local_process_index: int | None = ..., ranks: Ranks | None = ...
) -> Decorator: ...
def on_local_process(
    function: Callable[..., Any] | None = None,
    *,
    local_process_index: int | None = None,
    ranks: Ranks | None = None,
) -> Callable[..., Any] | Decorator:
    """``function``, run on the process of local rank ``local_process_index`` of each
    machine only; elsewhere a call returns None. Without ``function`` it is the decorator:
    ``@on_local_process(local_process_index=1)``. In one process it runs whatever the index.

    Args:
        function: the function to decorate.
        local_process_index: the local rank that runs it, on every machine.
        ranks: where this process stands (an ``Accelerator``); by default ``gradsync._support.dist``.

    Returns:
        The decorated function, or without ``function`` the decorator.

    Raises:
        ConfigError: no ``local_process_index`` or a negative one; at a call, an index not
            below the number of processes (there are more than one).
    """
    index = _index(local_process_index, "local_process_index", "on_local_process")
    if function is None:

        def decorate(fn: Callable[P, R], /) -> Callable[P, R | None]:
            return on_local_process(fn, local_process_index=index, ranks=ranks)

        return decorate

    def runs_here(where: Ranks) -> bool:
        _in_range(index, "local_process_index", "on_local_process", where)
        return where.local_rank == index

    return _only_where(function, runs_here, ranks)


# -- *_process_first --------------------------------------------------------------------


@contextlib.contextmanager
def goes_first(first: bool, barrier: Callable[[], None] | None = None) -> Iterator[None]:
    """The processes where ``first`` is true run the block, then the others do (a dataset
    cache built once, then read): the others wait at ``barrier`` before the block, the
    first ones after it (also when it raises). Call it on every rank.

    ``main_process_first`` is ``goes_first(rank == 0)``; ``local_main_process_first``
    is ``goes_first(local_rank == 0)``: on each machine its first process goes first.

    Args:
        first: this process goes first.
        barrier: waits for every rank; by default ``gradsync._support.dist.barrier`` (nothing to
            wait for without a process group).
    """
    if barrier is None:
        from gradsync._support import dist

        barrier = dist.barrier
    if not first:
        barrier()
    try:
        yield
    finally:
        if first:
            barrier()
