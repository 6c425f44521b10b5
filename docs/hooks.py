"""MkDocs hooks: generate the settings reference and the CLI reference from the code.

Two pages hold a placeholder comment that is replaced when the site is built:

* ``<!-- gradsync:settings -->`` (docs/reference/settings.md): the settings table, from
  ``gradsync.settings.reference_markdown()`` (derived from the one declaration per setting);
* ``<!-- gradsync:cli -->`` (docs/reference/cli.md): every ``gradsync`` subcommand and
  flag, from ``gradsync.cli.build_parser()``, each flag's default too (the one its help names,
  else the declared default of the setting it sets, else argparse's);
* ``<!-- gradsync:cli-count -->`` (docs/reference/cli.md): how many subcommands there are,
  in words, with their names;
* ``<!-- gradsync:version -->`` (docs/changelog.md): the release, ``gradsync.__version__``
  (also in the site's name, next to the logo);
* ``<!-- gradsync:torch-range -->`` (docs/install.md, docs/changelog.md): the supported torch
  range, from ``gradsync/_support/torch_range.py`` (the one declaration; loaded by its path);
* ``<!-- gradsync:repo-url -->`` (docs/getting-started.md): the repository's address, mkdocs.yml's
  ``repo_url`` (the clone command);
* ``<!-- gradsync:accelerator-members -->`` and ``<!-- gradsync:accelerator-summary -->``
  (docs/reference/accelerator.md): the order the reference documents ``Accelerator``'s
  members in (``prepare``, ``accumulate``, ``backward``, then its other methods and its
  properties, each in the order of the source), and a table of them with each one's first
  docstring line, from ``gradsync/accelerator.py`` (read with ``ast``: no torch);
* ``<!-- gradsync:accelerate-names -->`` (docs/migrating-from-accelerate.md): every name of
  Accelerate's module paths and what ``gradsync.accelerate`` makes of it, from
  ``gradsync/accelerate/_names.py`` (loaded by its path: no torch).

All import without torch. A build in which a placeholder was not found fails.

Table cells are written for Python-Markdown's ``tables`` and ``attr_list``: a ``|`` inside
a code span stays as it is (escaping it there would show the backslash), one outside is
escaped, and text in braces is put in a code span so that ``attr_list`` does not read it as
attributes (``{"bucket_cap_mb": 50}``). tests/unit/test_docs_html.py checks the built HTML.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any, NamedTuple

SRC = Path(__file__).resolve().parents[1] / "src"

SETTINGS_MARK = "<!-- gradsync:settings -->"
CLI_MARK = "<!-- gradsync:cli -->"
CLI_COUNT_MARK = "<!-- gradsync:cli-count -->"
VERSION_MARK = "<!-- gradsync:version -->"
NAMES_MARK = "<!-- gradsync:accelerate-names -->"
TORCH_MARK = "<!-- gradsync:torch-range -->"
REPO_MARK = "<!-- gradsync:repo-url -->"
MEMBERS_MARK = "<!-- gradsync:accelerator-members -->"
SUMMARY_MARK = "<!-- gradsync:accelerator-summary -->"


_filled: set[str] = set()


def on_config(config: Any, **kwargs: Any) -> Any:
    """Import gradsync from this checkout, installed or not (mkdocs restores ``sys.path``
    after loading this module, so it is set here)."""
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))
    config["site_name"] = f"gradsync {version()}"
    return config


def version() -> str:
    """``gradsync.__version__``, from ``gradsync/_version.py`` alone (no torch)."""
    namespace: dict[str, Any] = {}
    exec((SRC / "gradsync" / "_version.py").read_text(), namespace)
    return str(namespace["__version__"])


def on_pre_build(config: Any, **kwargs: Any) -> None:
    _filled.clear()


def on_page_markdown(markdown: str, page: Any, config: Any, **kwargs: Any) -> str:
    """Fill the placeholders of the settings and CLI pages."""
    fills: dict[str, Any] = {
        REPO_MARK: lambda: str(config["repo_url"]),
        MEMBERS_MARK: lambda: "[" + ", ".join(m.name for m in accelerator_members()) + "]",
        SUMMARY_MARK: accelerator_summary,
        SETTINGS_MARK: settings_markdown,
        CLI_MARK: cli_markdown,
        CLI_COUNT_MARK: cli_count_markdown,
        VERSION_MARK: version,
        NAMES_MARK: names_markdown,
        TORCH_MARK: torch_range,
    }
    for mark, fill in fills.items():
        if mark in markdown:
            markdown = _replace(markdown, mark, fill())
            _filled.add(mark)
    return markdown


def _replace(markdown: str, mark: str, text: str) -> str:
    """``mark`` replaced by ``text``; where the mark starts an indented line (inside a
    collapsible ``???`` block), every line of ``text`` gets that indentation."""
    import re

    def indented(match: re.Match[str]) -> str:
        indent = match.group(1)
        return "\n".join(indent + line if line else line for line in text.split("\n"))

    markdown = re.sub(rf"(?m)^([ \t]+){re.escape(mark)}", indented, markdown)
    return markdown.replace(mark, text)


def on_page_content(html: str, page: Any, **kwargs: Any) -> str:
    """In table cells, a name in code may break after a dot or an underscore (``<wbr>``), so
    that a long dotted or snake_case name wraps at its joints instead of mid-word or widening
    the table past the column (tests/unit/test_docs_browser.py measures the tables)."""
    import re

    def joints(code: re.Match[str]) -> str:
        return code.group(1) + re.sub(r"([._])(?=[\w])", r"\1<wbr>", code.group(2)) + "</code>"

    def table(match: re.Match[str]) -> str:
        return re.sub(r"(<code[^>]*>)([^<]*)</code>", joints, match.group(0))

    return re.sub(r"<table\b.*?</table>", table, html, flags=re.S)


def torch_range() -> str:
    """The supported torch range ("2.10 to 2.15"), from gradsync/_support/torch_range.py alone."""
    namespace: dict[str, Any] = {}
    exec((SRC / "gradsync" / "_support" / "torch_range.py").read_text(), namespace)
    return str(namespace["supported"]())


def names_markdown() -> str:
    """The table of Accelerate's names, from gradsync/accelerate/_names.py alone."""
    import importlib.util

    path = SRC / "gradsync" / "accelerate" / "_names.py"
    spec = importlib.util.spec_from_file_location("gradsync_accelerate_names", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table: str = module.table_markdown()
    return table


def on_post_build(config: Any, **kwargs: Any) -> None:
    """The generated references must be somewhere: a lost placeholder fails the build."""
    from mkdocs.exceptions import PluginError

    marks = (
        SETTINGS_MARK,
        CLI_MARK,
        CLI_COUNT_MARK,
        VERSION_MARK,
        NAMES_MARK,
        TORCH_MARK,
        REPO_MARK,
        MEMBERS_MARK,
        SUMMARY_MARK,
    )
    missing = [mark for mark in marks if mark not in _filled]
    if missing:
        raise PluginError(
            f"docs/hooks.py: no page holds {' or '.join(missing)}; put it back where the "
            "generated reference belongs (docs/reference/settings.md, docs/reference/cli.md)"
        )


# -- the Accelerator's members --------------------------------------------------------------
#: The members the reference documents first, in this order: the three of every loop.
FIRST_MEMBERS = ("prepare", "accumulate", "backward")
#: Instance attributes the class's own Attributes table documents.
NOT_MEMBERS = ("config", "audit")


class Member(NamedTuple):
    name: str
    kind: str  # "method" or "property"
    summary: str  # the docstring's first sentence, or ""


def accelerator_members() -> list[Member]:
    """``Accelerator``'s public members: FIRST_MEMBERS, then its methods, then its properties
    (each in the source's order). An overloaded method counts once, with the docstring of its
    implementation."""
    import ast

    path = SRC / "gradsync" / "accelerator.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Accelerator")
    found: dict[str, Member] = {}
    for node in cls.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if node.name.startswith("_") or node.name in NOT_MEMBERS:
            continue
        decorators = {ast.unparse(d) for d in node.decorator_list}
        if "overload" in decorators or "typing.overload" in decorators:
            continue
        kind = "property" if decorators & {"property", "functools.cached_property"} else "method"
        doc = (ast.get_docstring(node) or "").strip()
        paragraph = " ".join(doc.split("\n\n")[0].split())
        sentence = re.match(r"(.+?[.!?])(?=\s+[A-Z`(]|$)", paragraph)
        summary = sentence.group(1) if sentence else paragraph
        if node.name not in found or not found[node.name].summary:
            previous = found.get(node.name)
            found[node.name] = Member(node.name, previous.kind if previous else kind, summary)
    missing = [name for name in FIRST_MEMBERS if name not in found]
    if missing:
        raise ValueError(f"docs/hooks.py: Accelerator has no {missing}")
    first = [found[name] for name in FIRST_MEMBERS]
    rest = [m for m in found.values() if m.name not in FIRST_MEMBERS]
    return (
        first + [m for m in rest if m.kind == "method"] + [m for m in rest if m.kind == "property"]
    )


