"""The base of the trackers gradsync writes itself (CSV, JSON lines)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from gradsync.tracking._values import LeftOut, check_no_kwargs, plain


def _write_config(path: Path, values: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(
        json.dumps({k: plain(v) for k, v in values.items()}, indent=2, default=str) + "\n"
    )
    os.replace(tmp, path)


class FileTracker:
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
        check_no_kwargs(self.name, kwargs, "init_kwargs")
        self.path = Path(logging_dir, project_name, self.filename)
        self._file: Any = None
        self._left_out = LeftOut(self.name)

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
