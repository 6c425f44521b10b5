"""Where the suite's time goes: a pytest plugin, off unless asked for.

    pytest -n 2 --dist loadgroup --no-loadscope-reorder --cost    (tests/conftest.py)

Around each test it reads the CPU of its process and of the children that process waited
for (``getrusage``: the launches, the scenario groups and everything they started), and at
the end prints the test modules by CPU. On two cores the suite is CPU-bound, so the CPU
seconds, not the wall seconds of one test, say what shortens it.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import tempfile
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

_ENV = "GRADSYNC_TEST_COST_FILE"  # one file for the controller and its xdist workers


def _cpu() -> tuple[float, float]:
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        fd, path = tempfile.mkstemp(prefix="gradsync-test-cost-", suffix=".jsonl")
        os.close(fd)
        os.environ[_ENV] = path  # the xdist workers start after this and inherit it


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, Any, None]:
    (own, kids), start = _cpu(), time.monotonic()
    yield
    (own_after, kids_after), wall = _cpu(), time.monotonic() - start
    record = {
        "module": item.nodeid.split("::")[0],
        "own": own_after - own,
        "children": kids_after - kids,
        "wall": wall,
    }
    with open(os.environ[_ENV], "a") as out:
        out.write(json.dumps(record) + "\n")


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    path = Path(os.environ[_ENV])
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for line in path.read_text().splitlines():
        record = json.loads(line)
        entry = totals[record["module"]]
        entry[0] += 1
        entry[1] += record["own"] + record["children"]
        entry[2] += record["wall"]
    path.unlink()
    write = terminalreporter.write_line
    write(
        f"CPU by test module (this process and its children), {sum(e[1] for e in totals.values()):.0f} s in all:"
    )
    write(f"{'tests':>6} {'CPU s':>8} {'wall s':>8}  module")
    for module, (count, cpu, wall) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:30]:
        write(f"{int(count):6d} {cpu:8.1f} {wall:8.1f}  {module}")
