"""`gradsync launch` stopped by a signal, and the rank it names when a worker fails.

Each test starts a real `gradsync launch` on 2 gloo ranks and sends it a real signal, or runs
a real script that raises: the launcher forwards SIGTERM / SIGINT / SIGHUP to its workers,
waits for them, prints one line and exits with 128 + the signal's number; a failing rank is
named with its own exception, whichever rank's exit torchrun's agent sees first.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

#: Each test starts its own processes and shares nothing with the others: xdist may run
#: them on either worker (tests/conftest.py).
INDEPENDENT_TESTS = True

pytestmark = pytest.mark.multiprocess

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
STOP = SCRIPTS / "stop_train.py"
RAISE = SCRIPTS / "raise_first.py"

#: How long a loaded machine may take to start 2 workers and train their first window.
START = 180.0


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADSYNC_", "TORCHELASTIC_"))}
    env.update({"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", **extra})
    return env


def _start(folder: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gradsync", "launch", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(**env),
        cwd=folder,
    )


def _wait_for(proc: subprocess.Popen[str], paths: list[Path]) -> None:
    deadline = time.monotonic() + START
    while not all(p.exists() for p in paths):
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the launch ended before its workers started:\n{out}\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the workers did not start within {START:g} s")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[str], sig: int) -> tuple[int, str, str, float]:
    sent = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=180)
    return proc.returncode, out, err, time.monotonic() - sent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_stopped_launch_stops_its_workers_and_says_so_in_one_line(tmp_path, sig):
    mode = "graceful" if sig == signal.SIGTERM else "plain"
    proc = _start(tmp_path, "--nproc-per-node", "2", str(STOP), str(tmp_path), mode)
    _wait_for(proc, [tmp_path / f"started-{r}" for r in (0, 1)])
    pids = [int((tmp_path / f"started-{r}").read_text()) for r in (0, 1)]
    code, out, err, _ = _stop(proc, sig)
    assert code == 128 + sig, err
    assert err == f"gradsync launch: stopped by {sig.name}: workers stopped\n"
    assert "Traceback" not in out
    assert not any(_alive(pid) for pid in pids)
    if sig == signal.SIGTERM:
        # each worker got the signal, and the launcher waited for it to finish its work
        assert [(tmp_path / f"got-{r}").read_text() for r in (0, 1)] == ["SIGTERM", "SIGTERM"]
        assert all((tmp_path / f"done-{r}").exists() for r in (0, 1))


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    proc = _start(
        tmp_path,
        "--nproc-per-node",
        "2",
        str(STOP),
        str(tmp_path),
        "stubborn",
        TORCH_ELASTIC_SHUTDOWN_TIMEOUT="3",
    )
    _wait_for(proc, [tmp_path / f"started-{r}" for r in (0, 1)])
    pids = [int((tmp_path / f"started-{r}").read_text()) for r in (0, 1)]
    code, _, err, took = _stop(proc, signal.SIGTERM)
    assert code == 143 and err == "gradsync launch: stopped by SIGTERM: workers stopped\n", err
    assert took >= 3  # it waited the grace period before killing them
    assert not any(_alive(pid) for pid in pids)


def test_a_launch_stopped_before_its_workers_start_says_so(tmp_path):
    # One of two nodes: the launcher waits at the rendezvous for the other, which never comes.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _start(
        tmp_path,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "stop-test",
        str(STOP),
        str(tmp_path),
        "plain",
    )
    deadline = time.monotonic() + START
    while not _listening(port):  # the launcher hosts the rendezvous store: it is waiting there
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    code, _, err, _ = _stop(proc, signal.SIGTERM)
    assert code == 143, err
    assert err == "gradsync launch: stopped by SIGTERM: before any worker started\n"
    assert not list(tmp_path.glob("started-*"))


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _launch(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradsync", "launch", "--nproc-per-node", "2", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=folder,
    )


def _block(stderr: str, rank: int) -> str:
    head = f"gradsync: rank {rank} (local rank {rank}) failed (exit code 1)"
    assert head in stderr, stderr
    return stderr[stderr.index(head) :]


def test_a_raising_rank_is_named_while_the_other_is_still_busy(tmp_path):
    """Rank 1 raises AttributeError while rank 0 sleeps outside any collective: torchrun's
    agent sees rank 1's exit and stops rank 0 by SIGTERM."""
    proc = _launch(tmp_path, str(RAISE), str(tmp_path), "busy")
    assert proc.returncode == 1, proc.stderr
    block = _block(proc.stderr, 1)
    assert block.count("Traceback (most recent call last)") == 1
    assert "AttributeError: 'DistributedDataParallel' object has no attribute 'weights'" in block
    assert "model.weights" in block  # the line of the script that raised
    assert "gradsync: also stopped: rank 0 (SIGTERM)" in block
    assert "killed by" not in proc.stderr and "ChildFailedError" not in proc.stderr


@pytest.mark.parametrize("start", ["exec", "fork"])
def test_a_raising_rank_is_named_when_the_agent_sees_the_other_rank_exit_first(tmp_path, start):
    """Rank 1 raises AttributeError and takes 10 minutes to exit (a slow exit handler); once
    it is exiting, rank 0 exits by itself (status 3). The agent sees rank 0's exit first and
    stops rank 1 by SIGTERM while it is still exiting. Rank 1's own exception is the one
    reported, with the status its worker exits with. Under --start-method fork the agent
    reports rank 0 only, which recorded nothing: the records the workers also wrote for the
    launcher name rank 1."""
    proc = _launch(tmp_path, "--start-method", start, str(RAISE), str(tmp_path), "slow-exit")
    assert proc.returncode == 1, proc.stderr
    block = _block(proc.stderr, 1)
    assert block.count("Traceback (most recent call last)") == 1
    assert "AttributeError: 'DistributedDataParallel' object has no attribute 'weights'" in block
    assert "gradsync: also stopped: rank 0 (exit code 3)" in block
    assert "killed by" not in proc.stderr and "ChildFailedError" not in proc.stderr


@pytest.mark.parametrize("start", ["exec", "fork"])
def test_the_earliest_of_two_exceptions_is_named_whichever_exit_comes_first(tmp_path, start):
    """Rank 0 raises ValueError and takes 10 minutes to exit; once it is exiting, rank 1
    raises AttributeError and exits at once. The agent sees rank 1's exit first; rank 0's
    exception came first and is the one reported. Under --start-method fork the agent
    reports rank 1 only: the records the workers also wrote for the launcher name rank 0."""
    proc = _launch(tmp_path, "--start-method", start, str(RAISE), str(tmp_path), "both")
    assert proc.returncode == 1, proc.stderr
    block = _block(proc.stderr, 0)
    assert "ValueError: rank 0 raised first" in block
    assert "gradsync: also stopped: rank 1 (exit code 1: AttributeError)" in block
    assert "killed by" not in proc.stderr
