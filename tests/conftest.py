"""The suite's two folders: ``unit/`` runs in this process and starts none (a one-rank group in
this process at most), in seconds; ``multiprocess/`` starts processes (2-rank gloo groups,
torchrun, ``gradsync launch``, fresh interpreters) and is marked ``multiprocess`` here, so
``pytest -m "not multiprocess"`` and ``pytest tests/unit`` run the same fast tests.

``harness`` (the parent side: launching scenarios, the checks on their results),
``scenarios`` (what runs in the workers) and ``mp_worker.py`` live next to this file.

Under pytest-xdist with ``--dist loadgroup`` (scripts/test.sh: ``-n 2 --dist loadgroup
--no-loadscope-reorder``) the units of work are this file's (``xdist_scope``): a test module
runs on one worker, the modules of a shared scenario pool (``harness.Shared``) on the same
one, and a module that says ``INDEPENDENT_TESTS = True`` (each test starts its own processes,
no module fixture) test by test on either worker. xdist's own ``xdist_group`` marks are not
used: with pytest 9.2 they no longer reach its scheduler (pytest-xdist issue 1386). The pools
go first, then the other multi-process modules, then the independent tests, then ``unit/``:
the long units start early and the short ones even out the end."""

from __future__ import annotations

import ast
import functools
import gc
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
MULTIPROCESS = HERE / "multiprocess"
sys.path.insert(0, str(HERE))

#: W&B (0.31) starts two OpenTelemetry threads in a process that calls ``wandb.init``, offline
#: too, and OpenTelemetry starts them again in every process forked from it afterwards. In an
#: xdist worker that had run a tracker test, a later test's DataLoader worker aborted inside
#: one of them (a garbage collection during its HTTP post). The tests report nothing to W&B.
os.environ.setdefault("WANDB_ERROR_REPORTING", "false")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cost", action="store_true", help="print the test modules by CPU (harness/cost.py)"
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("cost"):
        from harness import cost

        config.pluginmanager.register(cost, "gradsync-test-cost")


def pytest_collection_finish(session: pytest.Session) -> None:
    # The collected modules imported torch and its kin, about a million objects that live as
    # long as this process: the collector need not walk them again at each full collection
    # the tests trigger (a third of a DeepSpeed ZeRO-3 setup's time is its gc.collect()).
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """Tear down any process group a test created in this process."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def run_verify(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., tuple[int, str]]:
    """``gradsync verify WORDS`` run in this process, as ``python -m gradsync`` runs it (one
    interpreter fewer per case) -> (exit status, what it printed)."""
    from gradsync import cli

    from harness.verify import ROOT

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.chdir(ROOT)

    def run(*words: str | Path) -> tuple[int, str]:
        code = cli.main(["verify", *map(str, words)])
        out = capsys.readouterr()
        return code, out.out + out.err

    return run


@pytest.fixture
def clean_env(monkeypatch):
    """No GRADSYNC_* or launcher variables from the outside."""
    for key in list(os.environ):
        if key.startswith("GRADSYNC_") or key in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        ):
            monkeypatch.delenv(key)
    return monkeypatch


def _shared_of(item: pytest.Item) -> Any:
    from harness import Shared

    handle = getattr(getattr(item, "module", None), "SHARED", None)
    return handle if isinstance(handle, Shared) else None


def _module_key(item: pytest.Item) -> str:
    return Path(str(item.path)).resolve().relative_to(HERE).as_posix()


@pytest.fixture(scope="session")
def shared(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[Any], Any]:
    """``shared(SHARED)``: this module's part of its pool's one group (``harness.run_shared``),
    launched the first time a module of the pool asks, for every selected module of it."""
    from harness import run_shared

    runs: dict[str, Any] = {}

    def part(handle: Any) -> Any:
        members: dict[str, Any] = {}
        for item in request.session.items:
            other = _shared_of(item)
            if other is not None and other.pool == handle.pool and other.available():
                members.setdefault(_module_key(item), other)
        if handle.pool not in runs:
            try:
                runs[handle.pool] = run_shared(
                    members, tmp_path_factory.mktemp(f"shared-{handle.pool}")
                )
            except Exception as err:  # every module of the pool reports it
                runs[handle.pool] = err
        found = runs[handle.pool]
        if isinstance(found, Exception):
            raise found
        key = next(k for k, h in members.items() if h is handle)
        return found[key]

    return part


@functools.cache
def _module_scope(path: str) -> str | None:
    """What a test module's source says of where its tests run: ``pool-NAME`` for a module
    with ``SHARED = Shared("NAME", ...)``, "" for ``INDEPENDENT_TESTS = True``, else None (read
    from the source: xdist's controller collects nothing)."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if not (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            continue
        name, value = node.targets[0].id, node.value
        if (
            name == "SHARED"
            and isinstance(value, ast.Call)
            and value.args
            and isinstance(value.args[0], ast.Constant)
        ):
            return f"pool-{value.args[0].value}"
        if name == "INDEPENDENT_TESTS" and isinstance(value, ast.Constant) and value.value is True:
            return ""
    return None


def xdist_scope(nodeid: str, rootdir: Path) -> str:
    """The unit of work a test belongs to: its pool, itself, or its module."""
    path = nodeid.split("::", 1)[0]
    scope = _module_scope(str(rootdir / path)) if path.endswith(".py") else None
    if scope is None:
        return path
    return scope or nodeid


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid, config.rootpath)

    return ByScope(config, log)


#: The multi-process modules that exercise torch's internals (FSDP2's private state, HSDP's
#: partial buffers, tensor parallelism, pipelines and their point-to-point ops, resumes and
#: dropped windows, checkpoints, the audit's process group): marked ``torch_internals``.
#: scripts/torch_range.sh runs them, with the unit tests, on the oldest supported and the
#: newest torch (``-m "not multiprocess or torch_internals"``).
TORCH_INTERNALS = {
    "test_checkpoint_faults.py",
    "test_checkpoint_processes.py",
    "test_checkpoint_safety.py",
    "test_ddp.py",
    "test_fsdp.py",
    "test_hsdp.py",
    "test_oom.py",
    "test_pipeline_parallel.py",
    "test_pipeline_parallel_3d.py",
    "test_pipeline_parallel_dp.py",
    "test_resume.py",
    "test_tensor_parallel.py",
    "test_tensor_parallel_3d.py",
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if MULTIPROCESS in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.multiprocess)
            if Path(str(item.path)).name in TORCH_INTERNALS:
                item.add_marker(pytest.mark.torch_internals)

    def order(item: pytest.Item) -> int:
        if _shared_of(item) is not None:
            return 0
        if "multiprocess" not in item.keywords:
            return 3
        return 2 if getattr(getattr(item, "module", None), "INDEPENDENT_TESTS", False) else 1

    items.sort(key=order)  # stable: each module's tests stay together and in order
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
