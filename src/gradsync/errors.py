"""Every exception gradsync raises on purpose.

* :class:`ConfigError` (a ``ValueError``): a setting or an argument is invalid.
* :class:`UsageError` (a ``RuntimeError``): a call in the wrong place or order.
* :class:`CheckpointError` (a ``RuntimeError``): a checkpoint cannot be saved or loaded.
* :class:`CollectiveError` (a ``RuntimeError``): another rank stopped answering.

Each message names what was wrong and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal


class ConfigError(ValueError):
    """An invalid gradsync setting. The message names the setting, the value and the fix."""


class UsageError(RuntimeError):
    """A gradsync call in the wrong place or order (e.g. ``backward`` outside ``accumulate``
    with accumulation on). The message names the call and the fix."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded: the message names the path and the problem."""


#: Words of torch's errors when a collective waited too long or a peer went away.
_LOST = (
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "broken pipe",
    "connection refused",
    "peer closed",
)


#: Marks of an error raised by a process group (gloo, NCCL) rather than by user code.
_TRANSPORTS = ("gloo", "nccl", "c10d", "processgroup", "tcpstore")


class CollectiveError(RuntimeError):
    """A collective failed because another rank stopped answering (timed out or went away)."""


class naming_collective:
    """Re-raise a hung or broken collective inside the block as a CollectiveError that names
    ``operation`` (a string, or a callable giving it, formatted only on failure), the timeout
    and how to change it; other errors pass unchanged. A plain class: it runs around every
    micro-step, where a generator-based context manager costs measurably more."""

    __slots__ = ("operation", "timeout")

    def __init__(self, operation: str | Callable[[], str], timeout: float | None) -> None:
        self.operation = operation
        self.timeout = timeout

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: Any
    ) -> Literal[False]:
        if not isinstance(err, RuntimeError) or isinstance(err, CollectiveError):
            return False
        text = " ".join(str(err).split())
        low = text.lower()
        from_torch = type(err).__name__.startswith("Dist") or any(m in low for m in _TRANSPORTS)
        if not (from_torch and any(word in low for word in _LOST)):
            return False
        if "timed out" in low or "timeout" in low:
            limit = f"{self.timeout:g} s" if self.timeout is not None else "torch's default, 30 min"
            why = (
                f"timed out waiting for another rank (timeout {limit}; set it with "
                "Accelerator(timeout=...) or GRADSYNC_TIMEOUT)"
            )
        else:
            why = "lost its connection to another rank (that rank exited or crashed)"
        operation = self.operation if isinstance(self.operation, str) else self.operation()
        raise CollectiveError(f"{operation} failed: {why}: {text[:300]}") from None
