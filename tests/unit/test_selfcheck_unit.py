"""The self-check's bookkeeping in one process (what it judges is checked on a real 2-rank
group in test_pipelines.py): when it starts, what it leaves in the recorder, when it ends."""

from __future__ import annotations

import logging

from gradsync._core.selfcheck import STEPS, SelfCheck, start
from gradsync.audit import Recorder


def test_it_does_not_start_when_off_alone_or_native():
    common = {"audit": Recorder(), "rank": 0, "backend": "ddp"}
    assert start(enabled=False, policy=lambda: "defer", world_size=2, **common) is None
    assert start(enabled=True, policy=lambda: "defer", world_size=1, **common) is None
    assert start(enabled=True, policy=lambda: "native", world_size=2, **common) is None
    assert start(enabled=True, policy=lambda: "defer", world_size=2, **common) is not None


def test_without_a_counting_group_it_says_so_at_debug_level(caplog):
    with caplog.at_level(logging.DEBUG, logger="gradsync"):
        check = start(
            enabled=True, audit=None, policy=lambda: "defer", rank=0, world_size=2, backend="ddp"
        )
    assert check is None
    assert "cannot count collectives" in caplog.text
    assert all(r.levelno == logging.DEBUG for r in caplog.records)


def _micro_step(check, recorder, boundary, ops=(), backward=True):
    check.begin(boundary)
    for op in ops:
        recorder.record(op, 64)
    if backward:
        check.saw_backward()
    check.end(boundary)


def test_own_records_are_removed_and_the_recorder_left_as_found(caplog):
    recorder = Recorder()
    recorder.enabled = False
    check = SelfCheck(recorder, audited=False, policy=lambda: "defer", where="rank 0, ddp, defer")
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        for _ in range(STEPS):
            _micro_step(check, recorder, False, ops=["broadcast"])
            _micro_step(check, recorder, True, ops=["allreduce"])
    assert check.done and caplog.text == ""
    assert recorder.records == [] and not recorder.enabled and recorder.outside == []


def test_warns_once_and_ends():
    recorder = Recorder()
    check = SelfCheck(recorder, audited=False, policy=lambda: "defer", where="w")
    _micro_step(check, recorder, False, ops=["allreduce"])
    assert check.done
    check = SelfCheck(recorder, audited=False, policy=lambda: "defer", where="w")
    _micro_step(check, recorder, True, ops=[])
    assert check.done, "a boundary whose backward ran and reduced nothing"
    check = SelfCheck(recorder, audited=False, policy=lambda: "defer", where="w")
    _micro_step(check, recorder, True, ops=[], backward=False)
    assert not check.done, "no backward, nothing to reduce"


def test_a_policy_that_is_not_defer_ends_it():
    recorder = Recorder()
    check = SelfCheck(recorder, audited=False, policy=lambda: "every_step", where="w")
    check.begin(False)
    assert check.done and recorder.records == []


def _labelled_step(check, recorder, boundary, ops):
    check.begin(boundary)
    for op, group in ops:
        recorder.record(op, 64, group)
    check.saw_backward()
    check.end(boundary)


def test_tensor_parallel_reductions_are_never_gradient_sync(caplog):
    """On an N-D mesh the tp group's all-reduces run in every micro-step's forward and
    backward: neither defer nor defer_replicate warns about them, and they do not stand in
    for the boundary's gradient reduction."""
    tp_only = [("allreduce", "tp"), ("allreduce", "tp")]
    for policy, boundary_ops in (
        ("defer", [("reduce_scatter", "shard")]),
        ("defer_replicate", [("reduce_scatter", "shard"), ("allreduce", "replicate")]),
    ):
        recorder = Recorder()
        check = SelfCheck(recorder, audited=False, policy=lambda p=policy: p, where="w")
        off = tp_only + ([("reduce_scatter", "shard")] if policy == "defer_replicate" else [])
        with caplog.at_level(logging.WARNING, logger="gradsync"):
            for _ in range(STEPS):
                _labelled_step(check, recorder, False, off)
                _labelled_step(check, recorder, True, tp_only + boundary_ops)
        assert check.done and caplog.text == "", (policy, caplog.text)
    recorder = Recorder()
    check = SelfCheck(recorder, audited=False, policy=lambda: "defer", where="w")
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        _labelled_step(check, recorder, False, [*tp_only, ("reduce_scatter", "shard")])
    assert check.done and "off the boundary issued 1 gradient reduction(s)" in caplog.text
    caplog.clear()
    check = SelfCheck(recorder, audited=False, policy=lambda: "defer", where="w")
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        _labelled_step(check, recorder, True, tp_only)
    assert "reduced nothing" in caplog.text


def test_a_boundary_the_user_turned_the_sync_off_for_is_not_an_alarm(caplog):
    """A no_sync() of the user's inside the block (on at the backward) or around the loop
    (on when the micro-step ends, as a LocalSGD holds it): said at debug level only."""
    recorder = Recorder()
    for on_at in ("backward", "end"):
        paused = {"now": False}
        check = SelfCheck(
            recorder,
            audited=False,
            policy=lambda: "defer",
            where="w",
            paused=lambda p=paused: p["now"],
        )
        with caplog.at_level(logging.DEBUG, logger="gradsync"):
            check.begin(True)
            paused["now"] = on_at == "backward"
            check.saw_backward()
            paused["now"] = on_at == "end"
            check.end(True)
        assert not check.done and "as asked" in caplog.text
        assert all(r.levelno == logging.DEBUG for r in caplog.records)
        caplog.clear()
    off_boundary = SelfCheck(
        recorder, audited=False, policy=lambda: "defer", where="w", paused=lambda: True
    )
    _micro_step(off_boundary, recorder, False, ops=["allreduce"])
    assert off_boundary.done, "a reduction off the boundary is still gradsync's deferral gone wrong"