def accelerator_summary() -> str:
    """Two tables, methods and properties, each member linked to its entry below."""
    members = accelerator_members()
    out: list[str] = []
    for kind, title in (("method", "methods"), ("property", "properties")):
        out += [f"| {title} | |", "|---|---|"]
        for m in (m for m in members if m.kind == kind):
            link = f"[`{m.name}`][gradsync.Accelerator.{m.name}]"
            out.append(f"| {link} | {_cell(m.summary.replace('``', '`'))} |")
        out.append("")
    return "\n".join(out)


# -- the settings ---------------------------------------------------------------------------
#: The settings' groups, in this order: the core settings (backend None), then each backend's.
BACKEND_TITLES = {
    None: ("Every backend", "The core settings: they apply whatever the backend."),
    "ddp": ("DDP (`ddp`)", "Options of the `ddp` backend ([the training loop](../guide.md))."),
    "fsdp": ("FSDP2 (`fsdp`)", "Options of the `fsdp` backend ([FSDP2](../fsdp.md))."),
    "deepspeed": (
        "DeepSpeed (`deepspeed`)",
        "Options of the `deepspeed` backend ([DeepSpeed](../deepspeed.md)).",
    ),
    "fairscale": (
        "fairscale (`fairscale`, legacy)",
        "Options of the `fairscale` backend ([fairscale](../fairscale.md)).",
    ),
}


