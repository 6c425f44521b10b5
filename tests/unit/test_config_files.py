"""The one reader of config files and the one loader of DeepSpeed configs
(``gradsync.compat.files``): every bad file is one ConfigError line naming the file, what is
wrong and the fix, wherever the file comes from (the backend's ``deepspeed_config``, an
Accelerate file's ``deepspeed_config_file``, gradsync's config file). And the translation's
tables: each key of fsdp_config and deepspeed_config is in one, and the package imports
no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gradsync.accelerate import _compat as accelerate
from gradsync.accelerate._compat import deepspeed, fsdp
from gradsync.backends._deepspeed_config import load_ds_config
from gradsync.compat.files import load_deepspeed_config, read_yaml
from gradsync.config import load_config
from gradsync.errors import ConfigError


def one_line(call, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        call(*args, **kwargs)
    text = str(err.value)
    assert "\n" not in text, text
    return text


BAD_FILES = [
    (
        "ds.json",
        '{"zero_optimization": {"stage": 2},}',
        "is not valid JSON: Expecting property name enclosed in double quotes at line 1, column 36; "
        "fix the syntax there",
    ),
    ("ds.yaml", "zero_optimization:\n  stage: 2\n offload: x\n", "is not valid YAML: "),
    ("ds.json", "[1, 2]", "must hold a mapping of DeepSpeed settings, not list; write it as one"),
    ("ds.yaml", "- stage: 2\n", "must hold a mapping of DeepSpeed settings, not list"),
    ("ds.yaml", "", "must hold a mapping of DeepSpeed settings, not NoneType"),
]


@pytest.mark.parametrize("name, text, problem", BAD_FILES)
def test_a_bad_deepspeed_config_file_is_one_line(tmp_path, name, text, problem):
    path = tmp_path / name
    path.write_text(text)
    message = one_line(load_ds_config, str(path))
    assert message.startswith(f"deepspeed_config={str(path)!r} {problem}"), message
    if name.endswith(".yaml") and "YAML" in problem:
        assert "at line 3, column" in message and message.endswith("; fix the syntax there")


def test_bad_deepspeed_json_text_and_other_values_are_one_line():
    assert one_line(load_ds_config, '{"zero_optimization": ').startswith(
        "deepspeed_config='{\"zero_optimization\": ' is not valid JSON: "
    )
    assert "must hold a mapping of DeepSpeed settings, not list" in one_line(load_ds_config, "[1]")
    assert (
        one_line(load_ds_config, 3)
        == "deepspeed_config=3 must be a dict, a JSON/YAML path or JSON text"
    )


def test_a_directory_is_neither_a_file_nor_json(tmp_path):
    assert "is neither an existing file nor JSON text" in one_line(load_ds_config, str(tmp_path))


def test_the_loader_copies_and_names_the_value_as_told(tmp_path):
    given = {"zero_optimization": {"stage": 2}}
    loaded = load_deepspeed_config(given)
    assert (
        loaded == given
        and loaded is not given
        and loaded["zero_optimization"] is not given["zero_optimization"]
    )
    assert load_deepspeed_config(None) == {}
    (tmp_path / "ds.json").write_text("[]")
    assert one_line(
        load_deepspeed_config, str(tmp_path / "ds.json"), "--deepspeed_config_file=ds.json"
    ).startswith("--deepspeed_config_file=ds.json must hold a mapping")


@pytest.mark.parametrize("name, text, problem", BAD_FILES[:3])
def test_an_accelerate_files_deepspeed_config_file_is_read_by_the_same_loader(
    tmp_path, monkeypatch, name, text, problem
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(text)
    (tmp_path / "acc.yaml").write_text(
        f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {name}\n  zero_stage: 2\n"
    )
    message = one_line(load_config, config_file="acc.yaml", environ={})
    assert message.startswith(
        f"deepspeed_config.deepspeed_config_file='{name}' in 'acc.yaml' {problem}"
    ), message


def test_a_config_file_is_read_by_its_suffix(tmp_path):
    (tmp_path / "g.json").write_text('{"seed": 1,}')
    assert one_line(read_yaml, tmp_path / "g.json").startswith(
        f"config file {str(tmp_path / 'g.json')!r} is not valid JSON: "
    )
    (tmp_path / "g.yaml").write_text("- 1\n")
    assert one_line(read_yaml, tmp_path / "g.yaml").endswith(
        "must hold a mapping of settings, not list"
    )
    (tmp_path / "g.yaml").write_text("")
    assert read_yaml(tmp_path / "g.yaml") == {}


def test_every_key_accelerate_writes_in_a_section_is_in_its_table():
    """The flags of a section name keys of its table (and each table key once)."""
    for table, section in ((fsdp.KEYS, "fsdp_config"), (deepspeed.KEYS, "deepspeed_config")):
        names = [key.name for key in table]
        assert len(names) == len(set(names)), section
        for flag in accelerate.FLAGS:
            if flag.section == section:
                assert flag.key in names, (section, flag.key)


def test_a_top_level_dynamo_backend_does_not_choose_the_backend():
    """Accelerate's older top-level ``dynamo_backend`` is read as dynamo_config's."""
    t = accelerate.translate(
        {
            "distributed_type": "FSDP",
            "dynamo_backend": "NO",
            "fsdp_config": {"fsdp_version": 2, "fsdp_transformer_layer_cls_to_wrap": "Block"},
        }
    )
    assert t.settings == {"backend": "fsdp", "fsdp_wrap": ["Block"]} and t.notes == []
    t = accelerate.translate({"distributed_type": "MULTI_GPU", "dynamo_backend": "inductor"})
    assert t.settings == {"backend": "ddp", "compile": {"backend": "inductor"}}


def test_the_translation_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import gradsync.accelerate._compat, gradsync.compat.files, gradsync.config\n"
        "assert 'torch' not in sys.modules or sys.modules['torch'] is None\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
