"""Every declared setting (gradsync.settings.SETTINGS) appears with the same name, type and
default in Config, the GRADSYNC_* variables, YAML, the launcher's flags and the reference
table; the signatures that take settings as keywords are written from the declarations
(scripts/gen_signatures.py). No process group here."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import re
import subprocess
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest

from gradsync._support.declaration import Setting, to_text
from gradsync.cli import build_parser, launch_config
from gradsync.config import Config, env_vars, from_env, from_yaml, load_config
from gradsync.launch import LaunchConfig, Launcher
from gradsync.settings import CORE_SETTINGS, LAUNCH_SETTINGS, SETTINGS, reference_markdown

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "report_rank.py")
GENERATOR = Path(__file__).resolve().parents[2] / "scripts" / "gen_signatures.py"
NONE = type(None)
# Values a setting's type allows but its check refuses are replaced here (a backend must exist).
VALID = {
    "backend": "ddp",
    "log_with": ["tensorboard", "csv"],
    "fsdp_mesh": "node",
    "parallelism": {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "cp": 1},
    "tp_plan": "auto",
    "pp_schedule": "GPipe",
    "comm_state_option": {"matrix_approximation_rank": 2},
}


def ids(settings: tuple[Setting, ...]) -> list[str]:
    return [s.name for s in settings]


def norm(tp: Any) -> frozenset[Any]:
    """A type as a set of comparable members: unions flattened, Literal values unordered,
    typing.X and collections.abc.X alike."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        return frozenset().union(*(norm(a) for a in get_args(tp)))
    if get_origin(tp) is Literal:
        return frozenset(("Literal", a) for a in get_args(tp))
    if get_origin(tp) is not None:
        args = tuple(
            tuple(norm(x) for x in a) if isinstance(a, list) else norm(a) for a in get_args(tp)
        )
        return frozenset({(get_origin(tp), args)})
    return frozenset({tp})


def optional(s: Setting) -> str:
    """The declared type with None, as the docs write it."""
    return s.type_text if s.optional else s.type_text + " | None"


def sample(s: Setting) -> Any:
    """A value of the setting's type other than its default, that reads back from its text."""
    if s.name in VALID:
        return VALID[s.name]
    members = s.members
    if s.parse is not None and int in members:
        return 3
    if bool in members:
        return s.default is not True
    if s.choices is not None:
        return next(c for c in s.choices if c != s.default)
    if any(get_origin(m) in (list, tuple, Sequence) for m in members):
        return ["Linear", "Block"]
    if str in members:
        return "some/folder"
    if int in members:
        return (s.minimum or 0) + 3
    if float in members:
        return 2.5
    return {"init_scale": 1024}


def test_every_setting_is_a_config_field_with_its_type_and_default():
    hints = typing.get_type_hints(Config)
    fields = {f.name: f for f in dataclasses.fields(Config)}
    assert [s.name for s in SETTINGS] == list(fields), "Config's fields and the declarations differ"
    defaults = Config()
    for s in SETTINGS:
        assert norm(hints[s.name]) == norm(s.field_type), (
            f"{s.name}: Config holds {hints[s.name]}, declared {s.field_type}"
        )
        assert norm(s.field_type) <= norm(s.type), (
            f"{s.name}: Config holds more than the setting takes"
        )
        assert getattr(defaults, s.name) == s.default, (
            f"{s.name}: Config's default differs from the declaration"
        )
        assert s.env == "GRADSYNC_" + s.name.upper() and s.yaml_key == s.name, s.name
        assert s.doc and "\n" not in s.doc, f"{s.name}: the doc must be one line"
    assert Config().validate() == Config(), "a default does not pass its own check"
    for attribute in ("env", "yaml_key", "flag"):
        values = [getattr(s, attribute) for s in SETTINGS if getattr(s, attribute)]
        assert len(values) == len(set(values)), f"two settings share a {attribute}"


@pytest.mark.parametrize("s", SETTINGS, ids=ids(SETTINGS))
def test_every_setting_round_trips_through_its_variable(s, clean_env):
    value = sample(s)
    env = env_vars({s.name: value})
    assert list(env) == [s.env], f"{s.name}: env_vars wrote {list(env)}"
    assert from_env(env) == {s.name: value}, (
        f"{s.name}: {s.env}={env[s.env]!r} does not read back as {value!r}"
    )


