"""What an FSDP2 checkpoint (DCP) holds, told from its metadata's keys before any tensor is
read: the model's parameter names, and which of the two forms its optimizer state has.

An optimizer state is saved in torch's nested form (``optim.state.<name>.<key>`` and
``optim.param_groups.<g>.<key>``, each group listing its parameters' names in ``params``)
or, by a pipeline stage, in torch's flattened form (``optim.param_groups.<name>.<key>``:
the groups carry no ``params`` list). The ``state`` keys are the same in both. A stage
loading a nested checkpoint reads the state of its own parameters and the groups' settings,
and gives each of its parameters its group's settings."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from gradsync.errors import CheckpointError

_GROUPS = "optim.param_groups."


def is_flat(keys: Collection[str]) -> bool:
    """Whether the optimizer checkpoint with these keys is in the flattened form."""
    groups = [k for k in keys if k.startswith(_GROUPS)]
    return bool(groups) and not any(k.endswith(".params") for k in groups)


def check_names(folder: Path, names: Sequence[str], keys: Collection[str]) -> None:
    """The model checkpoint in ``folder`` holds every name of ``names`` (the whole model's,
    which a stage was cut from: the same on every rank) and no other name; one
    CheckpointError line otherwise, the same on every rank, before anything is read (no keys:
    no such folder, which the read reports)."""
    if not keys:
        return
    saved = [k.removeprefix("model.") for k in keys if k.startswith("model.")]
    known, held = set(names), set(saved)
    missing = [n for n in names if n not in held]
    unexpected = [n for n in saved if n not in known]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(folder)!r} holds another model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]} ({len(missing)} and {len(unexpected)} names); "
            "prepare the model it was saved from (the same parameter names) before load_state()"
        )


def nested_request(flat: dict[str, Any], keys: Collection[str]) -> dict[str, Any]:
    """What a stage reads of a nested checkpoint with these keys: the state of its own
    parameters (``flat``: its flattened state dict, whose ``state.`` keys it takes) and every
    group's settings and names (placeholders, filled by the read)."""
    groups: dict[int, dict[str, Any]] = {}
    for key in keys:
        if key.startswith(_GROUPS):
            index, name = key[len(_GROUPS) :].split(".", 1)
            groups.setdefault(int(index), {})[name] = None
    request: dict[str, Any] = {k: v for k, v in flat.items() if k.startswith("state.")}
    request["param_groups"] = [groups[i] for i in sorted(groups)]
    return request


def flattened(read: dict[str, Any], flat: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The stage's flattened state dict from what ``nested_request`` read: each of its
    parameters (named in ``flat``'s groups) takes the settings of the group that lists it."""
    out = {k: v for k, v in read.items() if k != "param_groups"}
    where = {name: g for g in read["param_groups"] for name in g.get("params") or []}
    for key in flat:
        if not key.startswith("param_groups."):
            continue
        name, setting = key[len("param_groups.") :].rsplit(".", 1)
        group = where.get(name)
        if group is None:
            raise CheckpointError(
                f"checkpoint {str(folder)!r} holds no optimizer state for parameter {name!r}; "
                "prepare the model and optimizer it was saved from before load_state()"
            )
        out[key] = group.get(setting, flat[key])  # a setting newer than the checkpoint
    return out
