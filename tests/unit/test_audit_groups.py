"""The audit's process-group labels: each recorded collective carries its group (shard /
replicate on a 2-D mesh, else world), the records and the summary line report bytes per
group, and the self-check judges ``defer_replicate`` by group. One process: the recording
path runs on a real 1-rank gloo group wrapped by the audit's process group."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gradsync import ConfigError
from gradsync._core.selfcheck import SelfCheck, start
from gradsync.audit import AUDIT_BACKEND, AuditProcessGroup, MicroStepRecord, Recorder, label_group


def _gloo_pair() -> tuple[AuditProcessGroup, AuditProcessGroup, Recorder]:
    """Two audited 1-rank gloo groups sharing one recorder (as a mesh's groups do)."""
    recorder = Recorder()
    groups = []
    for _ in range(2):
        inner = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))
        groups.append(AuditProcessGroup(inner, 0, 1, AUDIT_BACKEND["cpu"], recorder))
    return groups[0], groups[1], recorder


def test_a_labelled_group_labels_what_it_issues_and_same_size_groups_stay_apart():
    shard, replicate, recorder = _gloo_pair()
    label_group(shard, "shard")
    label_group(replicate, "replicate")
    rec = recorder.open(boundary=True)
    shard.allreduce([torch.ones(8)]).wait()  # 32 bytes
    replicate.allreduce([torch.ones(2)]).wait()  # 8 bytes
    shard.allreduce([torch.ones(4)]).wait()  # 16 bytes
    recorder.close()
    assert rec.ops == [("allreduce", 32), ("allreduce", 8), ("allreduce", 16)]  # unchanged shape
    assert rec.groups == ["shard", "replicate", "shard"]
    assert rec.nbytes(group="shard") == 48 and rec.nbytes(group="replicate") == 8
    assert rec.count("allreduce", group="replicate") == 1
    assert rec.to_dict()["groups"] == {
        "shard": {"ops": {"allreduce": 2}, "bytes": 48, "reduction_bytes": 48},
        "replicate": {"ops": {"allreduce": 1}, "bytes": 8, "reduction_bytes": 8},
    }


def test_an_unlabelled_group_outside_a_process_group_is_other_and_labels_are_checked():
    group, _, _ = _gloo_pair()
    assert group.label() == "other"  # no world here: it spans no known world
    with pytest.raises(ConfigError, match="name='node'"):
        label_group(group, "node")
    label_group(object(), "shard")  # not audited: nothing to label, no error


def _window(*micro_steps: list[tuple[str, int, str]]) -> list[MicroStepRecord]:
    recorder = Recorder()
    for i, ops in enumerate(micro_steps):
        recorder.open(boundary=i == len(micro_steps) - 1)
        for op, nbytes, group in ops:
            recorder.record(op, nbytes, group)
        recorder.close()
    return recorder.records


def test_the_one_group_summary_is_unchanged_and_a_mesh_adds_bytes_per_group():
    one = _window([], [], [], [("allreduce", 2355, "world")])
    assert Recorder().summary(one) == (
        "micro-steps 4: reductions per micro-step [0,0,0,1] (2.3 KiB), all-gathers 0"
    )
    assert one[-1].to_dict()["groups"] == {
        "world": {"ops": {"allreduce": 1}, "bytes": 2355, "reduction_bytes": 2355}
    }
    rs, ag = ("reduce_scatter", 4096, "shard"), ("allgather", 512, "shard")
    mesh = _window([ag, rs], [ag, rs], [ag, rs, ("allreduce", 1024, "replicate")])
    assert Recorder().summary(mesh) == (
        "micro-steps 3: reductions per micro-step [1,1,2] (13.0 KiB), all-gathers 3; "
        "by group: shard [1,1,1] (12.0 KiB), replicate [0,0,1] (1.0 KiB)"
    )


def test_records_made_without_groups_read_as_world():
    rec = MicroStepRecord(0, True, ops=[("allreduce", 8)])
    assert rec.labelled() == [("allreduce", 8, "world")]
    assert rec.to_dict()["groups"]["world"]["reduction_bytes"] == 8


def _run(policy: str, *micro_steps: list[tuple[str, str]], backward: bool = True) -> SelfCheck:
    recorder = Recorder()
    check = SelfCheck(recorder, audited=False, policy=lambda: policy, where="w")
    for i, ops in enumerate(micro_steps):
        boundary = i == len(micro_steps) - 1
        check.begin(boundary)
        for op, group in ops:
            recorder.record(op, 64, group)
        if backward:
            check.saw_backward()
        check.end(boundary)
    return check


RS, AR_REP, AR_WORLD = (
    ("reduce_scatter", "shard"),
    ("allreduce", "replicate"),
    ("allreduce", "world"),
)


def test_defer_replicate_is_silent_for_shard_reduce_scatters_off_the_boundary(caplog):
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        check = _run("defer_replicate", [RS], [RS], [RS], [RS, AR_REP])
    assert caplog.text == "" and not check.done


def test_defer_replicate_warns_for_an_all_reduce_across_replicas_off_the_boundary(caplog):
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        check = _run("defer_replicate", [RS, AR_REP], [RS, AR_REP])
    assert check.done
    assert caplog.text.count("gradsync self-check") == 1  # once
    assert "all-reduced across replicas 1 time(s)" in caplog.text
    assert "accel.accumulate(model)" in caplog.text  # the fix


def test_defer_replicate_warns_for_a_boundary_without_the_replica_all_reduce(caplog):
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        check = _run("defer_replicate", [RS], [RS])
    assert check.done and "did not all-reduce across replicas" in caplog.text
    assert not _run("defer_replicate", [], [], backward=False).done  # no backward, nothing due


def test_defer_replicate_judges_a_reduction_in_another_group_as_defer_does(caplog):
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        check = _run("defer_replicate", [RS, AR_WORLD], [RS, AR_REP])
    assert check.done and "issued 1 gradient reduction(s)" in caplog.text


def test_defer_replicate_on_groups_without_labels_ends_quietly(caplog):
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        check = _run("defer_replicate", [("reduce_scatter", "other")], [("allreduce", "other")])
    assert check.done and caplog.text == ""  # cannot tell the groups apart: no false alarm


def test_defer_on_a_mesh_still_wants_nothing_off_the_boundary(caplog):
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        assert not _run("defer", [], [], [RS, AR_REP]).done
        assert caplog.text == ""
        assert _run("defer", [RS], [RS, AR_REP]).done
    assert "issued 1 gradient reduction(s)" in caplog.text


def test_the_check_starts_for_defer_replicate_and_names_it():
    check = start(
        enabled=True,
        audit=Recorder(),
        policy=lambda: "defer_replicate",
        rank=1,
        world_size=4,
        backend="fsdp",
    )
    assert check is not None and check._where == "rank 1, fsdp, defer_replicate"
