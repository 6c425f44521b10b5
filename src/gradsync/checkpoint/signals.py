"""SIGTERM (preemption): remember that it arrived; the Accelerator saves and exits when the
next window starts (``save_on_sigterm``)."""

from __future__ import annotations

import signal
import threading
from typing import Any

from gradsync.errors import ConfigError


class SigtermWatch:
    """Remembers that SIGTERM arrived (with ``save_on_sigterm``); the Accelerator acts on
    it when the next window starts."""

    def __init__(self, root: str | None) -> None:
        self.enabled = root is not None
        self.received = False
        if not self.enabled:
            return
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                "save_on_sigterm needs the Accelerator to be built in the main thread (only it "
                "can receive signals); build it there, or leave save_on_sigterm unset"
            )
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received = True
