"""The checks of pipeline parallelism's options (``pp_split``, ``pp_schedule``,
``pp_microbatches``, declared with the fsdp options): where the model is split, the
schedule and its micro-batches. The pipeline's size is the ``pp`` dim of ``parallelism``.
No torch here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from gradsync.errors import ConfigError

#: The schedules ``pp_schedule`` names: torch.distributed.pipelining's single-stage ones, and
#: Interleaved1F1B (``pp_stages_per_rank`` stages on each rank).
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
#: ``pp_split``: module paths where each stage after the first begins, or a callable
#: ``(model, num_stages) -> list of stage modules``.
PPSplit = Sequence[str] | Callable[[Any, int], Sequence[Any]]


def split_from_text(raw: str, source: str) -> list[str]:
    """``GRADSYNC_PP_SPLIT`` / ``--pp-split``: the module paths, comma-separated
    ("model.layers.2,model.layers.4"), or a JSON list of them."""
    text = raw.strip()
    if text.startswith("["):
        import json

        try:
            found = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{source}={raw!r} is no JSON list of module paths: {e}") from None
        return [str(p) for p in found]
    return [p.strip() for p in text.split(",") if p.strip()]


def check_split(name: str, value: Any, config: Any) -> Any:
    """The split's form; what it names is checked against the model at prepare."""
    if callable(value):
        return value
    if isinstance(value, str):
        value = [p.strip() for p in value.split(",") if p.strip()]
    if not isinstance(value, Sequence) or not value:
        raise ConfigError(
            f"{name}={value!r} is no split; give the module paths where each stage after the "
            "first begins, e.g. ['layers.2'], or a callable (model, num_stages) -> stages"
        )
    paths = [str(p) for p in value]
    if len(set(paths)) != len(paths):
        raise ConfigError(f"{name}={paths!r} names a module twice; each stage begins once")
    return paths


def check_schedule(name: str, value: Any, config: Any) -> str:
    for known in PP_SCHEDULES:
        if str(value).strip().lower() == known.lower():
            return known
    raise ConfigError(f"{name}={value!r} is no schedule; use one of {', '.join(PP_SCHEDULES)}")
