"""Experiment trackers for ``Accelerator.log``: TensorBoard, Weights & Biases, MLflow, CSV and
JSON lines, behind one small interface (:class:`Tracker`), named as Accelerate's ``log_with``
names them.

:class:`Trackers` is what an Accelerator holds: it checks ``log_with`` and ``project_dir`` when
it is made (on every rank, so that every rank fails alike), creates and starts the trackers in
:meth:`Trackers.init` on the main process (rank 0) only, and forwards ``log`` and ``finish`` to
them there. On every other rank the calls check their arguments' order and return: nothing
is written twice and no rank ever waits for another.

Values reach the trackers as Python values: a one-element tensor (any device) or NumPy
scalar becomes a number. What each tracker does with the other kinds of value is in
``docs/tracking.md``; a value a tracker cannot record is left out, with one warning per key.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

from gradsync import dist
from gradsync.errors import ConfigError, UsageError

__all__ = [
    "BUILTIN_TRACKERS", "CSVTracker", "JSONLTracker", "MLflowTracker", "TensorBoardTracker",
    "Tracker", "Trackers", "WandBTracker", "plain", "tracker_available",
]

log = logging.getLogger("gradsync")


@runtime_checkable
class Tracker(Protocol):
    """What gradsync calls on a tracker, in this order: ``start()``, then
    ``store_init_configuration(config)`` when ``init_trackers`` got a config, ``log(values,
    step)`` for each ``accel.log`` and ``finish()`` at ``end_training()``; all on the main
    process only. An Accelerate ``GeneralTracker`` fits. A tracker object given in ``log_with``
    needs only ``log``: the other methods and attributes are used where it has them (its
    name defaults to its class's name, its ``tracker`` to the object itself).

    Attributes:
        name: the name ``get_tracker`` and ``init_kwargs`` / ``log_kwargs`` know it by.
    """

    name: str

    @property
    def tracker(self) -> Any:
        """The library's own object (a SummaryWriter, a wandb Run, ...)."""
        ...

    def start(self) -> None:
        """Create the run (files, the library's run object)."""
        ...

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the run's configuration (hyperparameters).

        Args:
            values: the ``config`` given to ``init_trackers``.
        """
        ...

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` at ``step``.

        Args:
            values: name -> value (Python numbers, strings, dicts, or the library's types).
            step: the step they belong to.
            **kwargs: this tracker's entry of ``log_kwargs``.
        """
        ...

    def finish(self) -> None:
        """Flush and close the run."""
        ...


# -- values ---------------------------------------------------------------------------------
def plain(value: Any) -> Any:
    """``value`` as a Python value where it is a one-element tensor (any device) or NumPy
    array or scalar; dicts are converted key by key; anything else is returned unchanged.

    Args:
        value: one logged value.

    Returns:
        The number for a one-element tensor or array, else the value itself.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().item() if value.numel() == 1 else value
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.size == 1):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, bool | int | float)


def _flat(values: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(key, value) pairs with nested dicts' keys joined by "/": {"loss": {"train": 1}}
    gives ("loss/train", 1)."""
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flat(value, name + "/")
        else:
            yield name, value


class _LeftOut:
    """Warns once per key that a tracker cannot record a value."""

    def __init__(self, tracker: str) -> None:
        self.tracker = tracker
        self.keys: set[str] = set()

    def __call__(self, key: str, value: Any, can: str) -> None:
        if key in self.keys:
            return
        self.keys.add(key)
        log.warning("gradsync: the %s tracker cannot record values[%r] (a %s): it is left out; "
                    "it records %s", self.tracker, key, type(value).__name__, can)


def _write_config(path: Path, values: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({k: plain(v) for k, v in values.items()}, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _check_no_kwargs(name: str, kwargs: Mapping[str, Any], what: str) -> None:
    if kwargs:
        raise ConfigError(f"{what}[{name!r}]={dict(kwargs)!r}: the {name} tracker takes no "
                          f"arguments there; drop the {name!r} entry")


# -- the trackers ---------------------------------------------------------------------------
class TensorBoardTracker:
    """TensorBoard, through ``torch.utils.tensorboard.SummaryWriter`` (needs the
    ``tensorboard`` package), writing into ``project_dir/<project_name>``.

    Numbers go to ``add_scalar``, strings to ``add_text``, a dict of numbers to
    ``add_scalars``, a tensor or array of several elements to ``add_histogram``. The config
    is recorded as the run's hyperparameters (the HParams dashboard).

    Args:
        project_name: the run's folder name under ``logging_dir``.
        logging_dir: the project folder.
        **kwargs: passed to ``SummaryWriter`` (e.g. ``flush_secs``).
    """

    name: ClassVar[str] = "tensorboard"
    #: Where ``log_with='all'`` looks for the library, and the extra that installs it.
    modules: ClassVar[tuple[str, ...]] = ("tensorboard",)
    needs_dir: ClassVar[bool] = True

    def __init__(self, project_name: str, logging_dir: str, **kwargs: Any) -> None:
        self.logging_dir = os.path.join(logging_dir, project_name)
        self.kwargs = kwargs
        self.writer: Any = None
        self._left_out = _LeftOut(self.name)

    @property
    def tracker(self) -> Any:
        """The ``SummaryWriter``."""
        return self.writer

    def start(self) -> None:
        """Open the SummaryWriter."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.logging_dir, **self.kwargs)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record ``values`` as the run's hyperparameters (values that are not numbers,
        strings or booleans are recorded as their text).

        Args:
            values: the config.
        """
        from torch.utils.tensorboard.summary import hparams

        params = {k: v if isinstance(v, bool | int | float | str) else str(v)
                  for k, v in ((k, plain(v)) for k, v in values.items())}
        for summary in hparams(params, {}):
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Write ``values`` at ``step`` and flush.

        Args:
            values: name -> number, string, dict of numbers, or tensor / array.
            step: the global step.
            **kwargs: passed to each ``add_*`` call (e.g. ``walltime``).
        """
        w = self.writer
        for key, value in values.items():
            if value is None:
                continue
            if _is_number(value):
                w.add_scalar(key, float(value), global_step=step, **kwargs)
            elif isinstance(value, str):
                w.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, Mapping):
                scalars = {k: float(v) for k, v in _flat(value) if _is_number(v)}
                if len(scalars) < len(dict(_flat(value))):
                    self._left_out(key, value, "a dict only when all its values are numbers")
                elif scalars:
                    w.add_scalars(key, scalars, global_step=step, **kwargs)
            elif isinstance(value, torch.Tensor | np.ndarray):
                w.add_histogram(key, value.detach().cpu() if isinstance(value, torch.Tensor)
                                else value, global_step=step, **kwargs)
            else:
                self._left_out(key, value, "numbers, strings, dicts of numbers and tensors")
        w.flush()

    def finish(self) -> None:
        """Close the writer (flushing it)."""
        if self.writer is not None:
            self.writer.close()


class WandBTracker:
    """Weights & Biases, offline unless told otherwise: ``mode="offline"`` when neither
    ``WANDB_MODE`` nor ``init_kwargs["wandb"]["mode"]`` says another; its files go to
    ``project_dir/wandb/`` (``wandb sync`` uploads them later).

    Args:
        project_name: the W&B project.
        logging_dir: the folder W&B writes its ``wandb/`` folder into (None: W&B's own
            choice, ``WANDB_DIR`` or the current folder).
        **kwargs: passed to ``wandb.init`` (e.g. ``name``, ``tags``, ``entity``).
    """

    name: ClassVar[str] = "wandb"
    modules: ClassVar[tuple[str, ...]] = ("wandb",)
    needs_dir: ClassVar[bool] = False

    def __init__(self, project_name: str, logging_dir: str | None, **kwargs: Any) -> None:
        self.kwargs = {"project": project_name, **kwargs}
        if logging_dir is not None:
            self.kwargs.setdefault("dir", logging_dir)
        if "mode" not in self.kwargs and not os.environ.get("WANDB_MODE"):
            self.kwargs["mode"] = "offline"
        self.run: Any = None

    @property
    def tracker(self) -> Any:
        """The ``wandb`` Run."""
        return self.run

    def start(self) -> None:
        """``wandb.init``."""
        import wandb

        self.run = wandb.init(**self.kwargs)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Add ``values`` to the run's config.

        Args:
            values: the config.
        """
        self.run.config.update({k: plain(v) for k, v in values.items()}, allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``run.log(values, step=step)``: W&B takes numbers, strings, nested dicts and its
        own media types; calls at one step make one history row.

        Args:
            values: name -> value.
            step: the step (W&B ignores, with a warning, a step below its last).
            **kwargs: passed to ``run.log`` (e.g. ``commit``).
        """
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        """``run.finish()``."""
        if self.run is not None:
            self.run.finish()


#: The MLflow settings ``init_kwargs["mlflow"]`` takes.
MLFLOW_KEYS = ("tracking_uri", "experiment_name", "run_name", "run_id", "tags", "description",
               "artifact_location")


class MLflowTracker:
    """MLflow, through an ``MlflowClient`` (no global active run): by default a SQLite store,
    ``sqlite:///<project_dir>/mlflow.db`` (MLflow's own default, in the project folder), with
    artifacts in ``project_dir/mlartifacts``; ``MLFLOW_TRACKING_URI`` or
    ``init_kwargs["mlflow"]["tracking_uri"]`` choose another. The experiment is
    ``project_name`` (``MLFLOW_EXPERIMENT_NAME`` first, as in Accelerate).

    Each ``log`` call is one metric record per key at its step (numbers; a dict's numbers as
    ``key/sub``); strings and other values are left out (MLflow metrics are numbers).

    Args:
        project_name: the experiment's name.
        logging_dir: the project folder (None: MLflow's defaults).
        **kwargs: ``tracking_uri``, ``experiment_name``, ``run_name``, ``run_id`` (resume
            that run), ``tags``, ``description``, ``artifact_location``.

    Raises:
        ConfigError: an argument MLflow's tracker does not take.
    """

    name: ClassVar[str] = "mlflow"
    modules: ClassVar[tuple[str, ...]] = ("mlflow", "sqlalchemy", "alembic")
    needs_dir: ClassVar[bool] = False

    def __init__(self, project_name: str, logging_dir: str | None, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(MLFLOW_KEYS))
        if unknown:
            raise ConfigError(f"init_kwargs['mlflow'] has {', '.join(map(repr, unknown))}, which "
                              f"the mlflow tracker does not take; use {', '.join(MLFLOW_KEYS)}")
        env = os.environ
        self.experiment_name: str = env.get("MLFLOW_EXPERIMENT_NAME") or kwargs.get(
            "experiment_name") or project_name
        self.run_id: str | None = env.get("MLFLOW_RUN_ID") or kwargs.get("run_id")
        tags = env.get("MLFLOW_TAGS") or kwargs.get("tags")
        self.tags: dict[str, Any] = json.loads(tags) if isinstance(tags, str) else dict(tags or {})
        self.run_name: str | None = kwargs.get("run_name")
        self.description: str | None = kwargs.get("description")
        self.tracking_uri: str | None = kwargs.get("tracking_uri") or env.get("MLFLOW_TRACKING_URI")
        self.artifact_location: str | None = kwargs.get("artifact_location")
        if logging_dir is not None:
            root = Path(logging_dir).resolve()
            if self.tracking_uri is None:
                self.tracking_uri = f"sqlite:///{root / 'mlflow.db'}"
            if self.artifact_location is None:
                self.artifact_location = (root / "mlartifacts").as_uri()
        self.client: Any = None
        self._left_out = _LeftOut(self.name)

    @property
    def tracker(self) -> Any:
        """The ``MlflowClient`` (log to the run with ``client.log_*(tracker.run_id, ...)``)."""
        return self.client

    def start(self) -> None:
        """Find or create the experiment, then create the run (or resume ``run_id``)."""
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient(tracking_uri=self.tracking_uri)
        if self.run_id is not None:
            client.update_run(self.run_id, status="RUNNING")
            return
        experiment = client.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = client.create_experiment(
                self.experiment_name, artifact_location=self.artifact_location)
        tags = {k: str(v) for k, v in self.tags.items()}
        if self.description:
            tags["mlflow.note.content"] = self.description
        run = client.create_run(experiment_id, run_name=self.run_name, tags=tags)
        self.run_id = run.info.run_id

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record ``values`` as the run's parameters (as text; one longer than MLflow's limit
        is left out with a warning).

        Args:
            values: the config.
        """
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = []
        for key, value in _flat({k: plain(v) for k, v in values.items()}):
            text = str(value)
            if len(text) > MAX_PARAM_VAL_LENGTH:
                log.warning("gradsync: config[%r] is longer than MLflow's %d characters for a "
                            "parameter: it is left out", key, MAX_PARAM_VAL_LENGTH)
                continue
            params.append(Param(key, text))
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """One metric record per number in ``values``, at ``step`` (0 when None).

        Args:
            values: name -> number or dict of numbers.
            step: the step.
            **kwargs: passed to ``MlflowClient.log_batch`` (e.g. ``synchronous``).
        """
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        stamp = int(time.time() * 1000)
        metrics = []
        for key, value in _flat(values):
            if _is_number(value):
                metrics.append(Metric(key, float(value), stamp, step or 0))
            elif value is not None:
                self._left_out(key, value, "numbers (and dicts of numbers)")
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH], **kwargs)

    def finish(self) -> None:
        """End the run (status FINISHED)."""
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)


class _FileTracker:
    """A tracker gradsync writes itself: ``project_dir/<project_name>/<filename>``, one
    record per ``log``, flushed at once (a crashed run keeps every line it logged), and the
    config in ``config.json`` beside it. An existing file is continued."""

    name: ClassVar[str]
    filename: ClassVar[str]
    modules: ClassVar[tuple[str, ...]] = ()
    needs_dir: ClassVar[bool] = True
    #: Keys the file uses itself: a value of that name would be ambiguous.
    reserved_keys: ClassVar[tuple[str, ...]] = ("step", "wall_time")

    def __init__(self, project_name: str, logging_dir: str, **kwargs: Any) -> None:
        _check_no_kwargs(self.name, kwargs, "init_kwargs")
        self.path = Path(logging_dir, project_name, self.filename)
        self._file: Any = None
        self._left_out = _LeftOut(self.name)

    @property
    def tracker(self) -> str:
        """The file's path."""
        return str(self.path)

    def start(self) -> None:
        """Create the folder and open the file to append to."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", newline="", encoding="utf-8")

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Write ``values`` to ``config.json`` beside the file (values JSON cannot hold as
        their text).

        Args:
            values: the config.
        """
        _write_config(self.path.with_name("config.json"), values)

    def finish(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


def _jsonable(value: Any) -> bool:
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple):
        return all(_jsonable(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _jsonable(v) for k, v in value.items())
    return False


class JSONLTracker(_FileTracker):
    """JSON lines, ``project_dir/<project_name>/metrics.jsonl``: one object per ``log``,
    ``{"step": ..., "wall_time": ..., **values}`` (nested dicts stay nested; NaN and
    infinities are written as Python's ``json`` writes them: ``NaN``, ``Infinity``).

    Args:
        project_name: the run's folder name under ``logging_dir``.
        logging_dir: the project folder.
        **kwargs: none are taken.
    """

    name: ClassVar[str] = "jsonl"
    filename: ClassVar[str] = "metrics.jsonl"

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Append one line and flush.

        Args:
            values: name -> JSON value (numbers, strings, None, lists, dicts).
            step: the step (``null`` when None).
            **kwargs: none are taken.
        """
        _check_no_kwargs(self.name, kwargs, "log_kwargs")
        line: dict[str, Any] = {"step": step, "wall_time": time.time()}
        for key, value in values.items():
            if _jsonable(value):
                line[key] = value
            else:
                self._left_out(key, value, "JSON values: numbers, strings, None, lists and dicts")
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()


class CSVTracker(_FileTracker):
    """CSV, ``project_dir/<project_name>/metrics.csv``: one row per ``log`` with the columns
    ``step``, ``wall_time`` and every key logged so far (a dict's keys as ``key/sub``), empty
    where a row has no value. A key never logged before adds a column: the file is rewritten
    then with the longer header (atomically), so that it stays one valid table.

    Args:
        project_name: the run's folder name under ``logging_dir``.
        logging_dir: the project folder.
        **kwargs: none are taken.
    """

    name: ClassVar[str] = "csv"
    filename: ClassVar[str] = "metrics.csv"

    def __init__(self, project_name: str, logging_dir: str, **kwargs: Any) -> None:
        super().__init__(project_name, logging_dir, **kwargs)
        self.columns: list[str] = list(self.reserved_keys)

    def start(self) -> None:
        """Open the file, continuing an existing one with its columns."""
        header: list[str] = []
        if self.path.exists():
            with open(self.path, newline="", encoding="utf-8") as f:
                header = next(csv.reader(f), [])
        if not header and self.path.exists() and self.path.stat().st_size:
            raise ConfigError(f"{self.path} exists and does not start with a CSV header; move it "
                              "away, or give init_trackers another project name")
        super().start()
        if not header:
            csv.writer(self._file).writerow(self.columns)
            self._file.flush()
            return
        self.columns = header
        missing = [c for c in self.reserved_keys if c not in header]
        if missing:
            self._add_columns(missing)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Append one row (adding columns first where needed) and flush.

        Args:
            values: name -> number, string, None or dict of them.
            step: the step (empty when None).
            **kwargs: none are taken.
        """
        _check_no_kwargs(self.name, kwargs, "log_kwargs")
        row: dict[str, Any] = {"step": "" if step is None else step, "wall_time": time.time()}
        for key, value in _flat(values):
            if value is None or isinstance(value, bool | int | float | str):
                row[key] = "" if value is None else value
            else:
                self._left_out(key, value, "numbers, strings and dicts of them")
        new = [k for k in row if k not in self.columns]
        if new:
            self._add_columns(new)
        csv.DictWriter(self._file, self.columns, restval="").writerow(row)
        self._file.flush()

    def _add_columns(self, new: list[str]) -> None:
        self._file.close()
        with open(self.path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        self.columns = [*self.columns, *new]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, self.columns, restval="")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", newline="", encoding="utf-8")


#: The trackers ``log_with`` names, by name (in the order ``"all"`` starts them).
BUILTIN_TRACKERS: Mapping[str, type[Any]] = {
    cls.name: cls for cls in (TensorBoardTracker, WandBTracker, MLflowTracker, CSVTracker, JSONLTracker)
}


def _missing_modules(name: str) -> list[str]:
    """The modules tracker ``name`` needs that are not installed (MLflow's SQL store modules
    only where that store is used)."""
    modules = BUILTIN_TRACKERS[name].modules
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if name == "mlflow" and uri and not uri.startswith(("sqlite", "postgresql", "mysql", "mssql")):
        modules = ("mlflow",)  # a tracking server or a file store: no SQL store here
    return [m for m in modules if importlib.util.find_spec(m) is None]


def tracker_available(name: str) -> bool:
    """Whether the library tracker ``name`` needs is installed (``log_with='all'`` starts
    the ones that are).

    Args:
        name: a built-in tracker's name ("tensorboard", "wandb", "mlflow", "csv", "jsonl").

    Returns:
        True when every module it needs can be imported.
    """
    return not _missing_modules(name)


# -- the set an Accelerator holds -----------------------------------------------------------
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
    ``gradsync.dist.rank()`` at ``init``) creates, starts and calls trackers.

    Args:
        log_with: tracker names ("tensorboard", "wandb", "mlflow", "csv", "jsonl", "all": every
            one whose library is installed) and tracker objects (anything with
            ``log(values, step)``), as ``Config.validate`` leaves ``log_with``; None: none.
        project_dir: the folder the trackers write into (created at ``init``); needed by
            tensorboard, csv and jsonl.
        step: gives the step a ``log`` call without one is recorded at (the optimizer steps
            applied so far).

    Raises:
        ConfigError: a tracker's library is not installed (naming the ``pip install``), a
            file-writing tracker without ``project_dir``, or an unknown name.
    """

    def __init__(self, log_with: Sequence[Any] | None, project_dir: str | os.PathLike[str] | None,
                 step: Callable[[], int]) -> None:
        self.project_dir = os.fspath(project_dir) if project_dir is not None else None
        self._step = step
        self._chosen: list[str | Any] = []  # built-in names and tracker objects, in order
        for item in log_with or ():
            if not isinstance(item, str):
                if not callable(getattr(item, "log", None)):
                    raise ConfigError(f"log_with got a {type(item).__name__}, which is neither a "
                                      "tracker name nor a tracker (an object with log(values, "
                                      "step)); use e.g. log_with='tensorboard'")
                self._chosen.append(item)
                continue
            if item == "all":
                names = [n for n in BUILTIN_TRACKERS if tracker_available(n)]
            elif item in BUILTIN_TRACKERS:
                missing = _missing_modules(item)
                if missing:
                    raise ConfigError(
                        f"log_with={item!r} needs {', '.join(missing)}, which is not installed: "
                        f"pip install 'gradsync[{item}]'")
                names = [item]
            else:
                raise ConfigError(f"log_with={item!r} is not a tracker; use one of "
                                  f"{', '.join([*BUILTIN_TRACKERS, 'all'])}, or a tracker object")
            self._chosen.extend(n for n in names if n not in self._chosen)
        homeless = [n for n in self._chosen if isinstance(n, str) and BUILTIN_TRACKERS[n].needs_dir]
        if homeless and self.project_dir is None:
            asked = "'all'" if "all" in (log_with or ()) else ", ".join(map(repr, homeless))
            raise ConfigError(
                f"log_with={asked} writes files into project_dir, which is not set: pass "
                "project_dir='runs' (a folder) to Accelerator, or set GRADSYNC_PROJECT_DIR")
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
    def init(self, project_name: str, config: Mapping[str, Any] | None = None,
             init_kwargs: Mapping[str, Mapping[str, Any]] | None = None) -> None:
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
            raise UsageError(f"init_trackers({project_name!r}): the trackers were already started "
                             f"(project {self._project!r}); call init_trackers once per run")
        if not isinstance(project_name, str) or not project_name.strip():
            raise ConfigError(f"init_trackers(project_name={project_name!r}) needs a non-empty "
                              "name, e.g. init_trackers('my_project')")
        if config is not None and not isinstance(config, Mapping):
            raise ConfigError(f"init_trackers(config=...) got a {type(config).__name__}; pass a dict "
                              "of hyperparameters, e.g. config={'lr': 1e-3}")
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
                    tracker = BUILTIN_TRACKERS[chosen](project_name, self.project_dir,
                                                       **kwargs.get(chosen, {}))
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

    def log(self, values: Mapping[str, Any], step: int | None = None,
            log_kwargs: Mapping[str, Mapping[str, Any]] | None = None) -> None:
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
            raise UsageError("accel.log(...) after end_training(): the trackers are finished; "
                             "log before end_training()")
        if not self._chosen:
            if not self._warned_empty:
                self._warned_empty = True
                if dist.rank() == 0:
                        log.warning("gradsync: accel.log(...) records nothing: log_with is not "
                                "set; pass e.g. Accelerator(log_with='tensorboard', "
                                "project_dir='runs')")
            return
        if self._project is None:
            raise UsageError("accel.log(...) before init_trackers(): start the trackers first, "
                             "e.g. accel.init_trackers('my_project')")
        if not isinstance(values, Mapping) or not all(isinstance(k, str) for k in values):
            raise ConfigError(f"accel.log(values=...) got {type(values).__name__}; pass a dict "
                              "of str -> value, e.g. {'loss': loss}")
        kwargs = self._per_tracker("log_kwargs", log_kwargs)
        if not self._main:
            return
        for tracker in self._started:
            taken = set(getattr(tracker, "reserved_keys", ())) & set(values)
            if taken:
                key = sorted(taken)[0]
                raise ConfigError(
                    f"accel.log: values[{key!r}]: the {_name_of(tracker)} tracker writes "
                    f"{key!r} itself; rename the value (for the step: accel.log(values, step=N))")
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
            raise UsageError(f"get_tracker({name!r}) before init_trackers(): start the trackers "
                             "first, e.g. accel.init_trackers('my_project')")
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

    def _per_tracker(self, what: str, given: Mapping[str, Mapping[str, Any]] | None,
                     ) -> Mapping[str, Mapping[str, Any]]:
        """``init_kwargs`` / ``log_kwargs`` checked: a dict of tracker name -> dict (an
        entry for a built-in tracker not chosen is ignored: a typo is not)."""
        if given is None:
            return {}
        known = set(BUILTIN_TRACKERS) | set(self.names)
        if not isinstance(given, Mapping):
            raise ConfigError(f"{what}={given!r} must be a dict of tracker name -> dict of "
                              f"arguments, e.g. {{'wandb': {{'tags': ['a']}}}}")
        for key, value in given.items():
            if key not in known:
                raise ConfigError(f"{what}[{key!r}]: no tracker of that name; use one of "
                                  f"{', '.join(sorted(known))}")
            if not isinstance(value, Mapping):
                raise ConfigError(f"{what}[{key!r}]={value!r} must be a dict of keyword arguments")
        return given
