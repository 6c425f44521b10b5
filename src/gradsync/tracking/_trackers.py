"""The experiment trackers of one run: what an Accelerator holds."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gradsync._support import dist
from gradsync.errors import ConfigError, UsageError
from gradsync.tracking._builtin import BUILTIN_TRACKERS, missing_modules, tracker_available
from gradsync.tracking._names import check_log_with
from gradsync.tracking._values import log, plain


class _NullTracker:
    """What ``get_tracker`` gives on a process other than the main one: every call does
    nothing and returns None, so that code written for rank 0 runs unchanged everywhere."""

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def tracker(self) -> _NullTracker:
        return self

    def __getattr__(self, attr: str) -> Callable[..., None]:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _nothing

    def __repr__(self) -> str:
        return f"<gradsync tracker {self.name!r}: does nothing off the main process>"


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _name_of(tracker: Any) -> str:
    name = getattr(tracker, "name", None)
    return name if isinstance(name, str) and name else type(tracker).__name__


class Trackers:
    """The experiment trackers of one run: what ``Accelerator(log_with=..., project_dir=...)``
    holds and its ``init_trackers``, ``log``, ``get_tracker``, ``trackers`` and
    ``end_training`` forward to.

    Made on every rank: it checks that each named tracker's library is installed and that
    the trackers writing files have a folder. Only the main process (rank 0, from
    ``gradsync._support.dist.rank()`` at ``init``) creates, starts and calls trackers.

    Args:
        log_with: tracker names ("tensorboard", "wandb", "mlflow", "csv", "jsonl", "all": every
            one whose library is installed) and tracker objects (anything with
            ``log(values, step)``), checked as ``Config.validate`` checks ``log_with``;
            None: none.
        project_dir: the folder the trackers write into (created at ``init``); needed by
            tensorboard, csv and jsonl.
        step: gives the step a ``log`` call without one is recorded at (the optimizer steps
            applied so far).

    Raises:
        ConfigError: a tracker's library is not installed (naming the ``pip install``), a
            file-writing tracker without ``project_dir``, or an unknown name.
    """

    def __init__(
        self,
        log_with: Sequence[Any] | None,
        project_dir: str | os.PathLike[str] | None,
        step: Callable[[], int],
    ) -> None:
        self.project_dir = os.fspath(project_dir) if project_dir is not None else None
        self._step = step
        self._chosen: list[str | Any] = []  # built-in names and tracker objects, in order
        given = check_log_with("log_with", log_with) or []
        for item in given:
            if not isinstance(item, str):
                self._chosen.append(item)
                continue
            if item == "all":
                names = [n for n in BUILTIN_TRACKERS if tracker_available(n)]
            else:
                missing = missing_modules(item)
                if missing:
                    raise ConfigError(
                        f"log_with={item!r} needs {', '.join(missing)}, which is not installed: "
                        f"pip install 'gradsync[{item}]'"
                    )
                names = [item]
            self._chosen.extend(n for n in names if n not in self._chosen)
        homeless = [n for n in self._chosen if isinstance(n, str) and BUILTIN_TRACKERS[n].needs_dir]
        if homeless and self.project_dir is None:
            asked = "'all'" if "all" in given else ", ".join(map(repr, homeless))
            raise ConfigError(
                f"log_with={asked} writes files into project_dir, which is not set: pass "
                "project_dir='runs' (a folder) to Accelerator, or set GRADSYNC_PROJECT_DIR"
            )
        self._started: list[Any] = []
        self._project: str | None = None
        self._main = False
        self._finished = False
        self._warned_empty = False

    # -- what is there --------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """The names of the chosen trackers (built-in names, and each tracker object's
        ``name`` or class name), on every rank."""
        return [n if isinstance(n, str) else _name_of(n) for n in self._chosen]

    @property
    def started(self) -> list[Any]:
        """The started trackers (gradsync's wrappers and the tracker objects given) on the
        main process after ``init``; an empty list elsewhere."""
        return list(self._started)

    # -- the run --------------------------------------------------------------------------
    def init(
        self,
        project_name: str,
        config: Mapping[str, Any] | None = None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Create and start every tracker (on the main process; elsewhere only note that
        the trackers are started), then record ``config``.

        Args:
            project_name: the run's name: the folder under ``project_dir``, the W&B project,
                the MLflow experiment.
            config: hyperparameters to record with the run.
            init_kwargs: per tracker name, the keyword arguments of that library's init
                (``{"wandb": {"tags": ["a"]}, "tensorboard": {"flush_secs": 30}}``).

        Raises:
            UsageError: called a second time.
            ConfigError: an empty project name, a config that is not a dict, or init_kwargs
                for a tracker name gradsync does not know.
        """
        if self._project is not None:
            raise UsageError(
                f"init_trackers({project_name!r}): the trackers were already started "
                f"(project {self._project!r}); call init_trackers once per run"
            )
        if not isinstance(project_name, str) or not project_name.strip():
            raise ConfigError(
                f"init_trackers(project_name={project_name!r}) needs a non-empty "
                "name, e.g. init_trackers('my_project')"
            )
        if config is not None and not isinstance(config, Mapping):
            raise ConfigError(
                f"init_trackers(config=...) got a {type(config).__name__}; pass a dict "
                "of hyperparameters, e.g. config={'lr': 1e-3}"
            )
        kwargs = self._per_tracker("init_kwargs", init_kwargs)
        self._main = dist.rank() == 0
        if not self._main:
            self._project = project_name
            return
        if self.project_dir is not None and self._chosen:
            os.makedirs(self.project_dir, exist_ok=True)
        try:
            for chosen in self._chosen:
                if isinstance(chosen, str):
                    tracker = BUILTIN_TRACKERS[chosen](
                        project_name, self.project_dir, **kwargs.get(chosen, {})
                    )
                else:
                    tracker = chosen
                start = getattr(tracker, "start", None)
                if callable(start):
                    start()
                self._started.append(tracker)
            if config is not None:
                for tracker in self._started:
                    store = getattr(tracker, "store_init_configuration", None)
                    if callable(store):
                        store(dict(config))
        except BaseException:
            started, self._started = self._started, []
            for tracker in started:  # close what was opened; the first error is the one raised
                end = getattr(tracker, "finish", None)
                if callable(end):
                    with contextlib.suppress(Exception):
                        end()
            raise
        self._project = project_name

    def log(
        self,
        values: Mapping[str, Any],
        step: int | None = None,
        log_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Record ``values`` with every tracker, on the main process; elsewhere nothing.

        Args:
            values: name -> value; one-element tensors (any device) and NumPy scalars are
                recorded as Python numbers.
            step: the step to record them at (None: ``step()``, the optimizer steps applied).
            log_kwargs: per tracker name, keyword arguments for that tracker's ``log``.

        Raises:
            UsageError: before ``init`` (with trackers chosen), or after ``finish``.
            ConfigError: values that are not a dict with str keys, a key a file tracker uses
                itself ("step", "wall_time"), or log_kwargs for an unknown tracker name.
        """
        if self._finished:
            raise UsageError(
                "accel.log(...) after end_training(): the trackers are finished; "
                "log before end_training()"
            )
        if not self._chosen:
            if not self._warned_empty:
                self._warned_empty = True
                if dist.rank() == 0:
                    log.warning(
                        "gradsync: accel.log(...) records nothing: log_with is not "
                        "set; pass e.g. Accelerator(log_with='tensorboard', "
                        "project_dir='runs')"
                    )
            return
        if self._project is None:
            raise UsageError(
                "accel.log(...) before init_trackers(): start the trackers first, "
                "e.g. accel.init_trackers('my_project')"
            )
        if not isinstance(values, Mapping) or not all(isinstance(k, str) for k in values):
            raise ConfigError(
                f"accel.log(values=...) got {type(values).__name__}; pass a dict "
                "of str -> value, e.g. {'loss': loss}"
            )
        kwargs = self._per_tracker("log_kwargs", log_kwargs)
        if not self._main:
            return
        if step is not None and "step" in values and plain(values["step"]) == step:
            # Accelerate scripts log {"step": n} at step=n: the same number, written once.
            values = {k: v for k, v in values.items() if k != "step"}
        for tracker in self._started:
            taken = set(getattr(tracker, "reserved_keys", ())) & set(values)
            if taken:
                key = sorted(taken)[0]
                raise ConfigError(
                    f"accel.log: values[{key!r}]: the {_name_of(tracker)} tracker writes "
                    f"{key!r} itself; rename the value (for the step: accel.log(values, step=N))"
                )
        plain_values = {k: plain(v) for k, v in values.items()}
        at = self._step() if step is None else step
        for tracker in self._started:
            tracker.log(dict(plain_values), at, **kwargs.get(_name_of(tracker), {}))

    def get(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called ``name``; on other processes a tracker that does
        nothing (every call returns None).

        Args:
            name: its name (``names``).
            unwrap: give the library's own object instead (``tracker.tracker``).

        Returns:
            The tracker, or its library object.

        Raises:
            UsageError: before ``init``.
            ConfigError: no tracker of that name (the message lists the started ones).
        """
        if self._project is None:
            raise UsageError(
                f"get_tracker({name!r}) before init_trackers(): start the trackers "
                "first, e.g. accel.init_trackers('my_project')"
            )
        if name not in self.names:
            have = ", ".join(map(repr, self.names)) or "none (log_with is not set)"
            raise ConfigError(f"get_tracker({name!r}): no such tracker; the started ones: {have}")
        if not self._main:
            return _NullTracker(name)
        tracker = next(t for t in self._started if _name_of(t) == name)
        return getattr(tracker, "tracker", tracker) if unwrap else tracker

    def finish(self) -> None:
        """Finish every started tracker (flush and close files, ``wandb`` finish, MLflow
        run ended), once; a second call does nothing. A tracker that fails to finish does
        not keep the others from finishing; the first error is raised after.

        Raises:
            Exception: the first error a tracker's ``finish`` raised.
        """
        if self._finished:
            return
        self._finished = True
        first: BaseException | None = None
        for tracker in self._started:
            end = getattr(tracker, "finish", None)
            if not callable(end):
                continue
            try:
                end()
            except Exception as err:  # the others still finish
                first = first or err
        if first is not None:
            raise first

    def _per_tracker(
        self,
        what: str,
        given: Mapping[str, Mapping[str, Any]] | None,
    ) -> Mapping[str, Mapping[str, Any]]:
        """``init_kwargs`` / ``log_kwargs`` checked: a dict of tracker name -> dict (an
        entry for a built-in tracker not chosen is ignored: a typo is not)."""
        if given is None:
            return {}
        known = set(BUILTIN_TRACKERS) | set(self.names)
        if not isinstance(given, Mapping):
            raise ConfigError(
                f"{what}={given!r} must be a dict of tracker name -> dict of "
                f"arguments, e.g. {{'wandb': {{'tags': ['a']}}}}"
            )
        for key, value in given.items():
            if key not in known:
                raise ConfigError(
                    f"{what}[{key!r}]: no tracker of that name; use one of "
                    f"{', '.join(sorted(known))}"
                )
            if not isinstance(value, Mapping):
                raise ConfigError(f"{what}[{key!r}]={value!r} must be a dict of keyword arguments")
        return given
