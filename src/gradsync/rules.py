"""The rule book an Accelerator follows where gradsync and Accelerate differ.

``gradsync.Accelerator`` follows gradsync's rules (``GRADSYNC``): a partial window is the
mean over its own micro-batches, the prepared LR scheduler steps once per optimizer step,
samples are dealt to the ranks one by one. ``gradsync.accelerate.Accelerator`` follows
Accelerate's (``gradsync.accelerate.rules.accelerate_rules(...)``: Accelerate's side lives
with the rest of Accelerate), so that a script written for Accelerate ends with
Accelerate's parameters. The rule book is chosen by the import, never mixed in one run.

No torch here: the launcher and the settings read it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Divisor = Literal["window", "steps"]
Dealing = Literal["samples", "batches"]


@dataclass(frozen=True)
class Rules:
    """Where the two rule books differ.

    Attributes:
        name: "gradsync" or "accelerate" (said in warnings).
        loss_divisor: ``"window"``: ``backward`` divides a micro-batch's loss by the
            micro-batches of *this* window (a partial last window is its own mean);
            ``"steps"``: by ``gradient_accumulation_steps`` always (a partial window
            counts less).
        scheduler_per_process: the prepared LR scheduler steps once per process for each
            optimizer step (a schedule sized for one process's batches), else once.
        dealing: ``"samples"``: a ``DistributedSampler`` deals samples one by one;
            ``"batches"``: every rank runs the loader's batch sequence and takes every N-th
            whole batch (or a slice of each with ``split_batches``), the last round padded
            with the first samples (``even_batches``).
        split_batches: the loader's batch is the global batch, split over the ranks.
        even_batches: pad the last round so every rank gets the same number of batches.
        seedable_sampler: a random sampler reseeds each epoch from ``data_seed`` + epoch.
        data_seed: the seed of that sampler (default: torch's initial seed).
        resume_mid_epoch: ``load_state`` puts each prepared loader where it stood, so the
            next pass goes on at the first batch not yet consumed; else at the start of
            the pass it stood in (the same order), and the script skips the batches it
            consumed itself, with ``skip_first_batches`` or a ``continue`` in its loop.
    """

    name: str = "gradsync"
    loss_divisor: Divisor = "window"
    scheduler_per_process: bool = False
    dealing: Dealing = "samples"
    split_batches: bool = False
    even_batches: bool = True
    seedable_sampler: bool = False
    data_seed: int | None = None
    resume_mid_epoch: bool = True

    def scheduler_steps(self, processes: int) -> int:
        """LR scheduler steps per optimizer step."""
        return processes if self.scheduler_per_process else 1


GRADSYNC = Rules()
