"""The TensorBoard tracker."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch

from gradsync.tracking._values import LeftOut, flat, is_number, plain


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
        self._left_out = LeftOut(self.name)

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

        params = {
            k: v if isinstance(v, bool | int | float | str) else str(v)
            for k, v in ((k, plain(v)) for k, v in values.items())
        }
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
            if is_number(value):
                w.add_scalar(key, float(value), global_step=step, **kwargs)
            elif isinstance(value, str):
                w.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, Mapping):
                scalars = {k: float(v) for k, v in flat(value) if is_number(v)}
                if len(scalars) < len(dict(flat(value))):
                    self._left_out(key, value, "a dict only when all its values are numbers")
                elif scalars:
                    w.add_scalars(key, scalars, global_step=step, **kwargs)
            elif isinstance(value, torch.Tensor | np.ndarray):
                w.add_histogram(
                    key,
                    value.detach().cpu() if isinstance(value, torch.Tensor) else value,
                    global_step=step,
                    **kwargs,
                )
            else:
                self._left_out(key, value, "numbers, strings, dicts of numbers and tensors")
        w.flush()

    def finish(self) -> None:
        """Close the writer (flushing it)."""
        if self.writer is not None:
            self.writer.close()
