"""Preemption in one process: save_on_signal saves at the next window on SIGTERM or SLURM's
SIGUSR1 and exits 0; save_signals picks the signals; requeue=True outside SLURM is one
warning; bad names are one ConfigError. (The real SLURM cycle, scancel --signal=USR1 ->
save -> requeue -> resume, is in tests/multiprocess/test_slurm.py.)"""

from __future__ import annotations

import logging
import signal

import pytest

import gradsync
from gradsync import Accelerator, ConfigError
from gradsync.checkpoint.signals import requeue_command

from harness.signals import run_until_signal


@pytest.fixture(autouse=True)
def _handlers():
    """The watch installs handlers in this process: put the previous ones back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_a_stop_signal_saves_at_the_next_window_and_exits_0(tmp_path, clean_env, capfd, signum):
    accel = Accelerator(
        backend="single",
        gradient_accumulation_steps=2,
        seed=0,
        save_on_signal=tmp_path / "preempted",
    )
    assert run_until_signal(accel, signum).code == 0
    assert gradsync.latest_checkpoint(tmp_path / "preempted") == str(
        tmp_path / "preempted" / "step-1"
    )
    err = capfd.readouterr().err
    assert (
        f"gradsync: {signal.Signals(signum).name} received; saved {tmp_path / 'preempted' / 'step-1'}, exiting"
        in err
    )


def test_save_signals_picks_the_signals(tmp_path, clean_env):
    accel = Accelerator(backend="single", save_on_signal=tmp_path / "p", save_signals=["usr2"])
    assert accel.config.save_signals == ("SIGUSR2",)
    assert getattr(signal.getsignal(signal.SIGUSR2), "__self__", None) is accel._signals
    assert getattr(signal.getsignal(signal.SIGUSR1), "__self__", None) is not accel._signals
    assert run_until_signal(accel, signal.SIGUSR2).code == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"save_signals": ["SIGFOO"]},
            "save_signals: 'SIGFOO' is not a signal gradsync saves on; use some of SIGTERM, SIGUSR1",
        ),
        ({"save_signals": []}, "save_signals=[] must be signal names"),
        (
            {"save_on_signal": "/a", "save_on_sigterm": "/b"},
            "save_on_signal='/a' contradicts save_on_sigterm='/b'",
        ),
        ({"save_on_signal": 3}, "save_on_signal=3 must be a folder path"),
    ],
)
def test_bad_signal_settings_are_one_line(clean_env, kwargs, message):
    with pytest.raises(ConfigError) as err:
        Accelerator(backend="single", **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_save_on_sigterm_is_the_old_name(tmp_path, clean_env):
    accel = Accelerator(backend="single", save_on_sigterm=str(tmp_path / "old"))
    assert accel.config.signal_folder() == str(tmp_path / "old")
    assert accel.config.save_signals == ("SIGTERM", "SIGUSR1")


def test_requeue_outside_slurm_is_one_warning_and_no_requeue(
    tmp_path, clean_env, caplog, monkeypatch
):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        Accelerator(backend="single", save_on_signal=tmp_path / "p", requeue=True)
    lines = [r.getMessage() for r in caplog.records if "requeue" in r.getMessage()]
    assert lines == [
        "gradsync: requeue=True outside a SLURM job (no SLURM_JOB_ID): the job will not be requeued"
    ]


def test_the_requeue_command_names_the_job():
    assert requeue_command({"SLURM_JOB_ID": "42"}) == ["scontrol", "requeue", "42"]
    assert requeue_command({}) is None
