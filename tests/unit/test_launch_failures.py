"""The failure report of `gradsync launch`, from the error files gradsync's worker writes
(``gradsync.launch.worker.record``) as torchrun's own ``ProcessFailure`` reads them: the rank
named is the one whose own exception came first, whatever exit status torchrun saw for it
and whatever order it saw the exits in. (The same with real launches and real signals:
tests/multiprocess/test_launch_stop.py.)"""

from __future__ import annotations

import io
import json
import signal
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from gradsync.errors import CollectiveError
from gradsync.launch import failures, worker


def _raised(err: Exception) -> Exception:
    try:
        raise err
    except Exception as caught:
        return caught


def _failure(
    tmp_path: Path, rank: int, exitcode: int, err: Exception | None = None
) -> ProcessFailure:
    path = tmp_path / f"error-{rank}.json"
    if err is not None:
        worker.record(_raised(err), str(path))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def _report(found: dict[int, ProcessFailure]) -> tuple[int, str]:
    out = io.StringIO()
    code = failures.report(ChildFailedError("worker", found), out)
    return code, out.getvalue()


def test_a_rank_stopped_while_exiting_from_its_own_exception_is_named_with_it(tmp_path):
    own = _failure(
        tmp_path, 1, -signal.SIGTERM, AttributeError("'Model' object has no attribute 'head'")
    )
    time.sleep(0.01)
    lost = _failure(
        tmp_path,
        0,
        1,
        CollectiveError(
            "wait_for_everyone() (a barrier) failed: lost its connection to another rank"
        ),
    )
    code, text = _report({0: lost, 1: own})
    assert code == 1
    assert text.splitlines()[0] == "gradsync: rank 1 (local rank 1) failed (exit code 1)"
    assert "AttributeError: 'Model' object has no attribute 'head'" in text
    assert text.splitlines()[-1] == "gradsync: also stopped: rank 0 (exit code 1: CollectiveError)"
    assert "killed by" not in text


def test_the_earliest_exception_of_its_own_wins_over_a_later_one_seen_first(tmp_path):
    first = _failure(tmp_path, 0, -signal.SIGTERM, ValueError("the first"))
    time.sleep(0.01)
    second = _failure(tmp_path, 1, 1, KeyError("the second"))
    assert failures.first_cause({1: second, 0: first})[0] == 0


def test_a_lost_peer_is_never_the_cause_when_a_rank_was_killed(tmp_path):
    lost = _failure(tmp_path, 0, 1, RuntimeError("[gloo] Connection closed by peer"))
    killed = _failure(tmp_path, 1, -signal.SIGKILL)
    assert failures.first_cause({0: lost, 1: killed})[0] == 1
    stopped = _failure(tmp_path, 1, -signal.SIGTERM)
    assert failures.first_cause({0: lost, 1: stopped})[0] == 0


def test_the_error_file_is_whole_and_says_what_the_launcher_needs(tmp_path):
    path = tmp_path / "error.json"
    worker.record(_raised(CollectiveError("backward() failed: timed out")), str(path))
    extra = json.loads(path.read_text())["message"]["extraInfo"]
    assert extra["gradsync_consequence"] is True and extra["gradsync_exitcode"] == worker.EXIT_CODE
    assert abs(extra["gradsync_time"] - time.time()) < 60
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]  # no temporary file left


def test_an_own_exception_behind_a_lost_collective_is_the_one_recorded(tmp_path):
    """A rank raises ValueError; its cleanup then runs a collective that times out."""
    try:
        try:
            raise ValueError("the data file is missing")
        except ValueError:
            raise CollectiveError("abort_window failed: timed out waiting for another rank")  # noqa: B904 (the implicit chain is what is tested)
    except CollectiveError as err:
        worker.record(err, str(tmp_path / "error.json"))
    message = json.loads((tmp_path / "error.json").read_text())["message"]
    assert message["message"] == "ValueError: the data file is missing"
    assert message["extraInfo"]["gradsync_consequence"] is False
    assert "CollectiveError" in message["extraInfo"]["py_callstack"]  # the whole chain is shown
