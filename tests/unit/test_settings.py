"""Drift: every declared setting (gradsync.settings.SETTINGS) appears with the same name, type
and default in Config, the GRADSYNC_* variables, YAML, the launcher's flags and LaunchConfig,
the reference table and Accelerator.__init__. No process group here."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest

from gradsync._declaration import Setting, to_text
from gradsync.cli import build_parser, launch_config
from gradsync.config import Config, env_vars, from_env, from_yaml, load_config
from gradsync.launch import LaunchConfig, Launcher
from gradsync.settings import CORE_SETTINGS, LAUNCH_SETTINGS, SETTINGS, reference_markdown

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "report_rank.py")
NONE = type(None)
# Values a setting's type allows but its check refuses are replaced here (a backend must exist).
VALID = {
    "backend": "ddp",
    "log_with": ["tensorboard", "csv"],
    "fsdp_mesh": "node",
    "parallelism": {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "cp": 1},
    "tp_plan": "auto",
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


def test_launch_config_lists_every_flagged_setting_with_its_type():
    hints = typing.get_type_hints(LaunchConfig)
    fields = {f.name: f for f in dataclasses.fields(LaunchConfig)}
    for s in LAUNCH_SETTINGS:
        assert s.name in fields, f"LaunchConfig has no field {s.name} for {s.flag}"
        if s.switch:
            assert hints[s.name] is bool and fields[s.name].default is False, (
                f"LaunchConfig.{s.name}: bool = False"
            )
        else:
            assert norm(hints[s.name]) == norm(s.type) | {NONE}, (
                f"LaunchConfig.{s.name}: {hints[s.name]}, declared {optional(s)}"
            )
            assert fields[s.name].default is None, (
                f"LaunchConfig.{s.name} must default to None (not given)"
            )
    declared = {s.name for s in SETTINGS}
    extra = sorted(set(fields) & declared - {s.name for s in LAUNCH_SETTINGS})
    assert not extra, f"LaunchConfig has settings without a flag: {extra}"


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


def test_accelerator_signature_and_docstring_list_every_core_setting():
    from gradsync import settings
    from gradsync.accelerator import Accelerator

    parameters = inspect.signature(Accelerator.__init__).parameters
    hints = typing.get_type_hints(Accelerator.__init__, localns=vars(settings))
    keywords = {n for n, p in parameters.items() if p.kind is p.KEYWORD_ONLY}
    core = {s.name for s in CORE_SETTINGS}
    assert not core - keywords, (
        f"Accelerator.__init__ lacks the core settings {sorted(core - keywords)}"
    )
    assert keywords - core == {"config_file"}, (
        f"Accelerator.__init__ has keywords that are no core setting: {sorted(keywords - core - {'config_file'})}"
    )
    assert any(p.kind is p.VAR_KEYWORD for p in parameters.values()), (
        "the backend options need **options"
    )
    for s in CORE_SETTINGS:
        assert parameters[s.name].default is None, (
            f"Accelerator(..., {s.name}=) must default to None (not given)"
        )
        assert norm(hints[s.name]) == norm(s.type) | {NONE}, (
            f"Accelerator(..., {s.name}: {hints[s.name]}) differs from the declared {optional(s)}"
        )
    doc = inspect.getdoc(Accelerator) or ""
    args = doc.split("Args:", 1)[1]
    named = set(re.findall(r"^    (\w+):", args, flags=re.M))
    assert not core - named, f"Accelerator's docstring Args lacks {sorted(core - named)}"
    options = args.split("**options:", 1)[1]
    for s in SETTINGS:
        if s.backend is not None:
            assert f"``{s.name}``" in options, (
                f"Accelerator's docstring does not name the {s.backend} option {s.name} under **options"
            )
