"""The suite's two folders: ``unit/`` runs in this process and starts none (a one-rank group in
this process at most), in seconds; ``multiprocess/`` starts processes (2-rank gloo groups,
torchrun, ``gradsync launch``, fresh interpreters) and is marked ``multiprocess`` here, so
``pytest -m "not multiprocess"`` and ``pytest tests/unit`` run the same fast tests.

``harness`` (the parent side: launching scenarios, the checks on their results),
``scenarios`` (what runs in the workers) and ``mp_worker.py`` live next to this file."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MULTIPROCESS = HERE / "multiprocess"
sys.path.insert(0, str(HERE))


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """Tear down any process group a test created in this process."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def clean_env(monkeypatch):
    """No GRADSYNC_* or launcher variables from the outside."""
    for key in list(os.environ):
        if key.startswith("GRADSYNC_") or key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(key)
    return monkeypatch


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if MULTIPROCESS in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.multiprocess)
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
