"""The deferral self-check: count the first optimizer steps' collectives and say when the
deferral does not take effect.

It judges only what gradsync deferred: a boundary that reduces nothing because the user
turned the model's own gradient sync off around it (a LocalSGD, a ``no_sync()`` of their
own: ``Backend.user_paused_sync``) is what they asked for, said at debug level only.

With a deferring policy a micro-step off the boundary must issue no gradient reduction, and
a boundary micro-step whose backward ran must issue one. Two common mistakes break that
silently: a forward outside ``accumulate`` (DDP decides at the forward whether the next
backward syncs, so every micro-step all-reduces), or a model wrapped again by something
gradsync does not know. The check reads the audit's process-group wrapper during the first
``STEPS`` optimizer steps, warns once with the fix, and then turns itself off: afterwards
the wrapper only reads one flag per collective (see benchmarks/selfcheck_overhead.py).

On a 2-D (HSDP) mesh with ``defer_replicate`` the reduce-scatter inside the shard group
runs on every micro-step by design; what must not run off the boundary is a reduction in
any other group, the all-reduce across replicas above all (the process groups are told
apart by the labels the FSDP adapter gives them, ``gradsync.audit.label_group``), and a
boundary micro-step whose backward ran must all-reduce across replicas. Tensor parallel's
collectives (the group labelled ``"tp"``) are the model's computation, on every micro-step:
never judged as gradient sync.

It needs the counting wrapper, so it works when gradsync created the process group; for a
group created outside gradsync it says so once at debug level and does nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gradsync._support.util import human_bytes
from gradsync.audit import COMPUTE_LABELS, REDUCTIONS, MicroStepRecord, Recorder, recorder_of

log = logging.getLogger("gradsync")

#: Optimizer steps (windows) checked from the start of training.
STEPS = 3

#: The policies the check judges (the others sync on every micro-step, or natively).
DEFERRING = ("defer", "defer_replicate")


class SelfCheck:
    """Judges the micro-steps of the first ``steps`` windows (driven by the Accelerator).

    ``audited``: the Accelerator's audit opens and closes the records itself (they stay in
    ``accel.audit``); otherwise the check opens its own, with the recorder on only for the
    micro-step, and removes them again.
    """

    def __init__(
        self,
        recorder: Recorder,
        *,
        audited: bool,
        policy: Callable[[], str],
        where: str,
        steps: int = STEPS,
        paused: Callable[[], bool] = lambda: False,
    ) -> None:
        self.recorder = recorder
        self.audited = audited
        self._policy = policy
        self._paused = paused  # the user turned the models' own sync off (LocalSGD, no_sync)
        self._where = where
        self._steps = steps
        self._windows = 0
        self._record: MicroStepRecord | None = None
        self._was_enabled = recorder.enabled
        self._backward = False
        self._boundary = False
        self._user_paused = False  # the user's own sync was off at a boundary's backward
        self.done = False

    def begin(self, boundary: bool) -> None:
        """A micro-step starts (after the audit opened its record, when the audit is on)."""
        self._backward = False
        self._boundary = boundary
        self._user_paused = False
        if self._policy() not in DEFERRING:  # e.g. FSDP's "auto" chose every_step at prepare
            self.done = True
            return
        if self.audited:
            self._record = self.recorder.current
        elif self.recorder.current is None:
            self._was_enabled = self.recorder.enabled
            self.recorder.enabled = True
            self._record = self.recorder.open(boundary)

    def saw_backward(self) -> None:
        """accel.backward ran the backend's backward in this micro-step (a ``no_sync()`` of
        the user's inside the block is still on: asked here, at a boundary)."""
        self._backward = True
        if self._boundary and not self._user_paused:
            self._user_paused = self._paused()

    def abort(self) -> None:
        """The micro-step raised: nothing to judge."""
        self._release()

    def end(self, boundary: bool) -> None:
        """The micro-step finished: judge it; ``done`` tells when the check is over."""
        record = self._record
        self._release()
        if record is not None and not self.done:
            if self._policy() == "defer_replicate":
                self._judge_replicate(record, boundary)
            else:
                self._judge(record, boundary)
        if boundary:
            self._windows += 1
            self.done = self.done or self._windows >= self._steps

    def _release(self) -> None:
        if self._record is not None and not self.audited:
            self.recorder.close(keep=False)
            self.recorder.enabled = self._was_enabled
        self._record = None

    def _judge(self, record: MicroStepRecord, boundary: bool) -> None:
        if not boundary and record.reductions:
            self._warn_off_boundary(record.reductions, record.reduction_bytes)
        elif boundary and self._backward and not record.reductions and self._asked_for_it():
            log.debug(
                "gradsync self-check (%s): a boundary micro-step reduced nothing: the model's "
                "gradient sync was turned off around it (no_sync, LocalSGD), as asked",
                self._where,
            )
        elif boundary and self._backward and not record.reductions:
            self._warn(
                "a boundary micro-step ran accel.backward but reduced nothing, so the ranks' "
                "gradients were not averaged; call the forward and accel.backward inside "
                "`with accel.accumulate(model):` on the model accel.prepare() returned (not its "
                "inner module, nor one wrapped again)"
            )

    def _asked_for_it(self) -> bool:
        """The user turned the models' own gradient sync off around this boundary micro-step:
        inside the block (seen at its backward) or around it (a LocalSGD, seen now)."""
        return self._user_paused or self._paused()

    def _warn_off_boundary(self, reductions: int, nbytes: int) -> None:
        self._warn(
            f"a micro-step off the boundary issued {reductions} gradient "
            f"reduction(s) ({human_bytes(nbytes)}), so gradients are "
            "synchronised on every micro-step; run the forward inside `with "
            "accel.accumulate(model):` (DDP decides at the forward whether its backward "
            "syncs), and pass accumulate() the model accel.prepare() returned, not one "
            "wrapped again (if the reduction is your own, e.g. SyncBatchNorm or a metric, "
            "pass self_check=False)"
        )

    def _judge_replicate(self, record: MicroStepRecord, boundary: bool) -> None:
        """``defer_replicate`` on a 2-D mesh: the shard group reduces on every micro-step, the
        replicate group (and any other) only at the boundary."""
        if record.reductions and not {"shard", "replicate"} & set(record.group_labels()):
            # The mesh's groups carry no labels (gradsync.audit.label_group): the shard group's
            # reduce-scatters cannot be told from the all-reduce across replicas.
            log.debug(
                "gradsync self-check (%s): the mesh's process groups are not labelled in the "
                "audit; nothing to judge under defer_replicate",
                self._where,
            )
            self.done = True
            return
        across = record.count("allreduce", group="replicate")
        others = [
            g
            for g in record.group_labels()
            if g not in ("shard", "replicate") and g not in COMPUTE_LABELS
        ]
        elsewhere = sum(record.count(*REDUCTIONS, group=g) for g in others)
        if not boundary and across:
            self._warn(
                f"a micro-step off the boundary all-reduced across replicas {across} time(s) "
                f"({human_bytes(record.nbytes('allreduce', group='replicate'))}) under "
                "sync_policy='defer_replicate', so the cross-node all-reduce runs on every "
                "micro-step; call the forward and accel.backward inside `with "
                "accel.accumulate(model):` on the model accel.prepare() returned, and do not call "
                "set_requires_all_reduce(True) on it yourself"
            )
        elif not boundary and elsewhere:  # a reduction outside the mesh's groups: as under defer
            self._warn_off_boundary(
                elsewhere, sum(record.nbytes(*REDUCTIONS, group=g) for g in others)
            )
        elif boundary and self._backward and not across:
            self._warn(
                "a boundary micro-step ran accel.backward but did not all-reduce across replicas "
                "under sync_policy='defer_replicate', so the replicas' gradients were not averaged; "
                "call the forward and accel.backward inside `with accel.accumulate(model):` on the "
                "model accel.prepare() returned, and do not call set_requires_all_reduce(False) on "
                "it yourself"
            )

    def _warn(self, problem: str) -> None:
        log.warning("gradsync self-check (%s): %s", self._where, problem)
        self.done = True  # once is enough


def start(
    *,
    enabled: bool,
    audit: Recorder | None,
    policy: Callable[[], str],
    rank: int,
    world_size: int,
    backend: str,
    paused: Callable[[], bool] = lambda: False,
) -> SelfCheck | None:
    """The self-check for a new Accelerator, or None when it is off or has nothing to count
    (one data-parallel rank, e.g. one process or a lone pipeline, or a process group created
    outside gradsync). ``world_size``: the data-parallel ranks. ``paused``: the user turned
    the models' own gradient sync off (a LocalSGD, a ``no_sync()`` of their own), so a
    boundary that reduces nothing is what they asked for."""
    if not enabled or world_size < 2 or policy() not in (*DEFERRING, "every_step"):
        return None
    recorder = audit if audit is not None else recorder_of()
    where = f"rank {rank}, {backend}, {policy() if policy() in DEFERRING else 'defer'}"
    if recorder is None:
        if policy() in DEFERRING:
            log.debug(
                "gradsync: the deferral self-check cannot count collectives: the process group was "
                "created outside gradsync (let gradsync create it to have the first steps checked)"
            )
        return None
    return SelfCheck(recorder, audited=audit is not None, policy=policy, where=where, paused=paused)
