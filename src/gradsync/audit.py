# mypy: disable-error-code="override,assignment,call-arg"
# (AuditProcessGroup overrides torch's ProcessGroup methods with the signatures the C++
# dispatcher calls them with, which differ from the Python stubs; the stubs are the problem.)
"""Count the collectives a process issues, and their bytes, per micro-step.

gradsync registers a process-group backend that wraps the real one (gloo, or nccl on
GPUs) and records every collective before handing it on. Because the wrapper *is* the
process group, it sees what DDP's C++ reducer, FSDP2 and DeepSpeed issue, which
monkeypatching ``torch.distributed`` functions cannot.

Turn it on with ``Accelerator(audit=True)`` or ``GRADSYNC_AUDIT=1``; gradsync then
creates its process group through the wrapper. Read it back from ``accel.audit``. The
deferral self-check (``gradsync._core.selfcheck``) also creates the group through the wrapper,
with its recorder off (``Recorder.enabled``) except during the micro-steps it checks.

Groups made after the world group (a device mesh's, DeepSpeed's) are wrapped too and record
into the world's recorder. Each recorded op carries its group's label (``GROUP_LABELS``):
the FSDP adapter labels a 2-D mesh's groups ``"shard"`` and ``"replicate"`` with
``label_group``, so the records and the summary line split the bytes by group.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradsync._support import torch_compat as _torch_compat
from gradsync._support.dist import is_distributed
from gradsync._support.util import after_import, human_bytes
from gradsync.errors import ConfigError

GROUP_LABELS = ("world", "shard", "replicate", "tp", "pp", "dp", "other")
"""The labels a recorded collective's group can carry: ``"shard"`` and ``"replicate"`` for the
groups of a 2-D (HSDP) device mesh, ``"tp"`` for a tensor-parallel group, ``"pp"`` for the
ranks of one pipeline (the stages' activations sent and received) and ``"dp"`` for the
data-parallel ranks of an N-D mesh, labelled by ``label_group``; an unlabelled group is
``"world"`` when it spans every rank (the world group, or a copy of it such as a 1-D mesh's),
else ``"other"``."""

COMPUTE_LABELS = frozenset({"tp", "pp"})
"""Groups whose collectives are the model's computation (tensor parallel: forward and
backward, every micro-step; the pipeline's activations and their gradients between stages),
not gradient sync: ``MicroStepRecord.reductions`` leaves them out; ``count`` / ``nbytes`` with
``group="tp"`` (or ``"pp"``) and the summary's per-group part show them."""

P2P = ("send", "recv")
"""The point-to-point ops: the pipeline's traffic, shown per micro-step on the ``pp`` line."""

REDUCTIONS = frozenset({"allreduce", "reduce_scatter", "reduce"})
"""Ops that reduce data (the gradient synchronisation of every backend is one of these)."""

AUDIT_BACKEND = {"cpu": "gradsync_audit_gloo", "cuda": "gradsync_audit_nccl"}
"""The names of the recording backends ``register()`` adds, by device type."""


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, list | tuple):
        return sum(_nbytes(o) for o in obj)
    return 0


@dataclass
class MicroStepRecord:
    """What one micro-step issued: ops in order, with their payload bytes."""

    index: int
    """The micro-step's position in ``Recorder.records`` (0 for the first)."""
    boundary: bool
    """True when the micro-step closed its window (gradients were due to sync)."""
    ops: list[tuple[str, int]] = field(default_factory=list)
    """``(op, payload bytes)`` of each collective the micro-step issued, in order (op names
    as the process group's methods: ``"allreduce"``, ``"allgather"``, ...)."""
    own: list[tuple[str, int]] = field(default_factory=list)
    """gradsync's own collectives (item counts, metrics), kept apart: never gradient traffic."""
    groups: list[str] = field(default_factory=list)
    """The group label (``GROUP_LABELS``) of each op in ``ops``, in the same order: where the
    collective ran (``"shard"`` / ``"replicate"`` on a 2-D mesh, else ``"world"``)."""

    def labelled(self) -> list[tuple[str, int, str]]:
        """The ops with their groups.

        Returns:
            ``(op, payload bytes, group label)`` of each op in ``ops``, in order (an op
                recorded without a group counts as ``"world"``).
        """
        labels = self.groups + ["world"] * (len(self.ops) - len(self.groups))
        return [(op, b, g) for (op, b), g in zip(self.ops, labels)]

    def group_labels(self) -> list[str]:
        """The distinct group labels of the micro-step's ops.

        Returns:
            The labels (``GROUP_LABELS``), in order of first use.
        """
        return list(dict.fromkeys(g for _, _, g in self.labelled()))

    def count(self, *names: str, group: str | None = None) -> int:
        """How many collectives of the micro-step are among ``names``.

        Args:
            *names: op names such as ``"allreduce"``; none: every op.
            group: only those in the group of this label (``GROUP_LABELS``); None: any.

        Returns:
            The number of those ops in ``ops`` (gradsync's own are not counted).
        """
        wanted = set(names) or None
        return sum(
            1
            for op, _, g in self.labelled()
            if (wanted is None or op in wanted) and (group is None or g == group)
        )

    def nbytes(self, *names: str, group: str | None = None) -> int:
        """The payload bytes of the micro-step's collectives among ``names``.

        Args:
            *names: op names such as ``"allreduce"``; none: every op.
            group: only those in the group of this label (``GROUP_LABELS``); None: any.

        Returns:
            The summed payload bytes of those ops in ``ops``.
        """
        wanted = set(names) or None
        return sum(
            b
            for op, b, g in self.labelled()
            if (wanted is None or op in wanted) and (group is None or g == group)
        )

    @property
    def reductions(self) -> int:
        """The number of reducing collectives (``REDUCTIONS``): gradient syncs (those of the
        groups in ``COMPUTE_LABELS``, tensor parallel's, left out)."""
        return sum(
            1 for op, _, g in self.labelled() if op in REDUCTIONS and g not in COMPUTE_LABELS
        )

    @property
    def reduction_bytes(self) -> int:
        """The payload bytes of the reducing collectives (``REDUCTIONS``), tensor parallel's
        left out."""
        return sum(
            b for op, b, g in self.labelled() if op in REDUCTIONS and g not in COMPUTE_LABELS
        )

    def to_dict(self) -> dict[str, Any]:
        """The record as plain data (for JSON).

        Returns:
            The keys ``index``, ``boundary``, ``ops`` (op name -> count),
                ``reductions``, ``reduction_bytes``, ``bytes`` (all ops), ``own`` (op
                name -> count) and ``groups`` (group label -> ``{"ops": {op name:
                count}, "bytes": n, "reduction_bytes": n}``, for the labels that occur).
        """
        counts = Counter(op for op, _ in self.ops)
        groups = {
            label: {
                "ops": dict(Counter(op for op, _, g in self.labelled() if g == label)),
                "bytes": self.nbytes(group=label),
                "reduction_bytes": self.nbytes(*REDUCTIONS, group=label),
            }
            for label in self.group_labels()
        }
        return {
            "index": self.index,
            "boundary": self.boundary,
            "ops": dict(counts),
            "reductions": self.reductions,
            "reduction_bytes": self.reduction_bytes,
            "bytes": self.nbytes(),
            "own": dict(Counter(op for op, _ in self.own)),
            "groups": groups,
        }


class Recorder:
    """Collects op records; micro-steps are opened and closed by the Accelerator."""

    def __init__(self) -> None:
        self.enabled = True
        """Off, the process group hands every collective on without recording it (one
        attribute read per collective)."""
        self._lock = threading.Lock()
        self.records: list[MicroStepRecord] = []
        """One ``MicroStepRecord`` per micro-step, in order."""
        self._current: MicroStepRecord | None = None
        self.outside: list[tuple[str, int]] = []
        """``(op, payload bytes)`` of the collectives issued outside any micro-step."""
        self._own_depth = 0

    def record(self, op: str, nbytes: int, group: str = "world") -> None:
        """Note one collective: in the open micro-step's record (its ``own`` list inside
        ``own()``), or in ``outside`` when no micro-step is open. Thread-safe.

        Args:
            op: the collective's name, e.g. ``"allreduce"``.
            nbytes: its payload bytes.
            group: the label of the group it ran in (``GROUP_LABELS``; kept for the
                micro-step's ``ops``, in its ``groups``).
        """
        with self._lock:
            if self._current is None:
                self.outside.append((op, nbytes))
            elif self._own_depth:
                self._current.own.append((op, nbytes))
            else:
                self._current.ops.append((op, nbytes))
                self._current.groups.append(group)

    @contextlib.contextmanager
    def own(self) -> Iterator[None]:
        """Collectives issued inside are gradsync's own (item counts, metrics), recorded
        apart from the micro-step's ops so they never count as gradient reductions."""
        with self._lock:
            self._own_depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._own_depth -= 1

    def open(self, boundary: bool) -> MicroStepRecord:
        """Start the record of a micro-step (appended to ``records``; it becomes ``current``).

        Args:
            boundary: whether the micro-step closes its window.

        Returns:
            The new record.
        """
        with self._lock:
            self._current = MicroStepRecord(len(self.records), boundary)
            self.records.append(self._current)
            return self._current

    @property
    def current(self) -> MicroStepRecord | None:
        """The record of the micro-step in progress, if one is open."""
        return self._current

    def close(self, keep: bool = True) -> None:
        """Close the open record (nothing is recorded into it any more).

        Args:
            keep: False also removes it from ``records`` (a micro-step that was dropped).
        """
        with self._lock:
            if (
                not keep
                and self._current is not None
                and self.records
                and self.records[-1] is self._current
            ):
                self.records.pop()
            self._current = None

    def clear(self) -> None:
        """Forget every record, the collectives outside micro-steps and the open record."""
        with self._lock:
            self.records.clear()
            self.outside.clear()
            self._current = None

    def windows(self) -> Iterator[list[MicroStepRecord]]:
        """The records grouped into accumulation windows.

        Yields:
            The records of one window, in order: each ends at a boundary micro-step,
                except a last, unfinished one.
        """
        window: list[MicroStepRecord] = []
        for rec in self.records:
            window.append(rec)
            if rec.boundary:
                yield window
                window = []
        if window:
            yield window

    def summary(self, window: list[MicroStepRecord]) -> str:
        """One line for one optimizer step.

        Args:
            window: the records of one window (one item of ``windows()``).

        Returns:
            The micro-steps, the reductions per micro-step and their bytes, the
                all-gathers and gradsync's own collectives, e.g. ``micro-steps 4:
                reductions per micro-step [0,0,0,1] (44.0 KiB), all-gathers 0``. When the
                window's collectives ran in more than one group (a 2-D mesh), the reductions
                per micro-step and their bytes of each group follow, e.g. ``; by group:
                shard [1,1,1,1] (40.0 KiB), replicate [0,0,0,1] (10.0 KiB)``; tensor
                parallel's reductions (``tp``) are only in that part, and the pipeline's
                sends and receives per micro-step (``pp``) only there.
        """
        per = ",".join(str(r.reductions) for r in window)
        red_bytes = sum(r.reduction_bytes for r in window)
        gathers = sum(r.count("allgather") for r in window)
        own = sum(len(r.own) for r in window)
        labels = list(dict.fromkeys(g for r in window for g in r.group_labels()))
        by_group = ""
        if len(labels) > 1 or COMPUTE_LABELS.intersection(labels):
            ops = {label: P2P if label == "pp" else tuple(REDUCTIONS) for label in labels}
            by_group = "; by group: " + ", ".join(
                f"{label} [{','.join(str(r.count(*ops[label], group=label)) for r in window)}] "
                f"({human_bytes(sum(r.nbytes(*ops[label], group=label) for r in window))})"
                for label in labels
            )
        return (
            f"micro-steps {len(window)}: reductions per micro-step [{per}] "
            f"({human_bytes(red_bytes)}), all-gathers {gathers}"
            + (f"; gradsync's own collectives {own}" if own else "")
            + by_group
        )


class _Work(dist.Work):
    """A finished-when-the-inner-one-is Work, for ops run as a loop of inner calls."""

    def __init__(self, works: list[Any]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for w in self._works:
            w.wait()
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        future: torch.futures.Future[Any] = self._works[-1].get_future()
        return future


class _BackendView:
    """The wrapped backend as torch reads it through ``AuditProcessGroup._get_backend``:
    its properties, except that nothing is coalesced or split past the audit."""

    supports_coalescing = False
    supports_splitting = False

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class AuditProcessGroup(dist.ProcessGroup):
    """A process group that records each collective, then runs it on the wrapped backend.

    torch.distributed makes it through the backends ``register()`` adds; its collective
    methods are ProcessGroup's.

    Args:
        inner: the real process group (gloo or NCCL) the collectives run on.
        rank: this process's rank in the group.
        world_size: the group's size.
        name: the backend's name (``AUDIT_BACKEND``'s values).
        recorder: where the collectives are recorded (default: a new ``Recorder``).
    """

    def __init__(
        self, inner: Any, rank: int, world_size: int, name: str, recorder: Recorder | None = None
    ) -> None:
        super().__init__(rank, world_size)
        self.inner = inner
        self.recorder = recorder if recorder is not None else Recorder()
        self._backend_name = name
        self._group_name = name
        self.audit_label: str | None = None
        """The label ``label_group`` gave the group (None: ``"world"`` or ``"other"``)."""

    # -- identity ---------------------------------------------------------
    def _get_backend(self, device: Any) -> _BackendView:
        """What torch reads of this group's backend for ``device``. A Python group has no
        per-device backend in torch's registry, and torch >= 2.15's ``batch_isend_irecv``
        (the pipeline's sends) asks for one: the wrapped backend's view, which never
        coalesces or splits, so every point-to-point op comes through this group."""
        return _BackendView(self.inner)

    def getBackendName(self) -> str:
        """The backend's name, as torch.distributed asks for it.

        Returns:
            One of ``AUDIT_BACKEND``'s values.
        """
        return self._backend_name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def label(self) -> str:
        """The group's label in the records (``GROUP_LABELS``).

        Returns:
            What ``label_group`` set; else ``"world"`` when the group spans every rank (the
                world group, or a copy of it), ``"other"`` when it does not.
        """
        if self.audit_label is not None:
            return self.audit_label
        if is_distributed() and (self is dist.group.WORLD or self.size() == dist.get_world_size()):
            return "world"
        return "other"

    # -- collectives ------------------------------------------------------
    def _rec(self, op: str, payload: Any) -> None:
        if self.recorder.enabled:
            self.recorder.record(op, _nbytes(payload), self.label())

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._rec("allreduce", tensors)
        return self.inner.allreduce(*_given(tensors, opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._rec("allreduce", tensors)
        return self.inner.allreduce_coalesced(*_given(tensors, opts))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._rec("reduce", tensors)
        return self.inner.reduce(*_given(tensors, opts))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._rec("broadcast", tensors)
        return self.inner.broadcast(*_given(tensors, opts))

    def barrier(self, opts: Any = None) -> Any:
        self._rec("barrier", [])
        return self.inner.barrier(*_given(opts))

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        self._rec("allgather", inputs)
        return self.inner.allgather(*_given(outputs, inputs, opts))

    def allgather_coalesced(
        self, outputs: Any, inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        self._rec("allgather", inputs)
        return self.inner.allgather_coalesced(*_given(outputs, inputs, opts))

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        self._rec("allgather", inp)
        return _torch_compat.allgather_base(self.inner, output, inp, opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return _Work([self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)])

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        self._rec("reduce_scatter", inputs)
        return self.inner.reduce_scatter(*_given(outputs, inputs, opts))

    def reduce_scatter_single(
        self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None
    ) -> Any:
        self._rec("reduce_scatter", inp)
        return _torch_compat.reduce_scatter_base(self.inner, output, inp, opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return _Work([self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(
        self, output: Any, inp: Any, out_splits: Any, in_splits: Any, opts: Any = None
    ) -> Any:
        self._rec("alltoall", inp)
        return self.inner.alltoall_base(*_given(output, inp, out_splits, in_splits, opts))

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        self._rec("alltoall", inputs)
        return self.inner.alltoall(*_given(outputs, inputs, opts))

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        self._rec("gather", inputs)
        return self.inner.gather(*_given(outputs, inputs, opts))

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        self._rec("scatter", outputs)
        return self.inner.scatter(*_given(outputs, inputs, opts))

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        self._rec("send", tensors)
        return self.inner.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        self._rec("recv", tensors)
        return self.inner.recv(tensors, src, tag)


def _given(*args: Any) -> tuple[Any, ...]:
    """A collective's arguments as the caller gave them: its options (the last) left out when
    None, so that the wrapped group applies its defaults (torch 2.4's ``all_gather`` passes
    none)."""
    return args if args[-1] is not None else args[:-1]


def _eager_under_compile(_dynamo: object) -> None:
    """The collectives run eagerly even when called from inside a torch.compile'd model (DDP's
    forward issues some): dynamo cannot trace a Python process group, and must not try. Done
    when ``torch._dynamo`` is imported (nothing can be compiled before), not at this module's
    import: importing dynamo costs seconds of CPU that a process which never builds an
    optimizer or compiles need not pay."""
    for name, method in list(vars(AuditProcessGroup).items()):
        if callable(method) and not name.startswith("__") and name not in ("_rec", "label"):
            setattr(AuditProcessGroup, name, torch.compiler.disable(method))


after_import("torch._dynamo", _eager_under_compile)


def _world_recorder() -> Recorder | None:
    """Groups made after the audited world group (DeepSpeed clones it, device meshes make
    their own) record into the world's recorder, so one recorder sees the whole process
    (None while the world group itself is being made)."""
    return recorder_of()


def _make_gloo(store: Any, rank: int, world_size: int, timeout: timedelta) -> AuditProcessGroup:
    inner = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    return AuditProcessGroup(inner, rank, world_size, AUDIT_BACKEND["cpu"], _world_recorder())


def _make_nccl(store: Any, rank: int, world_size: int, timeout: timedelta) -> AuditProcessGroup:
    opts = dist.ProcessGroupNCCL.Options()
    _torch_compat.set_nccl_timeout(opts, timeout)
    inner = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    return AuditProcessGroup(inner, rank, world_size, AUDIT_BACKEND["cuda"], _world_recorder())


def register() -> None:
    """Make the audit backends known to torch.distributed (idempotent, per process)."""
    if AUDIT_BACKEND["cpu"] not in dist.Backend.backend_list:
        dist.Backend.register_backend(AUDIT_BACKEND["cpu"], _make_gloo, devices=["cpu"])
    if dist.is_nccl_available() and AUDIT_BACKEND["cuda"] not in dist.Backend.backend_list:
        dist.Backend.register_backend(AUDIT_BACKEND["cuda"], _make_nccl, devices=["cuda"])


def recorder_of(group: Any = None) -> Recorder | None:
    """The recorder of an audited process group.

    Args:
        group: a process group (default: the world group).

    Returns:
        Its ``Recorder``, or None when it is not audited or there is no process group.
    """
    if not is_distributed():
        return None
    pg = group if group is not None else dist.group.WORLD
    return pg.recorder if isinstance(pg, AuditProcessGroup) else None


def label_group(group: Any, name: str) -> None:
    """Label a process group in the audit's records, e.g. the groups of a 2-D device mesh.

    The collectives the group issues from then on carry ``name`` (``MicroStepRecord.groups``,
    ``to_dict()["groups"]``, the per-group part of ``Recorder.summary``). The group is known
    by its object (what ``DeviceMesh.get_group(dim)`` returns, the same object each time),
    never by its size: on a (2, 2) mesh both groups have 2 ranks. A group that is not
    audited (a plain gloo or NCCL group) records nothing, and is left as it is.

    Args:
        group: a process group.
        name: its label, ``"shard"`` or ``"replicate"`` (any of ``GROUP_LABELS``).

    Raises:
        ConfigError: ``name`` is not one of ``GROUP_LABELS``.
    """
    if name not in GROUP_LABELS:
        raise ConfigError(f"label_group(name={name!r}): use one of {', '.join(GROUP_LABELS)}")
    if isinstance(group, AuditProcessGroup):
        group.audit_label = name
