"""The tracker names ``log_with`` accepts, and the one check of ``log_with``: the settings
run it when a Config is validated, :class:`~gradsync.tracking.Trackers` when it is made.
No torch here."""

from __future__ import annotations

from typing import Any

from gradsync._support.util import did_you_mean
from gradsync.errors import ConfigError

#: The built-in trackers' names, in the order ``log_with='all'`` starts them.
BUILTIN_NAMES = ("tensorboard", "wandb", "mlflow", "csv", "jsonl")
#: The tracker names ``log_with`` accepts ("all": every one whose library is installed).
TRACKER_NAMES = (*BUILTIN_NAMES, "all")


def check_log_with(name: str, value: Any, config: Any = None) -> list[Any] | None:
    """``log_with`` as a list of tracker names (lower case) and tracker objects.

    Args:
        name: the setting's name, for the messages.
        value: None, comma-separated names, one tracker object, or a list or tuple of names
            and tracker objects (anything with ``log(values, step)``).
        config: unused (the signature of a setting's check).

    Returns:
        The names and objects in order, or None when there are none.

    Raises:
        ConfigError: a name that is not a tracker (with the closest one), or an item that is
            neither a name nor a tracker object.
    """
    if value is None:
        return None
    items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        items = [items]
    out: list[Any] = []
    for item in items:
        if isinstance(item, str):
            key = item.strip().lower()
            if key not in TRACKER_NAMES:
                raise ConfigError(
                    f"{name}={item!r} is not a tracker{did_you_mean(key, TRACKER_NAMES)}; use one "
                    f"of {', '.join(TRACKER_NAMES)}, or a tracker object"
                )
            out.append(key)
        elif callable(getattr(item, "log", None)):
            out.append(item)
        else:
            raise ConfigError(
                f"{name} got a {type(item).__name__}, which is neither a tracker name nor a "
                "tracker (an object with log(values, step)); use e.g. log_with='tensorboard'"
            )
    return out or None
