"""A checkpoint on disk, below everything that fills one: the folder layout and its
verified manifest (``folder``), writing on every rank and committing on rank 0
(``commit``), a failed write's one line (``failure``), random-number states (``rng``) and
the check before a load (``safety``). The backends write through it; ``gradsync.checkpoint``
decides what a checkpoint holds.
"""