def settings_markdown() -> str:
    """The settings reference: one table per backend, one row per declared setting.

    Each row reads setting, meaning, default; under the name its ``GRADSYNC_*`` variable and
    its ``gradsync launch`` flag, under the meaning its type. Each row carries the setting's
    name as its anchor (``settings.md#backend``). The same declarations give
    ``gradsync.settings.reference_markdown()`` (one flat table, for the terminal).
    """
    from gradsync.settings import SETTINGS, reference_markdown

    if not reference_markdown().strip():
        raise ValueError("gradsync.settings.reference_markdown() returned no Markdown")
    groups: dict[str | None, list[Any]] = {}
    for setting in SETTINGS:
        groups.setdefault(setting.backend, []).append(setting)
    unknown = sorted(str(b) for b in groups if b not in BACKEND_TITLES)
    if unknown:
        raise ValueError(f"docs/hooks.py: no title for the settings of backend(s) {unknown}")
    out = [
        "Jump to: "
        + " · ".join(
            f"[{BACKEND_TITLES[b][0].split(' (')[0]}](#{_slug(BACKEND_TITLES[b][0])})"
            for b in BACKEND_TITLES
            if b in groups
        ),
        "",
    ]
    for backend, (title, intro) in BACKEND_TITLES.items():
        if backend not in groups:
            continue
        out += [f"## {title}", "", intro, "", "| setting | meaning | default |", "|---|---|---|"]
        for s in groups[backend]:
            where = [_code(s.env)] + ([_code(s.flag)] if s.flag else [])
            name = f'<span id="{s.name}"></span>**{_code(s.name)}**<br><small>{" · ".join(where)}</small>'
            meaning = f"{_cell(s.doc)}<br><small>type: {_code(s.type_text)}</small>"
            out.append(f"| {name} | {meaning} | {_code(repr(s.default))} |")
        out.append("")
    return "\n".join(out) + "\n"


