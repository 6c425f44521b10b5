"""Accelerate's rule book (``gradsync.rules.Rules``), with its ``DataLoaderConfiguration``
choices: the loss divided by k in every window, the prepared scheduler stepped once per
process per update (once with ``split_batches``), whole batches dealt to the ranks, and a
resumed loader left at the start of its pass."""

from __future__ import annotations

from gradsync.rules import Rules


def accelerate_rules(
    *,
    split_batches: bool = False,
    even_batches: bool = True,
    seedable_sampler: bool = False,
    data_seed: int | None = None,
) -> Rules:
    """Accelerate's rule book (with its ``DataLoaderConfiguration`` choices)."""
    return Rules(
        name="accelerate",
        loss_divisor="steps",
        scheduler_per_process=not split_batches,
        dealing="batches",
        split_batches=split_batches,
        even_batches=even_batches,
        seedable_sampler=seedable_sampler,
        data_seed=data_seed,
        resume_mid_epoch=False,
    )
