"""``on_oom="split"``: an out-of-memory error inside ``accumulate`` re-plans the window
instead of ending the run.

When a forward or backward runs out of memory on any rank, every rank learns of it at the
next *agreement point*, drops the window, halves the micro-batch, doubles k and re-runs the
window from its first sample (the prepared loader gives the same samples again, each
micro-batch cut in two): the global batch, the data order and the update stay those of the
plan, within floating-point reassociation.

Agreement points (one small all-reduce each, over every rank; counted apart from gradient
traffic by the audit) go only where a collective follows:

* before a backward that communicates (the boundary's, or every one under ``every_step``),
  in ``accel.backward``;
* before the forward of each module whose forward gathers parameters (FSDP2's units, when
  they are sharded; DDP's forward when it broadcasts buffers), so that a rank that ran out
  of memory in one of them never leaves the others waiting in the next one's all-gather.

A micro-step with no collective (off the boundary under ``defer``) has no agreement point.
A rank that runs out of memory in one remembers it, skips the compute of the window's
remaining micro-steps (their forward stops at once) and says "failed" at the next
agreement point the other ranks reach, at the latest the boundary's backward: every rank
learns of it there, with no collective between. A window that does not run out of memory
pays one agreement per collective-bearing point, not one per micro-step. An OOM *inside* a
backward that communicates, after its agreement point, strands the other ranks in the
gradient reduction: it is re-raised with a note, and the run ends as any collective
failure does (the launcher's restart resumes from the last checkpoint).
"""

from __future__ import annotations

import gc
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gradsync._plan.batch_plan import BatchPlan
from gradsync._support import dist
from gradsync.errors import ConfigError

if TYPE_CHECKING:
    import contextlib

    from gradsync._plan.window import MicroStep, Window
    from gradsync.backends.base import Backend

log = logging.getLogger("gradsync")

#: What torch's CPU allocator says when an allocation fails (a RuntimeError, not an
#: OutOfMemoryError).
_CPU_ALLOCATOR = ("DefaultCPUAllocator: can't allocate memory", "not enough memory")


#: The launch's folder that outlives each attempt (``gradsync launch`` sets it: the name is
#: ``gradsync.launch.failures.RESTART_STATE_ENV``), and the split left in it for the next.
RESTART_STATE_ENV = "GRADSYNC_RESTART_STATE"
_LEFT_SPLIT = "oom-split.json"


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def leave_split_for_restart(rank: int, micro_batch_size: int) -> bool:
    """Tell the launch's next attempt to split its first window (this attempt ends with an
    out-of-memory error it could not agree on). False where no launcher keeps a folder."""
    folder = os.environ.get(RESTART_STATE_ENV)
    if not folder or not os.path.isdir(folder):
        return False
    left = {"attempt": _attempt() + 1, "rank": rank, "micro_batch_size": micro_batch_size}
    path = os.path.join(folder, _LEFT_SPLIT)
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w") as f:
            json.dump(left, f)
        os.replace(temporary, path)
    except OSError:
        return False
    return True


