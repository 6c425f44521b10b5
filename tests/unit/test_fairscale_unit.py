"""fairscale in this process: bad settings, a missing or too old fairscale, the private attributes
it relies on, and ``timeout=`` on the (one-rank) group gradsync creates for each backend (the
runs on a 2-rank group: multiprocess/test_fairscale.py)."""

from __future__ import annotations

import re
import socket
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gradsync import Accelerator, ConfigError, audit

SKIP_REASON = "fairscale is not installed: pip install 'gradsync[fairscale]'"


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            {"sync_policy": "native"},
            "sync_policy='native' is DeepSpeed's; with backend='fairscale' use",
        ),
        (
            {"mixed_precision": "fp16"},
            "mixed_precision='fp16' is not supported with backend='fairscale'",
        ),
        (
            {"fairscale_kwargs": [1]},
            "fairscale_kwargs=[1] must be a dict of ShardedDataParallel arguments",
        ),
    ],
)
def test_bad_settings_are_config_errors(clean_env, options, match):
    pytest.importorskip("fairscale", reason=SKIP_REASON)
    with pytest.raises(ConfigError, match=re.escape(match)) as err:
        Accelerator(backend="fairscale", **options)
    _one_line(err.value)


def _forget_the_adapter(monkeypatch):
    for name in ("gradsync.backends.fairscale", "gradsync.backends._fairscale_compat"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_missing_fairscale_says_how_to_install_it(clean_env, monkeypatch):
    _forget_the_adapter(monkeypatch)
    monkeypatch.setitem(sys.modules, "fairscale", None)  # `import fairscale` now fails
    with pytest.raises(ImportError) as err:
        Accelerator(backend="fairscale")
    text = _one_line(err.value)
    assert "backend='fairscale' needs fairscale, which is not installed" in text
    assert "pip install 'gradsync[fairscale]'" in text and "backend='fsdp'" in text


def test_a_fairscale_that_does_not_import_with_this_torch_says_so(clean_env, monkeypatch):
    pytest.importorskip("fairscale", reason=SKIP_REASON)
    _forget_the_adapter(monkeypatch)
    monkeypatch.setitem(sys.modules, "fairscale.optim", None)  # as if it failed to import
    with pytest.raises(ImportError) as err:
        Accelerator(backend="fairscale")
    text = _one_line(err.value)
    assert f"does not import with torch {torch.__version__}" in text
    assert "pip install 'gradsync[fairscale]'" in text and "backend='fsdp'" in text


def test_an_old_fairscale_is_refused(clean_env, monkeypatch):
    fairscale = pytest.importorskip("fairscale", reason=SKIP_REASON)
    _forget_the_adapter(monkeypatch)
    monkeypatch.setattr(fairscale, "__version__", "0.4.6")
    with pytest.raises(ImportError) as err:
        Accelerator(backend="fairscale")
    text = _one_line(err.value)
    assert (
        "supports fairscale 0.4.13, not 0.4.6" in text
        and "pip install 'gradsync[fairscale]'" in text
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("backend", ["fairscale", "ddp", "fsdp", "deepspeed"])
def test_the_group_gradsync_creates_has_the_configured_timeout(clean_env, backend):
    """``timeout=`` reaches the process group gradsync creates on every backend (fairscale
    once created its group with torch's default and ignored it). One rank, in this process."""
    if backend in ("fairscale", "deepspeed"):
        pytest.importorskip(backend)
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }.items():
        clean_env.setenv(key, value)
    Accelerator(backend=backend, timeout=7)
    group = dist.group.WORLD
    assert isinstance(
        group, audit.AuditProcessGroup
    )  # gloo under the self-check's counting wrapper
    assert group.inner.options._timeout == timedelta(seconds=7)


def test_a_missing_private_attribute_names_the_supported_version():
    pytest.importorskip("fairscale", reason=SKIP_REASON)
    from gradsync.backends import _fairscale_compat

    class Bare:
        pass

    with pytest.raises(
        RuntimeError, match=r"Bare\._should_accumulate_grads.*supports fairscale 0\.4\.13"
    ):
        with _fairscale_compat.no_sync(Bare()):
            pass
    with pytest.raises(RuntimeError, match=r"Bare\._work_handles.*supports fairscale 0\.4\.13"):
        _fairscale_compat.finish_reductions(Bare())
