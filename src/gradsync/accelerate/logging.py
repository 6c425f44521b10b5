"""Accelerate's ``get_logger``: a logger whose records are written on the main process only
(``main_process_only=True``, the default) or on every process, one rank after the other
(``in_order=True``)."""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

from gradsync._support import dist


class MultiProcessAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger adapter that knows the process it runs in (read at each call)."""

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        return msg, kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        """Log ``msg`` as ``[RANK i] msg``: on the main process only (``main_process_only``,
        default True), or on every process one after the other (``in_order``, which then
        ignores ``main_process_only``)."""
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        rank, world, _ = dist.rank_info()
        msg = f"[RANK {rank}] {msg}"
        if not in_order:
            if not main_process_only or rank == 0:
                self.logger.log(level, msg, *args, **kwargs)
            return
        for turn in range(world):
            if turn == rank:
                self.logger.log(level, msg, *args, **kwargs)
            if world > 1 and dist.is_distributed():
                dist.barrier()

    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """``warning``, once per message."""
        key = (args, tuple(sorted(kwargs.items())))
        seen: set[Any] = self.__dict__.setdefault("_once", set())
        if key not in seen:
            seen.add(key)
            self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """A logger for ``name`` whose calls take ``main_process_only=`` and ``in_order=``
    (level: ``log_level``, else ``ACCELERATE_LOG_LEVEL`` when set)."""
    level = log_level if log_level is not None else os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if level is not None:
        logger.setLevel(level.upper())
        logger.root.setLevel(level.upper())
    return MultiProcessAdapter(logger, {})
