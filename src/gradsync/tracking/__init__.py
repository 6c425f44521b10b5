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

The modules, one per part:

* ``_names``: the names ``log_with`` accepts and its one check (no torch: the settings use it);
* ``_protocol``: :class:`Tracker`;
* ``_values``: what the trackers share (:func:`plain`, flattening, the left-out warning);
* ``_tensorboard``, ``_wandb``, ``_mlflow``, ``_csv_file``, ``_jsonl_file``: one tracker each,
  the last two on ``_file``, the base of the trackers gradsync writes itself;
* ``_builtin``: the built-in trackers by name, and whether each one's library is installed;
* ``_trackers``: :class:`Trackers`.

Importing this package does not import torch: the names below are loaded when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradsync.tracking._builtin import BUILTIN_TRACKERS, tracker_available
    from gradsync.tracking._csv_file import CSVTracker
    from gradsync.tracking._jsonl_file import JSONLTracker
    from gradsync.tracking._mlflow import MLFLOW_KEYS as MLFLOW_KEYS
    from gradsync.tracking._mlflow import MLflowTracker
    from gradsync.tracking._protocol import Tracker
    from gradsync.tracking._tensorboard import TensorBoardTracker
    from gradsync.tracking._trackers import Trackers
    from gradsync.tracking._values import plain
    from gradsync.tracking._wandb import WandBTracker

__all__ = [
    "BUILTIN_TRACKERS",
    "CSVTracker",
    "JSONLTracker",
    "MLflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "Trackers",
    "WandBTracker",
    "plain",
    "tracker_available",
]

# name -> the module that defines it (imported on first access: most import torch)
_LAZY = {
    "BUILTIN_TRACKERS": "gradsync.tracking._builtin",
    "tracker_available": "gradsync.tracking._builtin",
    "CSVTracker": "gradsync.tracking._csv_file",
    "JSONLTracker": "gradsync.tracking._jsonl_file",
    "MLFLOW_KEYS": "gradsync.tracking._mlflow",
    "MLflowTracker": "gradsync.tracking._mlflow",
    "Tracker": "gradsync.tracking._protocol",
    "TensorBoardTracker": "gradsync.tracking._tensorboard",
    "Trackers": "gradsync.tracking._trackers",
    "plain": "gradsync.tracking._values",
    "WandBTracker": "gradsync.tracking._wandb",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gradsync.tracking' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
