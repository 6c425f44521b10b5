"""The built-in trackers by name, and whether each one's library is installed."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any

from gradsync.tracking._csv_file import CSVTracker
from gradsync.tracking._jsonl_file import JSONLTracker
from gradsync.tracking._mlflow import MLflowTracker
from gradsync.tracking._tensorboard import TensorBoardTracker
from gradsync.tracking._wandb import WandBTracker

#: The trackers ``log_with`` names, by name (in the order ``"all"`` starts them).
BUILTIN_TRACKERS: Mapping[str, type[Any]] = {
    cls.name: cls
    for cls in (TensorBoardTracker, WandBTracker, MLflowTracker, CSVTracker, JSONLTracker)
}


def missing_modules(name: str) -> list[str]:
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
    return not missing_modules(name)
