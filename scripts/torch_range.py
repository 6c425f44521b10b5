"""The supported torch range, from its one declaration (src/gradsync/_support/torch_range.py).

    python scripts/torch_range.py                # "2.10 to 2.15"
    python scripts/torch_range.py --pins         # the releases CI tests: "2.10.0 2.15.0"
    python scripts/torch_range.py --write        # pyproject.toml's torch requirement from it
    python scripts/torch_range.py --check        # exit 1 while pyproject.toml differs
    python scripts/torch_range.py --floors       # the extras' lowest versions, as pins

The oldest end of the range is tested with those lowest versions (the ``deepspeed``, ``hf``
and ``bench`` extras' ``>=`` floors in pyproject.toml).

Reads the module by its path: no torch, no installed gradsync needed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
REQUIREMENT = re.compile(r'"torch>=[0-9.]+"')
#: The extras whose lowest versions are tested with the oldest torch.
FLOORED = ("deepspeed", "transformers", "accelerate")


def floors() -> list[str]:
    """``name==X.Y.Z`` for each of ``FLOORED``, from its ``>=`` floor in pyproject.toml."""
    text = PYPROJECT.read_text()
    pins = []
    for name in FLOORED:
        found = re.findall(rf'"{name}>=([0-9.]+)"', text)
        if len(found) != 1:
            raise SystemExit(f'pyproject.toml: expected exactly one "{name}>=X.Y" requirement')
        version = found[0] + ".0" * (2 - found[0].count("."))
        pins.append(f"{name}=={version}")
    return pins


def declaration() -> ModuleType:
    module = ModuleType("_torch_range")
    source = ROOT / "src" / "gradsync" / "_support" / "torch_range.py"
    exec(compile(source.read_text(), str(source), "exec"), module.__dict__)
    return module


def pyproject_text(declared: ModuleType) -> str:
    text = PYPROJECT.read_text()
    if len(REQUIREMENT.findall(text)) != 1:
        raise SystemExit('pyproject.toml: expected exactly one "torch>=X.Y" requirement')
    return REQUIREMENT.sub(f'"torch>={declared.OLDEST}"', text)


def main(argv: list[str]) -> int:
    declared = declaration()
    if not argv:
        print(declared.supported())
    elif argv == ["--pins"]:
        print(declared.OLDEST_PIN, declared.NEWEST_PIN)
    elif argv == ["--floors"]:
        print("\n".join(floors()))
    elif argv == ["--write"]:
        PYPROJECT.write_text(pyproject_text(declared))
    elif argv == ["--check"]:
        if pyproject_text(declared) != PYPROJECT.read_text():
            print(
                f"pyproject.toml does not require torch>={declared.OLDEST} as "
                "src/gradsync/_support/torch_range.py declares: python scripts/torch_range.py --write"
            )
            return 1
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
