"""How one setting is declared: a dataclass field whose metadata is ``setting(...)``.

``field(default=..., metadata=setting("one line of doc", flag=True))`` on a dataclass field
is the setting's only declaration: its name, type and default are the field's; the doc, the
``gradsync launch`` flag, the backend it belongs to and how its text is read and its value
checked are in the metadata. ``declared(cls)`` reads the fields back as ``Setting`` objects,
from which gradsync.settings derives ``Config``'s validation, the ``GRADSYNC_*`` parsing, the
YAML keys, the launcher's flags and the reference table, and scripts/gen_signatures.py writes
the signatures that take settings as keywords.

This module is the machinery only (the core settings are declared in gradsync.settings, each
backend's options next to its adapter); it imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any, Literal, get_args, get_origin

from gradsync._support.util import check_positive_int, unknown
from gradsync.errors import ConfigError

ENV_PREFIX = "GRADSYNC_"
TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off", ""})

#: ``check(name, value, config) -> the value to keep``; raises ConfigError naming the setting.
#: Called with the setting's value unless it is None and the setting takes None.
Check = Callable[[str, Any, Any], Any]
#: ``parse(text, source) -> value``: the setting's value from text (a ``GRADSYNC_*`` variable
#: or a flag); raises ConfigError naming ``source``.
Parse = Callable[[str, str], Any]
#: Modules picked by class name, class, a list of those, or a callable ``module -> bool``.
ModuleSelector = str | type | Sequence[str | type] | Callable[[Any], bool]

_KEY = "gradsync"


@dataclasses.dataclass(frozen=True)
class _Meta:
    doc: str
    flag: bool | str
    backend: str | None
    accepts: Any
    check: Check | None
    parse: Parse | None
    hint: str | None
    minimum: int | None
    metavar: str | None


def setting(
    doc: str,
    *,
    flag: bool | str = False,
    backend: str | None = None,
    accepts: Any = None,
    check: Check | None = None,
    parse: Parse | None = None,
    hint: str | None = None,
    minimum: int | None = None,
    metavar: str | None = None,
) -> dict[str, Any]:
    """The metadata of a setting's dataclass field: ``field(default=..., metadata=setting(...))``.

    Args:
        doc: one line: what the setting does (the reference table and ``--help`` show it).
        flag: True: a ``gradsync launch`` flag named after the setting (``--dash-case``, and the
            ``--snake_case`` spelling); a string: that flag; False: no flag.
        backend: the backend whose option this is; None for a core setting.
        accepts: the type the setting takes from keywords, YAML and ``GRADSYNC_*`` where it is
            wider than what ``Config`` holds once validated (e.g. a path that is kept as str).
        check: validates and normalizes the value (otherwise a check chosen by the type).
        parse: reads the value from text (otherwise a reading chosen by the type).
        hint: what to set the value to, for messages (e.g. "the seconds to wait, e.g. 600").
        minimum: the smallest whole number allowed, for an integer setting.
        metavar: the flag's value placeholder in ``--help``.

    Returns:
        The field metadata.
    """
    return {_KEY: _Meta(doc, flag, backend, accepts, check, parse, hint, minimum, metavar)}


def _members(tp: Any) -> tuple[Any, ...]:
    """The members of a union type (the type itself when it is no union)."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        return get_args(tp)
    return (tp,)


def _is_text(tp: Any) -> bool:
    return tp is str or tp is os.PathLike or get_origin(tp) in (Literal, os.PathLike)


def _is_sequence(tp: Any) -> bool:
    return get_origin(tp) in (list, tuple, Sequence)


