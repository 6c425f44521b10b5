"""Every public name is documented: ``gradsync.__all__`` (classes with their public methods
and properties; the public functions and classes of ``gradsync.audit``), the public members
of ``Accelerator`` and every ``gradsync`` subcommand and flag.

A function or method that takes parameters (besides self/cls) needs an ``Args:`` section
naming each of them; one that returns a value needs ``Returns:`` (or ``Yields:``); a class
needs its constructor's parameters in ``Args:`` (a dataclass: each field in ``Args:`` or
``Attributes:`` or by a docstring below it, unless the field is a declared setting,
documented by its declaration). A
property needs a docstring. Overloads are typing stubs: the implementation is what is read.
These are the docstrings the API reference (docs/reference/) is rendered from.

No process group, no model: this runs in a second.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
import types
from collections.abc import Callable, Iterator
from typing import Any

import gradsync
from gradsync._support.declaration import setting
from gradsync.cli import build_parser

#: Return annotations that are no value to document (context managers written as generators
#: yield nothing the caller sees).
_NO_VALUE = {"None", "NoReturn", "Iterator[None]", "Generator[None, None, None]"}

_SECTION = re.compile(r"^(\w[\w ]*):\s*$")
_ENTRY = re.compile(r"^(\*{0,2}\w+)\s*(\([^)]*\))?\s*:")
_SETTING_KEY = next(iter(setting("x")))  # the metadata key of a declared setting
#: Modules whose classes are walked (this one too: the checks' own test defines classes).
_OURS = ("gradsync", __name__)


def _sections(doc: str) -> dict[str, list[str]]:
    """Google-style sections of a cleaned docstring: title -> its indented lines."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in doc.splitlines():
        match = _SECTION.match(line)
        if match and not line.startswith(" "):
            current = out.setdefault(match.group(1), [])
        elif current is not None and (line.startswith(" ") or not line.strip()):
            current.append(line)
        else:
            current = None
    return out


def _entries(lines: list[str]) -> set[str]:
    """The names an ``Args:`` / ``Attributes:`` section documents (``*args`` as ``args``)."""
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    names = set()
    for line in lines:
        if line.strip() and len(line) - len(line.lstrip()) == indent:
            match = _ENTRY.match(line.strip())
            if match:
                names.add(match.group(1).lstrip("*"))
    return names


def _items(lines: list[str]) -> int:
    """How many items a section holds: its lines at the first line's indentation."""
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    return sum(1 for line in lines if line.strip() and len(line) - len(line.lstrip()) == indent)


def _returns_tuple(func: Callable[..., Any]) -> bool:
    try:
        annotation = inspect.signature(func).return_annotation
    except (TypeError, ValueError):
        return False
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return text.startswith(("tuple[", "Tuple["))


def _parameters(func: Callable[..., Any]) -> list[str]:
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return []
    return [name for name in sig.parameters if name not in ("self", "cls")]


def _returns_value(func: Callable[..., Any]) -> bool:
    try:
        annotation = inspect.signature(func).return_annotation
    except (TypeError, ValueError):
        return False
    if annotation is inspect.Signature.empty:
        return False
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return text not in _NO_VALUE


def _check_function(label: str, func: Callable[..., Any], problems: list[str]) -> None:
    doc = inspect.getdoc(func)
    if not doc:
        problems.append(f"{label}: no docstring")
        return
    sections = _sections(doc)
    params = _parameters(func)
    if params:
        if "Args" not in sections:
            problems.append(f"{label}: no Args: section (parameters {', '.join(params)})")
        else:
            missing = [p for p in params if p not in _entries(sections["Args"])]
            if missing:
                problems.append(f"{label}: Args: does not name {', '.join(missing)}")
    if _returns_value(func) and not ({"Returns", "Yields"} & set(sections)):
        problems.append(f"{label}: no Returns: section")
    for title in ("Returns", "Yields"):
        items = _items(sections.get(title, []))
        if items > 1 and not _returns_tuple(func):
            problems.append(
                f"{label}: {title}: reads as {items} values (indent its continuation lines)"
            )


def _own_init(cls: type) -> Callable[..., Any] | None:
    """The constructor the class's module wrote (not object's, an exception's or a
    dataclass's generated one)."""
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        if not klass.__module__.startswith(_OURS):
            return None
        if getattr(getattr(init, "__code__", None), "co_filename", "") == "<string>":
            return None  # a dataclass's generated __init__: its fields are checked instead
        return init  # type: ignore[no-any-return]
    return None


def _check_class(label: str, cls: type, problems: list[str]) -> None:
    doc = inspect.getdoc(cls) if cls.__doc__ else None
    if not doc:
        problems.append(f"{label}: no docstring")
        return
    sections = _sections(doc)
    documented = _entries(sections.get("Args", [])) | _entries(sections.get("Attributes", []))
    init = _own_init(cls)
    if init is not None:
        params = _parameters(init)
        init_doc = inspect.getdoc(init) or ""
        documented |= _entries(_sections(init_doc).get("Args", []))
        missing = [p for p in params if p not in documented]
        if missing:
            problems.append(
                f"{label}: Args: (class or __init__) does not name {', '.join(missing)}"
            )
    elif dataclasses.is_dataclass(cls):
        documented |= _attribute_docstrings(cls)
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.init and _SETTING_KEY not in f.metadata and f.name not in documented
        ]
        if missing:
            problems.append(
                f"{label}: field(s) {', '.join(missing)} documented neither in "
                "Attributes: nor by a docstring below the field"
            )