def test_a_yaml_file_with_every_key_loads(tmp_path, clean_env):
    values = {s.yaml_key: sample(s) for s in SETTINGS}
    path = tmp_path / "all.yaml"
    path.write_text(json.dumps(values))  # JSON is YAML
    loaded = from_yaml(path)
    for s in SETTINGS:
        assert loaded.get(s.name) == values[s.yaml_key], (
            f"{s.name}: YAML key {s.yaml_key!r} did not load"
        )
    path.write_text("".join(f"{s.yaml_key}: {json.dumps(s.default)}\n" for s in SETTINGS))
    assert load_config(config_file=path) == Config(), (
        "a YAML file of every default is not the default Config"
    )


@pytest.mark.parametrize("s", LAUNCH_SETTINGS, ids=ids(LAUNCH_SETTINGS))
def test_every_flag_reaches_launch_config_and_the_workers(s, clean_env):
    value = sample(s)
    assert s.flag is not None
    spellings = {s.flag, "--" + s.flag[2:].replace("-", "_")}
    # settings that need another one given with them (a backend option: its backend)
    companions = {
        "global_batch_size": ["--micro-batch-size", "1"],
        "fsdp_mesh": ["--backend", "fsdp"],
        "comm_wrapper": ["--comm-hook", "power_sgd"],
        "comm_state_option": ["--comm-hook", "power_sgd"],
        "parallelism": ["--backend", "fsdp", "--nproc-per-node", "4"],
    }.get(s.name, [])
    for spelling in sorted(spellings):
        words = [spelling] if s.switch else [spelling, to_text(value)]
        args = build_parser().parse_args(["launch", *companions, *words, SCRIPT])
        config = launch_config(args)
        assert getattr(config, s.name) == value, (
            f"{spelling}: LaunchConfig.{s.name} is {getattr(config, s.name)!r}"
        )
        launcher = Launcher(config)
        worker = load_config(environ=launcher.worker_env())
        if s.name == "global_batch_size":  # the workers get it as micro batch x accumulation steps
            assert launcher.plan.global_batch_size == value
        else:
            assert getattr(worker, s.name) == value, (
                f"{spelling}: the workers see {s.name}={getattr(worker, s.name)!r}"
            )


def test_every_setting_is_a_row_of_the_reference():
    rows = {}
    for line in reference_markdown().splitlines():
        match = re.match(r"\| `(\w+)` \|", line)
        if match:
            rows[match.group(1)] = line
    assert list(rows) == [s.name for s in SETTINGS], (
        "the reference's rows differ from the declarations"
    )
    for s in SETTINGS:
        row = rows[s.name]
        for part in (s.type_text, repr(s.default), s.env, s.flag or "—", s.backend or "all"):
            assert part in row, f"{s.name}: the reference row lacks {part!r}"


def _generator():
    """scripts/gen_signatures.py, loaded as a module."""
    spec = importlib.util.spec_from_file_location("gen_signatures", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_signatures_are_written_from_the_declarations():
    """The Accelerators' setting keywords, the docstring's setting entries and LaunchConfig's
    setting fields are written by ``python scripts/gen_signatures.py --write``; its check
    fails while a file differs from what it writes."""
    done = subprocess.run(
        [sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_written_types_are_the_declared_ones():
    from gradsync import settings

    generator = _generator()
    for s in (*CORE_SETTINGS, *LAUNCH_SETTINGS):
        text = generator.keyword_type(s)
        written = eval(text, dict(vars(settings)))
        assert norm(written) == norm(s.type) | {NONE}, (
            f"{s.name}: written {text}, declared {optional(s)}"
        )


def test_every_setting_keyword_shows_in_the_signatures():
    """What the reference and ``help()`` show: every core setting a keyword of both
    Accelerators (None: not given), every flagged setting a field of LaunchConfig."""
    from gradsync.accelerate import Accelerator as AccelerateAccelerator
    from gradsync.accelerator import Accelerator

    core = [s.name for s in CORE_SETTINGS]
    parameters = inspect.signature(Accelerator).parameters
    keywords = [n for n, p in parameters.items() if p.kind is p.KEYWORD_ONLY]
    assert keywords == [*core, "config_file"]
    assert all(parameters[n].default is None for n in core)
    assert set(core) <= set(inspect.signature(AccelerateAccelerator).parameters)
    fields = {f.name: f.default for f in dataclasses.fields(LaunchConfig)}
    for s in LAUNCH_SETTINGS:
        assert fields[s.name] is (False if s.switch else None), s.name
    doc = (inspect.getdoc(Accelerator) or "").split("Args:", 1)[1]
    assert set(core) <= set(re.findall(r"^    (\w+):", doc, flags=re.M))
