"""Runs Accelerate-style scripts one after the other in this launched process.

    accelerate launch ... run_all.py PLAN.json            # each script as written
    gradsync launch ...   run_all.py PLAN.json --gradsync  # each with its import lines respelled

PLAN.json: a list of [script, [args...]] (or [script, [args...], "core"]). With ``--gradsync``
every import line from ``accelerate`` is respelled ``gradsync.accelerate`` (``respell``), and
``Trainer`` / ``TrainingArguments`` imported from ``transformers`` are taken from
``gradsync.accelerate.trainer`` (``respell_trainer``); nothing else changes. A "core" entry
takes its ``Accelerator`` from ``gradsync`` itself (gradsync's rule book) instead.
Between two scripts under Accelerate its shared state is reset, as a fresh process would
have it. The process group outlives every script but the last: a script's ``end_training()``
destroys it (Accelerate's always, gradsync's when it created it), and under torchrun a second
group cannot be formed in the same processes (the agent's store still holds the first one's
addresses), so until the last script ``torch.distributed.destroy_process_group`` keeps it.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed

IMPORT = re.compile(r"^(\s*)(from|import)\s+accelerate(\.|\s|$)", re.MULTILINE)


def respell(source: str) -> str:
    """``source`` with every ``from accelerate...`` / ``import accelerate...`` line importing
    from ``gradsync.accelerate`` instead; the changed lines' count must be the import lines'."""
    return IMPORT.sub(lambda m: f"{m.group(1)}{m.group(2)} gradsync.accelerate{m.group(3)}", source)


TRAINER = re.compile(r"^(\s*)from transformers import ([^(\n]*)$", re.MULTILINE)
TRAINER_NAMES = ("Trainer", "TrainingArguments")


def respell_trainer(source: str) -> str:
    """``source`` with ``Trainer`` and ``TrainingArguments``, where a ``from transformers
    import ...`` line imports them, taken from ``gradsync.accelerate.trainer`` instead."""

    def take(m: re.Match[str]) -> str:
        names = [n.strip() for n in m.group(2).split(",")]
        kept = [n for n in names if n not in TRAINER_NAMES]
        ours = [n for n in names if n in TRAINER_NAMES]
        if not ours:
            return m.group(0)
        lines = [f"{m.group(1)}from transformers import {', '.join(kept)}"] if kept else []
        lines.append(f"{m.group(1)}from gradsync.accelerate.trainer import {', '.join(ours)}")
        return "\n".join(lines)

    return TRAINER.sub(take, source)


def run(script: Path, args: list[str], gradsync: bool, core: bool = False) -> None:
    source = script.read_text()
    if core:
        source = source.replace(
            "from accelerate import Accelerator\n", "from gradsync import Accelerator\n"
        )
    if gradsync:
        source = respell_trainer(respell(source))
    sys.argv = [str(script), *args]
    code = compile(source, str(script), "exec")
    exec(code, {"__name__": "__main__", "__file__": str(script)})


@contextmanager
def group_kept() -> Iterator[None]:
    """``torch.distributed.destroy_process_group()`` of the default group does nothing here."""
    destroy = torch.distributed.destroy_process_group

    def keep_default(group: object = None) -> None:
        if group is not None:
            destroy(group)

    torch.distributed.destroy_process_group = keep_default
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = destroy


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    gradsync = "--gradsync" in sys.argv[2:]
    for i, (script, args, *mode) in enumerate(plan):
        if i < len(plan) - 1:
            with group_kept():
                run(Path(script), list(args), gradsync, core=mode == ["core"])
        else:
            run(Path(script), list(args), gradsync, core=mode == ["core"])
        if not gradsync:
            reset_accelerate()
    if not gradsync:
        # Under Accelerate the interpreter's exit tears down gloo's threads, which aborts a
        # rank now and then on a loaded machine ("terminate called without an active
        # exception", exit -6). Every script has written its results: the ranks meet once
        # more (while the group is there) and leave without that teardown.
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
