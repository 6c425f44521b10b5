"""``on_oom="split"``: an out-of-memory error inside ``accumulate`` re-plans the window
instead of ending the run.

When a forward or backward runs out of memory on any rank, every rank learns of it at the
next *agreement point*, drops the window, halves the micro-batch, doubles k and re-runs the
window from its first sample (the prepared loader gives the same samples again, each
micro-batch cut in two): the global batch, the data order and the update stay those of the
plan, within floating-point reassociation.

Agreement points (one small all-reduce each, over every rank; counted apart from gradient
traffic by the audit):

* at the end of every micro-step whose backward does not communicate (off the boundary
  under ``defer``);
* before a backward that communicates (the boundary's, or every one under ``every_step``),
  in ``accel.backward``;
* before the forward of each module whose forward gathers parameters (FSDP2's units),
  so that a rank that ran out of memory in one of them never leaves the others waiting in
  the next one's all-gather.

A rank that runs out of memory goes to the end of its micro-step and takes part in the
next agreement point with "failed"; every other rank reaches that same point (no
collective lies between) and learns of it there. An OOM *inside* a backward that
communicates, after its agreement point, strands the other ranks in the gradient
reduction: it is re-raised with a note, and the run ends as any collective failure does
(the launcher's restart resumes from the last checkpoint).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gradsync import _dist as dist
from gradsync._batch_plan import BatchPlan
from gradsync.errors import ConfigError

if TYPE_CHECKING:
    import contextlib

    from gradsync._window import MicroStep, Window
    from gradsync.backends.base import Backend

log = logging.getLogger("gradsync")

#: What torch's CPU allocator says when an allocation fails (a RuntimeError, not an
#: OutOfMemoryError).
_CPU_ALLOCATOR = ("DefaultCPUAllocator: can't allocate memory", "not enough memory")


def is_out_of_memory(err: BaseException | None) -> bool:
    """``err`` is an allocation failure: ``torch.OutOfMemoryError`` (CUDA and other
    accelerators), the CPU allocator's RuntimeError, or Python's MemoryError."""
    if err is None:
        return False
    if isinstance(err, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(err, RuntimeError) and any(text in str(err) for text in _CPU_ALLOCATOR)


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
        self._hooked: set[int] = set()
        self._loader: Any = (
            None  # the prepared training loader (its split: micro-batches per batch)
        )
        self._planned: BatchPlan | None = None  # the plan at prepare, before any split
        self.agreements = 0  # agreement all-reduces run (the benchmark reads it)
        self._pending: tuple[Any, torch.Tensor] | None = None  # an agreement in flight

    def arm(self, loader: Any, models: Sequence[nn.Module]) -> None:
        """At prepare: ``loader`` (the training loader) keeps its window's batches; the
        agreement points go before each gathering module's forward."""
        loader.replannable = True
        self._loader = loader
        if self._planned is None:
            self._planned = self._plan()
        self.watch(models)

    def after_load(self) -> None:
        """A checkpoint was loaded: the plan is the one it was saved with (its loader's
        split of the micro-batch, its window's k)."""
        if self._loader is None or self._planned is None:
            return
        m = self._planned.micro_batch_size
        split = self._loader.split
        if m is not None and split > 1:
            k = self._window.steps
            self._set_plan(BatchPlan(m // split, k, self._planned.data_parallel_size))

    # -- the agreement points ----------------------------------------------------
    def _agree(self, failed: bool, wait: bool = True) -> list[int]:
        """One all-reduce over every rank: the ranks that ran out of memory (learned now,
        with those of the agreement still in flight). ``wait=False``: the all-reduce runs
        while the next micro-step computes, and the next agreement point reads it."""
        earlier = self._settle()
        if earlier:
            return earlier
        self.agreements += 1
        if self._world == 1:
            return [self._rank] if failed else []
        flags = torch.zeros(self._world, dtype=torch.int32, device=self._backend.device)
        flags[self._rank] = int(failed)
        with self._own():
            work = torch.distributed.all_reduce(flags, async_op=True)
        if not wait:
            self._pending = (work, flags)
            return []
        work.wait()
        return [r for r, f in enumerate(flags.tolist()) if f]

    def _settle(self) -> list[int]:
        """The ranks that failed, of the agreement still in flight (none: [])."""
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        work, flags = pending
        work.wait()
        return [r for r, f in enumerate(flags.tolist()) if f]

    def begin(self) -> None:
        self.active, self._agreed = True, False

    def watch(self, models: Sequence[nn.Module]) -> None:
        """Agree before the forward of every module whose forward gathers parameters."""
        for model in models:
            for module in self._backend.gathering_modules(model):
                if id(module) not in self._hooked:
                    self._hooked.add(id(module))
                    module.register_forward_pre_hook(self._before_forward, prepend=True)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if not self.active or self._agreed or not self._backend.forward_gathers(module):
            return  # outside accumulate (evaluation), past the backward's agreement, or
            # nothing to gather (the window keeps its parameters gathered)
        ranks = self._agree(False)
        if ranks:
            raise Replan(ranks)

    def before_backward(self, step: MicroStep) -> None:
        """In ``accel.backward``: agree before a backward that communicates."""
        if not self.active or not self._backend.backward_communicates(step.boundary):
            return
        self._agreed = True
        ranks = self._agree(False)
        if ranks:
            raise Replan(ranks)

    def at_exit(self, err: BaseException | None) -> list[int] | None:
        """At the end of the micro-step (after the backend's context): the ranks that ran
        out of memory when the window must be re-planned, else None (the micro-step ends
        as usual, or ``err`` propagates)."""
        self.active = False
        if isinstance(err, Replan):
            return err.ranks
        oom = is_out_of_memory(err)
        if err is not None and not oom:
            return None
        if self._agreed and not oom:
            return self._settle() or None
        if self._agreed:  # the backward that communicates already began
            if oom and err is not None and hasattr(err, "add_note"):
                err.add_note(
                    "gradsync: this out-of-memory error struck inside a backward that "
                    "synchronises gradients, where the other ranks already wait in the "
                    "reduction; on_oom='split' cannot re-plan it (resume from a checkpoint "
                    "with a smaller micro_batch_size)"
                )
            return None
        # A micro-step that ran no collective: its agreement runs while the next one
        # computes (read at the next agreement point); a failure is told at once.
        return self._agree(oom, wait=oom) or None

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