def _slug(title: str) -> str:
    """The anchor Python-Markdown's toc gives a heading of this title."""
    import re

    text = re.sub(r"[^\w\s-]", "", title.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


# -- the command line -----------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    from gradsync.cli import build_parser

    return build_parser()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise ValueError("gradsync's parser has no subcommands")


NUMBERS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def cli_count_markdown() -> str:
    """How many subcommands ``gradsync`` has, in words, and their names."""
    names = list(_subcommands(_parser()))
    count = NUMBERS[len(names)] if len(names) < len(NUMBERS) else str(len(names))
    listed = ", ".join(f"`{n}`" for n in names[:-1]) + f" and `{names[-1]}`"
    return f"{count} subcommands ({listed})"


def cli_markdown() -> str:
    """Every subcommand of ``gradsync``: its summary, usage and flags."""
    parser = _parser()
    helps = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
    out: list[str] = []
    for name, sub in _subcommands(parser).items():
        out += [f"## `gradsync {name}`", "", _sentence(helps.get(name, "")), ""]
        out += ["```output", _usage(sub), "```", ""]  # keeps its lines (docs/css/extra.css)
        out += _arguments(sub)
    return "\n".join(out) + "\n"


def _usage(parser: argparse.ArgumentParser) -> str:
    """The usage lines without argparse's "usage: " (continuation lines shifted to match)."""
    prefix = "usage: "
    formatter = argparse.HelpFormatter(parser.prog, width=96)  # not the terminal's width
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    lines = formatter.format_help().rstrip().splitlines()
    return "\n".join([lines[0].removeprefix(prefix)] + [line[len(prefix) :] for line in lines[1:]])


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    """One table per argument group (positional arguments, options, named groups)."""
    hidden = {a.dest: a for a in parser._actions if a.help == argparse.SUPPRESS}
    out: list[str] = []
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
        ]
        if not actions:
            continue
        out += [
            f"**{group.title}**",
            "",
            "| argument | value | default | meaning |",
            "|---|---|---|---|",
        ]
        for action in actions:
            names = [f"`{s}`" for s in action.option_strings] or [
                f"`{action.metavar or action.dest}`"
            ]
            alias = hidden.get(action.dest)
            if alias is not None and alias is not action:
                names += [f"`{s}`" for s in alias.option_strings]
            out.append(
                f"| {', '.join(names)} | {_value(action)} | {_default(action)} "
                f"| {_cell(_meaning(action))} |"
            )
        out.append("")
    return out


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "—"
    if action.nargs == argparse.REMAINDER:
        return "… (the rest of the command line)"
    metavar = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
    return _code(metavar)


#: A default a flag's help names: "(default: X)", "(default X)", "(...; default: X)".
_DEFAULT_CLAUSE = re.compile(r"(\(|; )default(?::| (?=by\b))?\s+")
#: "WORD (the default)" or "WORD (the default QUALIFIER)".
_THE_DEFAULT = re.compile(r"(\S*) \(the default( [^)]*)?\)")


