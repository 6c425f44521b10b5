"""`gradsync bench`: find the sync-overhead benchmark and run it.

The benchmark lives in the repository's ``benchmarks/`` folder (it starts its own worker
group and compares gradsync with hand-written loops and Accelerate), not in the installed
package. It is looked for, in this order, at ``$GRADSYNC_BENCHMARK`` (the path of
``sync_overhead.py``), in ``./benchmarks`` of the current folder or one of its parents,
and next to the source tree of an editable install.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

SCRIPT = Path("benchmarks", "sync_overhead.py")
ENV_VAR = "GRADSYNC_BENCHMARK"


def candidates(cwd: Path | None = None) -> list[Path]:
    """Where the benchmark may be, most specific first."""
    found: list[Path] = []
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        found.append(Path(explicit))
    here = (cwd or Path.cwd()).resolve()
    found += [folder / SCRIPT for folder in (here, *here.parents)]
    package = Path(__file__).resolve().parents[1]  # .../src/gradsync
    found.append(package.parents[1] / SCRIPT)  # the repository of an editable install
    return found


def locate(cwd: Path | None = None) -> Path | None:
    explicit = os.environ.get(ENV_VAR)
    if explicit and not Path(explicit).is_file():
        raise FileNotFoundError(
            f"{ENV_VAR}={explicit!r} is not a file; point it at benchmarks/sync_overhead.py "
            "of a gradsync checkout, or unset it"
        )
    return next((p for p in candidates(cwd) if p.is_file()), None)


def main(argv: Sequence[str]) -> int:
    """Run the benchmark with ``argv`` (e.g. ``["--quick", "--out", "results"]``); its exit status."""
    try:
        script = locate()
    except FileNotFoundError as err:
        print(f"gradsync bench: error: {err}", file=sys.stderr)
        return 2
    if script is None:
        print(
            "gradsync bench: error: benchmarks/sync_overhead.py was not found in this folder, its "
            "parents or the gradsync source tree; the benchmark ships with the repository, not the "
            "wheel: run `gradsync bench` inside a gradsync checkout (git clone, then "
            f"pip install -e '.[bench]'), or set {ENV_VAR}=/path/to/benchmarks/sync_overhead.py",
            file=sys.stderr,
        )
        return 2
    return subprocess.call([sys.executable, str(script), *argv])
