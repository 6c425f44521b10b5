"""The package's shape: no import cycle, and the cost of one micro-step in function calls.

No process group: these run in a second.
"""

from __future__ import annotations

import ast
import collections
import sys
from pathlib import Path

import pytest

import gradsync

SRC = Path(gradsync.__file__).resolve().parent

#: Python function calls into gradsync per micro-step of the loop below (single backend,
#: default settings, a prepared loader): 40.5 before the micro-step runner existed, 27.75
#: since the block became a plain context manager and the one-process path lost its
#: collective naming and device moves. A deterministic stand-in for the wrapper's cost: it
#: must not rise.
CALLS_PER_MICRO_STEP = 27.75


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """gradsync module -> the gradsync modules it imports anywhere: at the top, inside
    functions and under ``TYPE_CHECKING``. ``from pkg import sub`` is an edge to ``pkg.sub``
    when that is a module, else to ``pkg``."""
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_imports_under_type_checking_and_in_functions_count():
    graph = import_graph()
    # microstep imports the window only for its annotations: still an edge.
    assert "gradsync._plan.window" in graph["gradsync._core.microstep"]
    assert "gradsync.checkpoint.state" in graph["gradsync.accelerator"]


def test_the_checkpoint_state_never_imports_the_accelerator():
    graph = import_graph()
    reached, todo = set(), ["gradsync.checkpoint.state"]
    while todo:
        node = todo.pop()
        if node not in reached:
            reached.add(node)
            todo.extend(graph[node])
    assert "gradsync.accelerator" not in reached


def _micro_step_calls(**settings: object) -> tuple[float, collections.Counter[str]]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from gradsync import Accelerator

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    accel = Accelerator(backend="single", gradient_accumulation_steps=4, **settings)
    model, opt, loader = accel.prepare(model, opt, DataLoader(data, batch_size=2))
    batches = iter(loader)

    def micro() -> None:
        x, y = next(batches)
        with accel.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accel.backward(loss)
            opt.step()
            opt.zero_grad()

    for _ in range(8):  # two windows to warm up
        micro()
    root = str(SRC)
    counts: collections.Counter[str] = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            counts[frame.f_code.co_qualname] += 1

    sys.setprofile(profile)
    try:
        for _ in range(8):  # two whole windows: 6 micro-steps off the boundary, 2 at it
            micro()
    finally:
        sys.setprofile(None)
    return sum(counts.values()) / 8, counts


def test_a_micro_step_makes_no_more_calls_than_before(clean_env):
    per_step, counts = _micro_step_calls()
    detail = ", ".join(f"{name} x{n}" for name, n in counts.most_common(12))
    assert per_step <= CALLS_PER_MICRO_STEP, f"{per_step} calls per micro-step: {detail}"


def test_the_call_count_sees_an_observer(clean_env):
    """The count is not blind: the audit (one observer) adds calls to every micro-step."""
    plain, _ = _micro_step_calls()
    audited, counts = _micro_step_calls(audit=True)
    assert audited > plain and counts["AuditObserver.begin"] == 8


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])


def _statements(fn: ast.FunctionDef) -> int:
    """Statements in a function, nested ones included, its docstring left out."""
    body = (
        fn.body[1:]
        if fn.body
        and isinstance(fn.body[0], ast.Expr)
        and isinstance(getattr(fn.body[0], "value", None), ast.Constant)
        else fn.body
    )
    return sum(1 for node in body for n in ast.walk(node) if isinstance(n, ast.stmt))


def test_the_accelerator_only_forwards():
    """Every member of the facade is a few statements that forward to the parts
    ``gradsync._assembly`` wires (its ``__init__``: the settings, the assembly, two hooks)."""
    source = (SRC / "accelerator.py").read_text()
    cls = next(
        n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Accelerator"
    )
    long = {
        fn.name: _statements(fn)
        for fn in cls.body
        if isinstance(fn, ast.FunctionDef) and _statements(fn) > (5 if fn.name == "__init__" else 3)
    }
    assert long == {}, f"members with logic in the facade (statements): {long}"