def _is_mapping(tp: Any) -> bool:
    return tp in (dict, Mapping) or get_origin(tp) in (dict, Mapping)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One declared setting: everything gradsync derives from its declaration.

    Attributes:
        name: the keyword (``Accelerator(name=...)``) and the ``Config`` field.
        type: what the setting takes (keywords, YAML, ``GRADSYNC_*``).
        default: the value when no source gives one.
        doc: one line: what it does.
        env: the ``GRADSYNC_*`` variable.
        yaml_key: the key in a YAML config file.
        flag: the ``gradsync launch`` flag, or None.
        backend: the backend whose option it is, or None for a core setting.
        field_type: what ``Config`` holds once validated (``type`` unless declared wider).
    """

    name: str
    type: Any
    default: Any
    doc: str
    env: str
    yaml_key: str
    flag: str | None
    backend: str | None
    field_type: Any
    check: Check | None = None
    parse: Parse | None = None
    hint: str | None = None
    minimum: int | None = None
    metavar: str | None = None

    @property
    def members(self) -> tuple[Any, ...]:
        """The types of the union ``type``, None left out."""
        return tuple(m for m in _members(self.type) if m is not type(None))

    @property
    def optional(self) -> bool:
        """The setting takes None ("not given")."""
        return type(None) in _members(self.type)

    @property
    def switch(self) -> bool:
        """A boolean that is off by default: its flag takes no value (given means True)."""
        return self.members == (bool,) and self.default is False

    @property
    def choices(self) -> tuple[Any, ...] | None:
        """The allowed values of a ``Literal`` setting (one that takes nothing else but
        None), else None."""
        literals = [m for m in self.members if get_origin(m) is Literal]
        others = [m for m in self.members if get_origin(m) is not Literal and m is not type(None)]
        if len(literals) == 1 and not others:
            return get_args(literals[0])
        return None

    @property
    def type_text(self) -> str:
        """``type`` as it reads in the docs, e.g. ``int | None``."""
        return type_text(self.type)

    def from_text(self, raw: str, source: str) -> Any:
        """The value that ``raw`` (from the variable or flag ``source``) stands for: chosen by
        the type (a boolean word, a comma list, text, an integer, a number, a JSON object)."""
        if self.parse is not None:
            return self.parse(raw, source)
        members = self.members
        low = raw.strip().lower()
        if bool in members and low in TRUE | FALSE:
            return low in TRUE
        if any(_is_sequence(m) for m in members):
            return [part.strip() for part in raw.split(",") if part.strip()]
        if any(_is_text(m) for m in members):
            return raw
        if members == (bool,):
            raise ConfigError(f"{source}={raw!r} is not a boolean; set it to 1 or 0")
        if int in members:
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(
                    f"{source}={raw!r} is not an integer; set it to {self._whole()}"
                ) from None
        if float in members:
            try:
                return float(raw)
            except ValueError:
                raise ConfigError(
                    f"{source}={raw!r} is not a number; set it to {self.hint or 'a number'}"
                ) from None
        if any(_is_mapping(m) for m in members):
            try:
                return json.loads(raw)
            except ValueError:
                raise ConfigError(
                    f"{source}={raw!r} is not JSON; set it to a JSON object"
                ) from None
        return raw

    def validate(self, value: Any, config: Any) -> Any:
        """The value to keep for this setting in ``config`` (settings declared before this one
        are already validated there); raises ConfigError naming the setting, value and fix."""
        if value is None and self.optional:
            return None
        if self.check is not None:
            return self.check(self.name, value, config)
        name, members, choices = self.name, self.members, self.choices
        if members == (bool,):
            if not isinstance(value, bool):
                either = "True, False or None" if self.optional else "True or False"
                raise ConfigError(f"{name}={value!r} must be {either}")
        elif choices is not None:
            if value not in choices:
                raise ConfigError(unknown(name, value, choices))
        elif members == (int,):
            if self.minimum == 1:
                return check_positive_int(name, value)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or (self.minimum is not None and value < self.minimum)
            ):
                raise ConfigError(
                    f"{name}={value!r} must be {self._whole().replace('a whole number', 'an integer')}"
                    + (" or None" if self.optional else "")
                )
        return value

    def _whole(self) -> str:
        if self.hint is not None:
            return self.hint
        return "a whole number" + (f" >= {self.minimum}" if self.minimum is not None else "")


@cache
def declared(cls: type) -> tuple[Setting, ...]:
    """The settings declared by the fields of the dataclass ``cls``, in field order.

    Raises:
        TypeError: a field of ``cls`` carries no ``setting(...)`` metadata.
    """
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_KEY)
        if not isinstance(meta, _Meta):
            raise TypeError(f"{cls.__name__}.{f.name} has no setting(...) metadata")
        held = hints[f.name]
        flag = (
            meta.flag
            if isinstance(meta.flag, str)
            else ("--" + f.name.replace("_", "-") if meta.flag else None)
        )
        out.append(
            Setting(
                name=f.name,
                type=held if meta.accepts is None else meta.accepts,
                default=f.default,
                doc=meta.doc,
                env=ENV_PREFIX + f.name.upper(),
                yaml_key=f.name,
                flag=flag,
                backend=meta.backend,
                field_type=held,
                check=meta.check,
                parse=meta.parse,
                hint=meta.hint,
                minimum=meta.minimum,
                metavar=meta.metavar,
            )
        )
    return tuple(out)


def to_text(value: Any) -> str:
    """A setting's value as ``GRADSYNC_*`` text, which ``Setting.from_text`` reads back."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, type):
        return value.__name__  # modules are picked by class name
    if isinstance(value, list | tuple):
        return ",".join(to_text(v) for v in value)
    if isinstance(value, Mapping):
        return json.dumps(dict(value))
    if isinstance(value, os.PathLike):
        return str(os.fspath(value))
    if callable(value):  # read back by the setting's check ("module:function")
        return f"{value.__module__}:{value.__qualname__}"
    return str(value)


def type_text(tp: Any) -> str:
    """A type as it reads in the docs: ``int | None``, ``Callable[[int], int]``, ``'a' | 'b'``."""
    if tp is type(None) or tp is None:
        return "None"
    if tp is Any:
        return "Any"
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is Callable:
        params = (
            "..." if args[0] is Ellipsis else "[" + ", ".join(type_text(a) for a in args[0]) + "]"
        )
        return f"Callable[{params}, {type_text(args[-1])}]"
    if origin is not None:
        return (
            f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_text(a) for a in args)}]"
        )
    return str(getattr(tp, "__name__", tp))


def check_bytes(name: str, value: Any, config: Any) -> int:
    """A memory budget: a whole number of bytes >= 0 (None is handled before)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"{name}={value!r} must be a number of bytes >= 0 (or None for a share of "
            "the free memory)"
        )
    return value


def check_kwargs(name: str, value: Any, what: str, example: str) -> Any:
    """A dict of extra keyword arguments for a wrapper class (e.g. DistributedDataParallel)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{name}={value!r} must be a dict of {what} arguments, e.g. {example}")
    return value
