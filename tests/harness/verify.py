"""Read ``gradsync verify``'s report (the conftest's ``run_verify`` fixture runs it in the test
process, from the command line's words)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def table(out: str) -> list[list[str]]:
    """The rows of the report's table (step, losses, diffs, bytes, verdict)."""
    return [line.split() for line in out.splitlines() if re.match(r"^\s*\d+\s", line)]