def _attribute_docstrings(cls: type) -> set[str]:
    """The class attributes documented by a string right below their assignment (the
    attribute docstrings the reference renders), in ``cls`` and its gradsync bases."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith(_OURS):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
        for node, following in itertools.pairwise(body):
            documented = (
                isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            )
            if documented and isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return names


def _overrides_foreign(cls: type, name: str) -> bool:
    """``name``, or another name the same function is bound to in ``cls`` (the audit group's
    ``_allgather_base = all_gather_single``), is a method of a base class outside gradsync
    (its contract is documented there; older torch knows only the other name)."""
    member = inspect.unwrap(inspect.getattr_static(cls, name))  # through compiler.disable
    ours = [k for k in cls.__mro__ if k.__module__.startswith(_OURS)]
    names = {name} | {
        n for k in ours for n, v in vars(k).items() if callable(v) and inspect.unwrap(v) is member
    }
    return any(
        names & set(vars(base)) for base in cls.__mro__[1:] if not base.__module__.startswith(_OURS)
    )


def _public_members(cls: type) -> Iterator[tuple[str, Any]]:
    """Public methods and properties that gradsync's own classes in ``cls``'s MRO define."""
    seen: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith(_OURS):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property) or inspect.isfunction(value):
                yield name, value


def _check_members(label: str, cls: type, problems: list[str]) -> None:
    for name, member in _public_members(cls):
        if _overrides_foreign(cls, name):
            continue
        if isinstance(member, property):
            if not inspect.getdoc(member):
                problems.append(f"{label}.{name}: property without a docstring")
        else:
            _check_function(f"{label}.{name}", member, problems)


def _check_name(label: str, obj: Any, problems: list[str]) -> None:
    if isinstance(obj, type):
        _check_class(label, obj, problems)
        _check_members(label, obj, problems)
    elif callable(obj):
        _check_function(label, obj, problems)


def _audit_names() -> Iterator[tuple[str, Any]]:
    from gradsync import audit

    for name, value in vars(audit).items():
        if name.startswith("_") or getattr(value, "__module__", None) != audit.__name__:
            continue
        if isinstance(value, type) or inspect.isfunction(value):
            yield name, value


def docstring_problems() -> list[str]:
    """Every missing docstring or section among gradsync's public names."""
    problems: list[str] = []
    for name in gradsync.__all__:
        obj = getattr(gradsync, name)
        if isinstance(obj, types.ModuleType):
            if not obj.__doc__:
                problems.append(f"gradsync.{name}: module without a docstring")
            for member_name, member in _audit_names():
                _check_name(f"gradsync.{name}.{member_name}", member, problems)
        else:
            _check_name(f"gradsync.{name}", obj, problems)
    return problems


def cli_problems() -> list[str]:
    """Every subcommand without a help or description, every flag without a help."""
    problems: list[str] = []
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in subparsers._choices_actions}
    for command, sub in subparsers.choices.items():
        if not (helps.get(command) or sub.description):
            problems.append(f"gradsync {command}: no help or description")
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue  # --help itself, and the hidden second spelling of a flag
            if not (action.help or "").strip():
                name = "/".join(action.option_strings) or action.dest
                problems.append(f"gradsync {command} {name}: no help")
    return problems


def test_every_public_name_has_a_docstring_with_its_sections():
    problems = docstring_problems()
    assert not problems, "undocumented public names:\n  " + "\n  ".join(problems)


def test_every_public_member_of_the_accelerator_is_documented():
    from gradsync.accelerator import Accelerator

    names = [name for name in dir(Accelerator) if not name.startswith("_")]
    assert "accumulate" in names and "save_state" in names
    problems: list[str] = []
    for name in names:
        member = inspect.getattr_static(Accelerator, name)
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, property):
            if not inspect.getdoc(member):
                problems.append(f"Accelerator.{name}: property without a docstring")
        elif callable(member):
            _check_function(f"Accelerator.{name}", member, problems)
        else:
            problems.append(f"Accelerator.{name}: neither a method nor a property")
    assert not problems, "undocumented Accelerator members:\n  " + "\n  ".join(problems)


def test_every_cli_command_and_flag_has_a_help():
    problems = cli_problems()
    assert not problems, "undocumented command-line names:\n  " + "\n  ".join(problems)


def test_the_walk_finds_what_is_missing():
    """The checks themselves: a function without Args, an unnamed parameter, no Returns."""

    def bare(x: int) -> int:
        return x

    def partial(x: int, y: int) -> int:
        """Add.

        Args:
            x: one.

        Returns:
            The sum.
        """
        return x + y

    def fine(*items: int, scale: float = 1.0) -> float:
        """Add and scale.

        Args:
            *items: the numbers.
            scale (float): a factor.

        Returns:
            The scaled sum.
        """
        return sum(items) * scale

    def wrapped() -> str:
        """Describe.

        Returns:
            A long line that goes on
            without an indent.
        """
        return ""

    @dataclasses.dataclass
    class Plan:
        """A plan."""

        size: int
        """Its size."""
        steps: int

    class Runner:
        """Runs.

        Args:
            plan: the plan.
        """

        def __init__(self, plan: Plan, timeout: float) -> None:
            self.plan = plan

        @property
        def busy(self) -> bool:
            return False

        def run(self, n: int) -> None:
            """Run.

            Args:
                n: times.
            """

    problems: list[str] = []
    _check_function("bare", bare, problems)
    _check_function("partial", partial, problems)
    _check_function("fine", fine, problems)
    _check_function("wrapped", wrapped, problems)
    _check_name("Plan", Plan, problems)
    _check_name("Runner", Runner, problems)
    assert problems == [
        "bare: no docstring",
        "partial: Args: does not name y",
        "wrapped: Returns: reads as 2 values (indent its continuation lines)",
        "Plan: field(s) steps documented neither in Attributes: nor by a docstring below the field",
        "Runner: Args: (class or __init__) does not name timeout",
        "Runner.busy: property without a docstring",
    ]
