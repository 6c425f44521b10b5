"""What every section of the translation shares: how messages name a key and its value
(``Source``), what comes out (``Translation``), how values are read, and the interpreter of
the sections' tables (``Key``, ``apply``).

A section's table holds one ``Key`` per key of Accelerate's file: how its value is read (a
bad value is a ConfigError naming the key and value), the values that ask for what gradsync
does anyway (nothing to do, nothing said), the values refused and why, why any other value
is ignored (one note), or where it goes (a gradsync setting, or a path in the DeepSpeed
config). ``apply`` walks the table in order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradsync._support.declaration import FALSE, TRUE
from gradsync.accelerate._compat.flags import AcceleratedFlag
from gradsync.errors import ConfigError

#: ``read(value, item) -> the value gradsync compares and keeps``; ``item`` names the key and
#: its value in a ConfigError.
Reader = Callable[[Any, str], Any]
#: A path in a mapping a section builds: ``("zero_optimization", "stage")`` in the DeepSpeed config.
KeyPath = tuple[str, ...]


@dataclass(frozen=True)
class Source:
    """Where translated values came from, for messages.

    Attributes:
        label: the file (``'accelerate.yaml'``), or "" for flags only.
        flags: (section, key) -> the flag that gave the key (it wins over the file's).
    """

    label: str = ""
    flags: Mapping[tuple[str | None, str], AcceleratedFlag] = field(default_factory=dict)

    def item(self, section: str | None, key: str, value: Any) -> str:
        """How a message names a key and its value: ``--zero_stage=5``, ``--tpu``, or
        ``deepspeed_config.zero_stage=5 in 'a.yaml'``.

        Args:
            section: the key's section (None: the top level).
            key: the key.
            value: its value.

        Returns:
            The text.
        """
        flag = self.flags.get((section, key))
        if flag is not None:
            return f"--{flag.name}" if flag.switch else f"--{flag.name}={value}"
        dotted = f"{section}.{key}" if section else key
        where = f" in {self.label}" if self.label else ""
        return f"{dotted}={value!r}{where}"


@dataclass
class Translation:
    """What Accelerate's keys say in gradsync's terms.

    Attributes:
        settings: gradsync setting -> value.
        launch: how to start the processes, by Accelerate's key: ``num_processes`` (over all
            machines), ``num_machines``, ``machine_rank``, ``main_process_ip``,
            ``main_process_port``, ``rdzv_backend``, ``use_cpu``, ``gpu_ids``,
            ``num_cpu_threads_per_process`` (those given).
        notes: one line per key that is ignored: the key, its value and why.
        origins: setting or launch key -> the key (and value) it was translated from.
    """

    settings: dict[str, Any] = field(default_factory=dict)
    launch: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    origins: dict[str, str] = field(default_factory=dict)

    def set(self, name: str, value: Any, origin: str) -> None:
        """Set the gradsync setting ``name``, translated from ``origin`` (a key and value).

        Args:
            name: the setting.
            value: its value.
            origin: the key (and value) it comes from, for messages.
        """
        self.settings[name] = value
        self.origins[name] = origin


# -- reading values -------------------------------------------------------------------------
def boolean(value: Any, item: str) -> bool:
    """A boolean: True/False, or one of the boolean words; None is False.

    Args:
        value: the value.
        item: names the key and value in a message.

    Returns:
        The boolean.

    Raises:
        ConfigError: another value.
    """
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE:
        return True
    if text in FALSE or value is None:
        return False
    raise ConfigError(f"{item} must be true or false")


def whole(
    value: Any, item: str, low: int, high: int | None = None, *, shown: int | None = None
) -> int:
    """A whole number from ``low`` to ``high``.

    Args:
        value: the value (a number or its text).
        item: names the key and value in a message.
        low: the smallest allowed.
        high: the largest allowed (None: no bound).
        shown: the lower bound messages name, where ``low`` admits a value that means "not
            set" (num_processes' -1).

    Returns:
        The number.

    Raises:
        ConfigError: another value.
    """
    try:
        number = int(str(value).strip()) if not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or number < low or (high is not None and number > high):
        first = low if shown is None else shown
        span = f"{first} to {high}" if high is not None else f">= {first}"
        raise ConfigError(f"{item} must be a whole number {span}")
    return number


def whole_number(low: int, high: int | None = None) -> Reader:
    """A reader of whole numbers from ``low`` to ``high`` (``whole``)."""
    return lambda value, item: whole(value, item, low, high)


def class_names(value: Any, item: str) -> list[str]:
    """Class names: a list, or text separated by commas.

    Args:
        value: the value.
        item: names the key and value in a message.

    Returns:
        The names (none empty).

    Raises:
        ConfigError: another value.
    """
    if isinstance(value, list | tuple):
        parts = [str(v).strip() for v in value]
    elif isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
    else:
        raise ConfigError(f"{item} must be class names separated by commas, e.g. LlamaDecoderLayer")
    return [p for p in parts if p]


def word(*choices: str, upper: bool = True) -> Reader:
    """A reader of one word, in upper (or lower) case; with ``choices``, one of them.

    Args:
        *choices: the words allowed (none: any).
        upper: upper case (else lower case).

    Returns:
        The reader; another word is a ConfigError listing the choices.
    """

    def read(value: Any, item: str) -> str:
        text = str(value).strip()
        text = text.upper() if upper else text.lower()
        if choices and text not in choices:
            use = ", ".join(choices[:-1]) + f" or {choices[-1]}" if len(choices) > 1 else choices[0]
            raise ConfigError(f"{item} is unknown; use {use}")
        return text

    return read


def given(value: Any, item: str) -> Any:
    """The value as given."""
    return value


# -- the interpreter --------------------------------------------------------------------------
@dataclass(frozen=True)
class When:
    """A key that is translated only when another key (read before it) has certain values.

    Attributes:
        key: the other key.
        values: its values under which the key is translated.
        said: under other values, one note (``... is ignored: KEY is VALUE``); else silence.
    """

    key: str
    values: tuple[Any, ...]
    said: bool = True


@dataclass(frozen=True)
class Key:
    """How one key of a section is translated.

    Attributes:
        name: the key.
        read: how its value is read (a bad value is a ConfigError naming the key and value).
        quiet: values (as read) that ask for what gradsync does anyway: nothing to do or say.
            With None among them, a null value is not read at all.
        refused: value (as read) -> why gradsync refuses it (a ConfigError).
        ignored: why any other value is ignored (one note); "" when it is translated.
        to: where any other value goes: a gradsync setting (a name), a path (a tuple) in the
            mapping the section builds (the DeepSpeed config, torch.compile's arguments), or
            nowhere (""; the value is accepted, or the section's code uses it). An empty list
            goes nowhere.
        when: the key counts only when another key has certain values.
    """

    name: str
    read: Reader = given
    quiet: tuple[Any, ...] = (None,)
    refused: Mapping[Any, str] = field(default_factory=dict)
    ignored: str = ""
    to: str | KeyPath = ""
    when: When | None = None


@dataclass
class Applied:
    """What ``apply`` read from a section.

    Attributes:
        values: each key given -> its value as read (null values of keys quiet at null left out).
        paths: path in the mapping the section builds -> (the value, the key and value it
            comes from).
    """

    values: dict[str, Any] = field(default_factory=dict)
    paths: dict[KeyPath, tuple[Any, str]] = field(default_factory=dict)


def apply(
    table: Sequence[Key],
    keys: Mapping[str, Any],
    section: str | None,
    src: Source,
    out: Translation,
) -> Applied:
    """Translate a section's keys by its table, in the table's order: read each key given,
    refuse, stay quiet, note that it is ignored, or put it where it goes.

    Args:
        table: the section's keys.
        keys: the section's mapping.
        section: its name (``fsdp_config``; None: the top level), for messages.
        src: names the keys in messages.
        out: receives the settings and notes.

    Returns:
        The values read, and the paths to fill in the mapping the section builds.

    Raises:
        ConfigError: a bad or refused value.
    """
    applied = Applied()
    for key in table:
        if key.name not in keys or (keys[key.name] is None and None in key.quiet):
            continue
        raw = keys[key.name]
        item = src.item(section, key.name, raw)
        value = applied.values[key.name] = key.read(raw, item)
        if key.refused and isinstance(value, str | int) and value in key.refused:
            raise ConfigError(f"{item}: {key.refused[value]}")
        if value in key.quiet:
            continue
        if key.when is not None and applied.values.get(key.when.key) not in key.when.values:
            if key.when.said:
                out.notes.append(
                    f"{item} is ignored: {key.when.key} is {applied.values.get(key.when.key)}"
                )
            continue
        if key.ignored:
            out.notes.append(f"{item} is ignored: {key.ignored}")
        elif value == []:
            continue
        elif isinstance(key.to, tuple):
            applied.paths[key.to] = (value, item)
        elif key.to:
            out.set(key.to, value, item)
    return applied


def leftovers(
    table: Sequence[Key],
    keys: Mapping[str, Any],
    section: str,
    src: Source,
    out: Translation,
    *,
    article: str = "a",
) -> None:
    """One note for each key of the section its table does not know.

    Args:
        table: the section's keys.
        keys: the section's mapping.
        section: its name.
        src: names the keys in messages.
        out: receives the notes.
        article: "a" or "an", as the section's name reads.
    """
    known = {key.name for key in table}
    for name in sorted(set(keys) - known):
        out.notes.append(
            f"{src.item(section, name, keys[name])} is ignored: not {article} "
            f"{section} key gradsync knows"
        )


def section(data: Mapping[str, Any], key: str, source: Source, prefix: str = "") -> dict[str, Any]:
    """A section (``fsdp_config`` ...) with its keys' prefix restored where a file left it out
    (as Accelerate reads them: ``version`` is ``fsdp_version``).

    Args:
        data: the file's mapping.
        key: the section.
        source: names it in messages.
        prefix: the prefix of its keys.

    Returns:
        Its keys ({} when absent).

    Raises:
        ConfigError: the section is no mapping.
    """
    raw = data.get(key)
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source.item(None, key, raw)} must be a mapping of {key} keys")
    return {
        (k if not prefix or str(k).startswith(prefix.rstrip("_")) else prefix + str(k)): v
        for k, v in raw.items()
    }
