"""The torch releases gradsync supports: the one place the range is declared.

``OLDEST`` is the oldest torch minor on which the whole test suite passes; ``NEWEST`` the
newest release it was tested on. CI tests both ends (``scripts/torch_range.sh``, the pins
below) beside the pinned torch of ``constraints.txt``. Derived from here: pyproject.toml's
``torch>=`` requirement (``python scripts/torch_range.py --write``; a unit test fails while it
differs), ``_torch_compat.SUPPORTED_TORCH``, the install page and the changelog (filled when
the site is built), and the refusal and the warning below.

No torch import here: ``import gradsync`` and the launcher read it without torch.
"""

from __future__ import annotations

import re

#: The oldest supported torch minor, and the release CI installs for it.
OLDEST = "2.10"
OLDEST_PIN = "2.10.0"
#: The newest torch minor tested, and the release CI installs for it.
NEWEST = "2.15"
NEWEST_PIN = "2.15.0"


def supported() -> str:
    """``"2.10 to 2.15"``: the range as messages and the docs say it."""
    return f"{OLDEST} to {NEWEST}"


def minor(version: str) -> tuple[int, int]:
    """``(2, 15)`` for ``"2.15.0+cu132"``, ``"2.15"`` or ``"2.16.0.dev20261201"``."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(found.group(1)), int(found.group(2))


def below(version: str) -> bool:
    """Whether ``version`` is older than the oldest supported torch."""
    return minor(version) < minor(OLDEST)


def above(version: str) -> bool:
    """Whether ``version`` is newer than the newest tested torch (its internals unseen)."""
    return minor(version) > minor(NEWEST)


def refusal(version: str) -> str:
    """The one line a torch below the range gets when an Accelerator is made."""
    return (
        f"gradsync needs torch {OLDEST} or later (it supports {supported()}); torch "
        f"{version} is installed: pip install 'torch>={OLDEST}'"
    )


def warning(version: str) -> str:
    """The one warning a torch above the tested range gets at prepare."""
    return (
        f"torch {version} is newer than the releases gradsync was tested on ({supported()}); "
        "gradsync checks the torch internals it relies on when it prepares an FSDP2 model "
        "and refuses what does not hold"
    )
