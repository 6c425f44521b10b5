"""The JSON lines tracker."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from gradsync.tracking._file import FileTracker
from gradsync.tracking._values import check_no_kwargs


def _jsonable(value: Any) -> bool:
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple):
        return all(_jsonable(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _jsonable(v) for k, v in value.items())
    return False


class JSONLTracker(FileTracker):
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
        check_no_kwargs(self.name, kwargs, "log_kwargs")
        line: dict[str, Any] = {"step": step, "wall_time": time.time()}
        for key, value in values.items():
            if _jsonable(value):
                line[key] = value
            else:
                self._left_out(key, value, "JSON values: numbers, strings, None, lists and dicts")
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
