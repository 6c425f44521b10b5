"""The CSV tracker."""

from __future__ import annotations

import csv
import os
import time
from typing import Any, ClassVar

from gradsync.errors import ConfigError
from gradsync.tracking._file import FileTracker
from gradsync.tracking._values import check_no_kwargs, flat


class CSVTracker(FileTracker):
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
            raise ConfigError(
                f"{self.path} exists and does not start with a CSV header; move it "
                "away, or give init_trackers another project name"
            )
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
        check_no_kwargs(self.name, kwargs, "log_kwargs")
        row: dict[str, Any] = {"step": "" if step is None else step, "wall_time": time.time()}
        for key, value in flat(values):
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
