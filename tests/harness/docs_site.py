"""The documentation site, built for the docs tests (tests/unit/test_docs_html.py reads its
HTML, tests/unit/test_docs_browser.py opens it in a browser): ``mkdocs build --strict`` of this
checkout into a folder, with gradsync imported from ``src/``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def missing() -> list[str]:
    """What of the ``docs`` extra is not installed (empty when the site can be built)."""
    return [
        m
        for m in ("mkdocs", "material", "mkdocstrings_handlers.python")
        if importlib.util.find_spec(m.split(".")[0]) is None
        or (m == "mkdocstrings_handlers.python" and importlib.util.find_spec(m) is None)
    ]


def build(out: Path) -> Path:
    """Build the site into ``out`` (``--strict``: a warning fails) and return ``out``."""
    env = dict(
        os.environ,
        NO_MKDOCS_2_WARNING="1",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    if done.returncode != 0:
        raise AssertionError(f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}")
    return out