def split_left_for_this_attempt(rank: int, world: int) -> bool:
    """The previous attempt ended with an out-of-memory error on this node that no agreement
    point could catch, and left a split for this one: told by the rank that failed (or the
    node's first, when the world shrank below it)."""
    folder = os.environ.get(RESTART_STATE_ENV)
    if not folder:
        return False
    try:
        with open(os.path.join(folder, _LEFT_SPLIT)) as f:
            left = json.load(f)
        due = left["attempt"] == _attempt()
        failed, micro = int(left["rank"]), int(left["micro_batch_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not due or (
        failed != rank and not (failed >= world and os.environ.get("LOCAL_RANK") == "0")
    ):
        return False
    log.warning(
        "gradsync: the last attempt ran out of memory on rank %d inside a backward that "
        "synchronises; this one runs its first window again with micro_batch_size %d",
        failed,
        micro // 2,
    )
    return True


def is_out_of_memory(err: BaseException | None) -> bool:
    """``err`` is an allocation failure: ``torch.OutOfMemoryError`` (CUDA and other
    accelerators), the CPU allocator's RuntimeError, or Python's MemoryError."""
    if err is None:
        return False
    if isinstance(err, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(err, RuntimeError) and any(text in str(err) for text in _CPU_ALLOCATOR)


class Skip(Exception):
    """Raised in a forward on a rank that already ran out of memory in this window: the
    micro-step's compute is not needed, the window runs again (``accumulate`` swallows it)."""


class Replan(Exception):
    """Raised at an agreement point on a rank that did not fail itself: another rank ran
    out of memory, so this micro-step stops here (``accumulate`` swallows it)."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"out of memory on rank(s) {ranks}: the window is re-planned")
        self.ranks = ranks


def next_split(plan: BatchPlan) -> str | None:
    """Why ``plan``'s micro-batch cannot be halved exactly (None when it can)."""
    m = plan.micro_batch_size
    if m is None:
        return "the micro-batch size is not known (prepare the training dataloader)"
    if m == 1:
        return "micro_batch_size=1 cannot be halved"
    if m % 2:
        g = plan.global_batch_size
        return (
            f"micro_batch_size={m} is odd: halving it would change the global batch "
            f"({g}); use an even micro-batch size (a power of 2 splits down to 1)"
        )
    return None


class OomSplit:
    """The agreement points and the re-plan of one Accelerator (``on_oom="split"``)."""

    def __init__(
        self,
        *,
        window: Window,
        backend: Backend,
        plan: Callable[[], BatchPlan],
        set_plan: Callable[[BatchPlan], None],
        own: Callable[[], contextlib.AbstractContextManager[None]],
    ) -> None:
        self._window = window
        self._backend = backend
        self._plan = plan
        self._set_plan = set_plan
        self._own = own
        self._rank, self._world = dist.rank(), dist.world_size()
        self.active = False  # inside an accumulate block
        self._agreed = False  # this micro-step's backward had its agreement point
        self._failed = False  # this rank ran out of memory; the others are not told yet
        self._watched: list[nn.Module] = []  # the modules whose forward may gather
        self._loader: Any = (
            None  # the prepared training loader (its split: micro-batches per batch)
        )
        self._planned: BatchPlan | None = None  # the plan at prepare, before any split
        self._left = False  # the last attempt left a split, not yet applied
        self.agreements = 0  # agreement all-reduces run (the benchmark reads it)

    def arm(self, loader: Any, models: Sequence[nn.Module]) -> None:
        """At prepare: ``loader`` (the training loader) keeps its window's batches; the
        agreement points go before each gathering module's forward."""
        loader.replannable = True
        self._loader = loader
        if self._planned is None:
            self._planned = self._plan()
            self._left = split_left_for_this_attempt(self._rank, self._world)
        self._failed = self._failed or self._left
        self.watch(models)

    def after_load(self) -> None:
        """A checkpoint was loaded: the plan is the one it was saved with (its loader's
        split of the micro-batch, its window's k)."""
        self._failed = self._left  # a split the last attempt left applies to the resumed run
        if self._loader is None or self._planned is None:
            return
        m = self._planned.micro_batch_size
        split = self._loader.split
        if m is not None and split > 1:
            k = self._window.steps
            self._set_plan(BatchPlan(m // split, k, self._planned.data_parallel_size))

    # -- the agreement points ----------------------------------------------------
    def _agree(self) -> list[int]:
        """One all-reduce over every rank: the ranks that ran out of memory (this one
        included when it did); the failure is told."""
        failed, self._failed, self._left = self._failed, False, False
        self.agreements += 1
        if self._world == 1:
            return [self._rank] if failed else []
        flags = torch.zeros(self._world, dtype=torch.int32, device=self._backend.device)
        flags[self._rank] = int(failed)
        with self._own():
            torch.distributed.all_reduce(flags)
        return [r for r, f in enumerate(flags.tolist()) if f]

    def begin(self) -> None:
        self.active, self._agreed = True, False

    def watch(self, models: Sequence[nn.Module]) -> None:
        """Agree before the forward of every module whose forward gathers parameters."""
        hooked = {id(m) for m in self._watched}
        for model in models:
            for module in self._backend.gathering_modules(model):
                if id(module) not in hooked:
                    hooked.add(id(module))
                    self._watched.append(module)
                    module.register_forward_pre_hook(self._before_forward, prepend=True)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if not self.active or self._agreed:
            return  # outside accumulate (evaluation), or past the backward's agreement
        if self._backend.forward_gathers(module):
            ranks = self._agree()
            if ranks:
                raise Replan(ranks)
        elif self._failed:
            raise Skip  # nothing to gather: this rank's compute is not needed

    def before_backward(self, step: MicroStep) -> None:
        """In ``accel.backward``: agree before a backward that communicates."""
        if not self.active:
            return
        if not self._backend.backward_communicates(step.boundary):
            if self._failed:
                raise Skip
            return
        self._agreed = True
        ranks = self._agree()
        if ranks:
            raise Replan(ranks)

    def _others_agree_in(self, boundary: bool) -> bool:
        """Whether the other ranks meet an agreement point in the rest of this micro-step:
        a backward that communicates, or a forward that gathers still ahead."""
        if self._backend.backward_communicates(boundary):
            return True
        return any(self._backend.forward_gathers(m) for m in self._watched)

    def at_exit(self, err: BaseException | None, boundary: bool) -> list[int] | None:
        """At the end of the micro-step (after the backend's context): the ranks that ran
        out of memory when the window must be re-planned now, else None (the micro-step
        ends as usual: ``err`` propagates, or this rank's failure waits for the next
        agreement point and ``err`` is swallowed)."""
        self.active = False
        if isinstance(err, Replan):
            return err.ranks
        oom = is_out_of_memory(err)
        if err is not None and not oom and not isinstance(err, Skip):
            return None
        if self._agreed:  # the backward that communicates already began
            if oom and err is not None:
                self._note_unagreed(err)
            return None
        if oom:
            self._failed = True
        if self._failed and self._others_agree_in(boundary):
            return self._agree()
        return None

    def _note_unagreed(self, err: BaseException) -> None:
        """An out-of-memory error inside a backward that synchronises ends this attempt; the
        launcher's restart runs its first window again, split, when a split is possible."""
        plan = self._plan()
        m = plan.micro_batch_size
        left = next_split(plan) is None and leave_split_for_restart(self._rank, m or 0)
        then = (
            f"gradsync launch's restart (--max-restarts) resumes from the last checkpoint and "
            f"runs its first window again with micro_batch_size {(m or 0) // 2}"
            if left
            else "resume from a checkpoint with a smaller micro_batch_size"
        )
        if hasattr(err, "add_note"):
            err.add_note(
                "gradsync: this out-of-memory error struck inside a backward that synchronises "
                "gradients, where the other ranks already wait in the reduction; on_oom='split' "
                f"cannot re-plan it in this attempt: {then}"
            )

    def swallows(self, err: BaseException | None) -> bool:
        """``err`` ended a micro-step whose failure waits for the next agreement point."""
        return self._failed and (isinstance(err, Skip) or is_out_of_memory(err))

    # -- the re-plan -------------------------------------------------------------
    def replan(self, ranks: list[int], feed: Any) -> None:
        """The window was dropped on every rank: halve the micro-batch, double k and
        re-run the window from its first sample. ``feed``: the loader pass (a
        ``LoaderIteration``) that fed the window."""
        plan = self._plan()
        why = next_split(plan)
        if why is None and (feed is None or not feed.owner.replannable):
            why = "no prepared training dataloader fed the window"
        if why is not None:
            raise torch.OutOfMemoryError(
                f"out of memory on rank(s) {ranks} (micro_batch_size={plan.micro_batch_size}); "
                f"on_oom='split' cannot split further: {why}"
            )
        assert feed is not None and plan.micro_batch_size is not None
        consumed = feed.split_further()
        k = self._window.steps * 2
        self._window.steps = k
        smaller = BatchPlan(plan.micro_batch_size // 2, k, plan.data_parallel_size)
        self._set_plan(smaller)
        if self._rank == 0:
            log.warning(
                "gradsync: out of memory on rank(s) %s in window %d: micro_batch_size %d -> %d, "
                "gradient_accumulation_steps %d -> %d (global batch %s kept); the window runs "
                "again from its first sample (%d micro-batch(es) redone)",
                ranks,
                self._window.completed_windows + 1,
                plan.micro_batch_size,
                smaller.micro_batch_size,
                plan.gradient_accumulation_steps,
                k,
                smaller.global_batch_size,
                consumed,
            )
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def check_at_prepare(plan: BatchPlan, backend: Backend, has_loader: bool, schedule: Any) -> None:
    """The one-line refusals of ``on_oom="split"``, at prepare rather than at the first OOM."""
    refusal = backend.oom_split_refusal()
    if refusal is not None:
        raise ConfigError(f"on_oom='split' is not available: {refusal}")
    if not has_loader:
        raise ConfigError(
            "on_oom='split' re-runs a window from its first sample, which the prepared "
            "training dataloader gives again; prepare it (in this prepare call or an earlier "
            "one) or set on_oom='raise'"
        )
    why = next_split(plan)
    if why is not None:
        raise ConfigError(f"on_oom='split' cannot split the micro-batch: {why}")
    if backend.backward_communicates(False) and dist.rank() == 0:
        log.warning(
            "gradsync: on_oom='split' with backend=%r and sync_policy=%r: every backward "
            "runs a collective, so an out-of-memory error inside a backward ends the run (one "
            "in a forward is re-planned); with fsdp, sync_policy='defer' and "
            "fsdp_keep_params_in_window=True keep backwards off the boundary collective-free",
            backend.name,
            backend.policy,
        )
    if schedule is not None:
        raise ConfigError(
            f"on_oom='split' doubles k, but gradient_accumulation_steps is a schedule "
            f"({schedule}); give a number, or set on_oom='raise'"
        )