def _help_default(action: argparse.Action) -> tuple[str, str] | None:
    """(the default the flag's help names, the help as the Meaning column shows it), or None.

    A clause that only names the default leaves the help; one that explains it ("default
    476: 8x H100 over NVLink") stays, and the Default column shows its first word."""
    text = str(action.help or "").replace("%%", "%")
    match = _DEFAULT_CLAUSE.search(text)
    if match is None:
        the = _THE_DEFAULT.search(text)
        if the is None:
            return None
        qualifier = (the.group(2) or "").strip()
        if action.nargs == 0:
            return qualifier or "on", text
        clause = text[text.rfind("; ", 0, the.start()) + 1 : the.start()].strip()
        named = re.match(r"([\w-]+): ", clause)  # "exec: ... (the default); fork: ..."
        word = named.group(1) if named else the.group(1).rstrip(",;:")
        return " ".join(filter(None, [word, qualifier])), text
    depth, end = 0, len(text)
    for i in range(match.end(), len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            if depth == 0:
                end = i
                break
            depth -= 1
    value = text[match.end() : end].strip()
    head = re.match(r"([^\s:;,]+)[:;] (.+)", value)
    if head is not None:
        return head.group(1), text
    if match.group(1) == "(":  # the whole parenthesis goes
        rest = text[: match.start()] + text[end + 1 :]
    else:  # the clause goes, the parenthesis it ended stays
        rest = text[: match.start()] + text[end:]
    return value, " ".join(rest.split())


def _default(action: argparse.Action) -> str:
    """The Default column, from the parser: the default the flag's help names, else the
    declared default of the setting the flag sets, else argparse's default; a switch is off,
    an option without a default is "not set" (a positional argument: "—")."""
    from gradsync.settings import BY_NAME

    if not action.option_strings or action.nargs == argparse.REMAINDER:
        return "—"
    named = _help_default(action)
    if named is not None:
        return _code(named[0]) if " " not in named[0] else _cell(named[0])
    setting = BY_NAME.get(action.dest)
    if setting is not None and not setting.switch:
        return _code(repr(setting.default))
    if action.nargs == 0:
        return "off"
    if action.default is None or action.default == argparse.SUPPRESS:
        return "not set"
    default = action.default
    if isinstance(default, list):
        default = ",".join(str(v) for v in default)
    return _code(str(default))


#: A dotted key of a config file (``zero_optimization.offload_param``) in a flag's help.
_CONFIG_KEY = re.compile(r"(?<![`\w.])([a-z][a-z0-9]*_[a-z0-9_]*(?:\.[a-z0-9_]+)+)(?![`\w])")


def _meaning(action: argparse.Action) -> str:
    """The flag's help; a config file's dotted key in code (a cell may break a key in code,
    docs/css/extra.css, so a long one does not widen the table)."""
    named = _help_default(action)
    text = named[1] if named is not None else str(action.help or "").replace("%%", "%")
    return _CONFIG_KEY.sub(r"`\1`", text)


def _sentence(text: str) -> str:
    text = text.strip()
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".") if text else ""


def _code(text: str) -> str:
    """A code span for a table cell: a ``|`` inside stays as it is (the ``tables`` extension
    does not split a row at a pipe inside backticks, and would show an escape's backslash)."""
    text = " ".join(text.split())
    ticks = "``" if "`" in text else "`"
    return f"{ticks}{text}{ticks}"


def _cell(text: str) -> str:
    """Prose safe inside a Markdown table cell: one line, ``|`` escaped outside code spans, and
    text in braces (a dict such as ``{"bucket_cap_mb": 50}``) put in a code span, so that
    ``attr_list`` does not take it for attributes of the cell."""
    import re

    parts = re.split(r"(`[^`]*`|\{[^{}`]*\})", " ".join(text.split()))
    return "".join(
        part.replace("|", "\\|") if i % 2 == 0 else part if part.startswith("`") else _code(part)
        for i, part in enumerate(parts)
    )
