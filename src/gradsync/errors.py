"""The exception types: invalid settings, and a collective that another rank left hanging."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class ConfigError(ValueError):
    """An invalid gradsync setting. The message names the setting, the value and the fix."""


#: Words of torch's errors when a collective waited too long or a peer went away.
_LOST = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe",
         "connection refused", "peer closed")


#: Marks of an error raised by a process group (gloo, NCCL) rather than by user code.
_TRANSPORTS = ("gloo", "nccl", "c10d", "processgroup", "tcpstore")


class CollectiveError(RuntimeError):
    """A collective failed because another rank stopped answering (timed out or went away)."""


@contextlib.contextmanager
def naming_collective(operation: str, timeout: float | None) -> Iterator[None]:
    """Re-raise a hung or broken collective inside the block as a CollectiveError that names
    ``operation``, the timeout and how to change it; other errors pass unchanged."""
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, CollectiveError):
            raise
        text = " ".join(str(err).split())
        low = text.lower()
        from_torch = type(err).__name__.startswith("Dist") or any(m in low for m in _TRANSPORTS)
        if not (from_torch and any(word in low for word in _LOST)):
            raise
        if "timed out" in text.lower() or "timeout" in text.lower():
            limit = f"{timeout:g} s" if timeout is not None else "torch's default, 30 min"
            why = (f"timed out waiting for another rank (timeout {limit}; set it with "
                   "Accelerator(timeout=...) or GRADSYNC_TIMEOUT)")
        else:
            why = "lost its connection to another rank (that rank exited or crashed)"
        raise CollectiveError(f"{operation} failed: {why}: {text[:300]}") from None