#: The tools around the core: the core (every other module) never imports them.
TOOLS = (
    "gradsync.__main__",
    "gradsync.cli",
    "gradsync.launch",
    "gradsync.verify",
    "gradsync.verify.recorder",
    "gradsync.accelerate",
)


#: Sub-packages that are nodes of their own: ``gradsync.accelerate._compat`` translates
#: Accelerate's config files and ``accelerate launch`` flags without torch, for the core's
#: config reader and the launcher; it lives with the rest of Accelerate's side but imports
#: nothing of its parent package (checked below).
SEPARATE = ("gradsync.accelerate._compat",)


def _package(module: str) -> str:
    """A module's node in the package-level graph: its sub-package of gradsync (or one of
    ``SEPARATE``), or the module itself at the top level."""
    for separate in SEPARATE:
        if module == separate or module.startswith(separate + "."):
            return separate
    return ".".join(module.split(".")[:2])


def test_separate_sub_packages_import_nothing_of_their_parent():
    graph = import_graph()
    for separate in SEPARATE:
        parent = separate.rpartition(".")[0]
        for module, imported in graph.items():
            if _package(module) == separate:
                wrong = {t for t in imported if _package(t) == parent}
                assert not wrong, (module, wrong)


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for module, imported in import_graph().items():
        graph[_package(module)].update(
            _package(t) for t in imported if _package(t) != _package(module)
        )
    return {node: {t for t in targets if t in graph} for node, targets in graph.items()}


def test_no_package_level_import_cycle():
    """Packages as nodes (backends, checkpoint, storage, data, launch, ... and each top-level
    module): no cycle, which the module-level test cannot see (a -> pkg.x, pkg.y -> a)."""
    assert find_cycle(package_graph()) is None


def test_the_package_level_check_sees_a_cycle():
    graph = package_graph()
    graph["gradsync.storage"] = {
        *graph["gradsync.storage"],
        "gradsync.checkpoint",
    }  # storage -> checkpoint
    assert find_cycle(graph) is not None


def test_the_core_never_imports_its_tools():
    tools = [t for t in TOOLS]
    core = {
        m: imported
        for m, imported in import_graph().items()
        if not any(m == t or m.startswith(t + ".") for t in tools)
    }
    found = sorted(
        f"{m} -> {t}"
        for m, imported in core.items()
        for t in imported
        if any(t == tool or t.startswith(tool + ".") for tool in tools)
        and _package(t) not in SEPARATE  # a leaf both sides read
    )
    assert found == []


def test_after_import_calls_back_at_once_for_an_imported_module_and_later_for_another(
    tmp_path, monkeypatch
):
    from gradsync._support.util import after_import

    seen: list[str] = []
    after_import("json", lambda m: seen.append(m.__name__))
    assert seen == ["json"]
    (tmp_path / "gradsync_probe_module.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "gradsync_probe_module", raising=False)
    after_import("gradsync_probe_module", lambda m: seen.append(f"{m.__name__}={m.VALUE}"))
    assert seen == ["json"]
    import gradsync_probe_module  # noqa: F401

    assert seen == ["json", "gradsync_probe_module=3"]
    assert not any(type(f).__name__ == "_AfterImport" for f in sys.meta_path)
    monkeypatch.delitem(sys.modules, "gradsync_probe_module")


#: The most code lines a module of the package may hold (docstrings, comments and blank
#: lines not counted): a longer one is split by what it does.
MODULE_CODE_LINES = 450


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    import io
    import tokenize

    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = body[0] if body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip and tok.type != tokenize.ENDMARKER:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docstrings)
    return len(lines)


def test_every_module_is_within_its_code_line_budget():
    over = {
        str(path.relative_to(SRC)): n
        for path in SRC.rglob("*.py")
        if (n := code_lines(path.read_text())) > MODULE_CODE_LINES
    }
    assert over == {}, f"modules over {MODULE_CODE_LINES} code lines (split them): {over}"


def test_the_line_count_skips_docstrings_comments_and_blank_lines():
    source = '"""Doc\nstring."""\n\n# a comment\nx = 1  # a comment after code\n\n\ndef f():\n    """Doc."""\n    return (\n        x\n    )\n'
    assert code_lines(source) == 5  # x = 1; def f(); return (; x; )
