"""The MLflow tracker."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, ClassVar

from gradsync.errors import ConfigError
from gradsync.tracking._values import LeftOut, flat, is_number, log, plain

#: The MLflow settings ``init_kwargs["mlflow"]`` takes.
MLFLOW_KEYS = (
    "tracking_uri",
    "experiment_name",
    "run_name",
    "run_id",
    "tags",
    "description",
    "artifact_location",
)


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
            raise ConfigError(
                f"init_kwargs['mlflow'] has {', '.join(map(repr, unknown))}, which "
                f"the mlflow tracker does not take; use {', '.join(MLFLOW_KEYS)}"
            )
        env = os.environ
        self.experiment_name: str = (
            env.get("MLFLOW_EXPERIMENT_NAME") or kwargs.get("experiment_name") or project_name
        )
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
        self._left_out = LeftOut(self.name)

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
                self.experiment_name, artifact_location=self.artifact_location
            )
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
        for key, value in flat({k: plain(v) for k, v in values.items()}):
            text = str(value)
            if len(text) > MAX_PARAM_VAL_LENGTH:
                log.warning(
                    "gradsync: config[%r] is longer than MLflow's %d characters for a "
                    "parameter: it is left out",
                    key,
                    MAX_PARAM_VAL_LENGTH,
                )
                continue
            params.append(Param(key, text))
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + MAX_PARAMS_TAGS_PER_BATCH])

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
        for key, value in flat(values):
            if is_number(value):
                metrics.append(Metric(key, float(value), stamp, step or 0))
            elif value is not None:
                self._left_out(key, value, "numbers (and dicts of numbers)")
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(
                self.run_id, metrics=metrics[i : i + MAX_METRICS_PER_BATCH], **kwargs
            )

    def finish(self) -> None:
        """End the run (status FINISHED)."""
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)
