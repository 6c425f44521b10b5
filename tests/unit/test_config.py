"""Config, BatchPlan and registry: every invalid setting names the setting, the value and the fix."""

from __future__ import annotations

import sys

import pytest

from gradsync import BatchPlan, ConfigError
from gradsync.backends import available, check_name, resolve_auto
from gradsync.config import from_env, load_config, to_env


@pytest.mark.parametrize("value", [0, -3, 2.5, "four", True])
def test_accumulation_steps_must_be_a_positive_integer(value, clean_env):
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=.*(integer|>= 1)"):
        load_config(gradient_accumulation_steps=value)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_env_is_read_and_keywords_win(clean_env):
    clean_env.setenv("GRADSYNC_BACKEND", "ddp")
    clean_env.setenv("GRADSYNC_GRADIENT_ACCUMULATION_STEPS", "4")
    clean_env.setenv("GRADSYNC_AUDIT", "1")
    cfg = load_config()
    assert (cfg.backend, cfg.gradient_accumulation_steps, cfg.audit) == ("ddp", 4, True)
    assert load_config(gradient_accumulation_steps=2).gradient_accumulation_steps == 2


def test_env_errors_name_the_variable(clean_env):
    clean_env.setenv("GRADSYNC_GRADIENT_ACCUMULATION_STEPS", "many")
    with pytest.raises(ConfigError, match="GRADSYNC_GRADIENT_ACCUMULATION_STEPS='many'"):
        load_config()
    clean_env.setenv("GRADSYNC_GRADIENT_ACCUMULATION_STEPS", "0")
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=0 must be >= 1"):
        load_config()


def test_yaml_then_env_then_keywords(tmp_path, clean_env):
    path = tmp_path / "g.yaml"
    path.write_text("backend: single\ngradient_accumulation_steps: 8\nseed: 3\n")
    clean_env.setenv("GRADSYNC_GRADIENT_ACCUMULATION_STEPS", "4")
    cfg = load_config(config_file=path, seed=5)
    assert (cfg.backend, cfg.gradient_accumulation_steps, cfg.seed) == ("single", 4, 5)


def test_yaml_unknown_key_and_missing_file(tmp_path, clean_env):
    path = tmp_path / "g.yaml"
    path.write_text("gradient_acumulation_steps: 8\n")
    with pytest.raises(ConfigError, match="unknown key.*gradient_acumulation_steps"):
        load_config(config_file=path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(config_file=tmp_path / "missing.yaml")


def test_unknown_policy_and_keyword(clean_env):
    with pytest.raises(ConfigError, match="sync_policy='sometimes' is unknown; use one of auto"):
        load_config(sync_policy="sometimes")
    with pytest.raises(ConfigError, match="unknown setting"):
        load_config(gradient_accumulation=4)


def test_env_round_trip(clean_env):
    cfg = load_config(backend="ddp", gradient_accumulation_steps=4, audit=True, seed=1)
    assert from_env(to_env(cfg)) == {
        "backend": "ddp",
        "gradient_accumulation_steps": 4,
        "audit": True,
        "seed": 1,
    }


def test_unknown_backend_lists_the_available_ones():
    with pytest.raises(ConfigError) as err:
        check_name("horovod")
    assert "backend='horovod' is unknown; available: auto, " + ", ".join(available()) in str(
        err.value
    )


def test_auto_backend():
    assert resolve_auto("auto", 1) == "single"
    assert resolve_auto("auto", 2) == "ddp"
    assert resolve_auto("FSDP", 2) == "fsdp"


def test_batch_plan_derives_the_third_size():
    assert (
        BatchPlan.solve(
            data_parallel_size=2, global_batch_size=64, micro_batch_size=4
        ).gradient_accumulation_steps
        == 8
    )
    assert (
        BatchPlan.solve(
            data_parallel_size=2, global_batch_size=64, gradient_accumulation_steps=8
        ).micro_batch_size
        == 4
    )
    plan = BatchPlan.solve(data_parallel_size=4, micro_batch_size=2, gradient_accumulation_steps=3)
    assert plan.global_batch_size == 24


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"global_batch_size": 60, "micro_batch_size": 4},
            "global_batch_size=60 is not divisible by micro_batch_size x world size = 4 x 2 = 8",
        ),
        (
            {"global_batch_size": 30, "gradient_accumulation_steps": 4},
            "not divisible by gradient_accumulation_steps x world size = 4 x 2 = 8",
        ),
        (
            {"global_batch_size": 64, "micro_batch_size": 4, "gradient_accumulation_steps": 4},
            "gradient_accumulation_steps=4 contradicts",
        ),
        ({"global_batch_size": 64}, "needs micro_batch_size or gradient_accumulation_steps"),
        ({"micro_batch_size": 0}, "micro_batch_size=0 must be >= 1"),
    ],
)
def test_batch_plan_errors(kwargs, message):
    with pytest.raises(ConfigError) as err:
        BatchPlan.solve(data_parallel_size=2, **kwargs)
    assert message in str(err.value)


def test_keyword_overriding_the_launcher_is_reported(clean_env, caplog):
    clean_env.setenv("GRADSYNC_GRADIENT_ACCUMULATION_STEPS", "8")
    with caplog.at_level("WARNING", logger="gradsync"):
        cfg = load_config(gradient_accumulation_steps=4)
    assert cfg.gradient_accumulation_steps == 4
    assert (
        "gradient_accumulation_steps=4 given in code overrides GRADSYNC_GRADIENT_ACCUMULATION_STEPS=8"
        in caplog.text
    )


@pytest.mark.parametrize(
    "text, where",
    [
        ("a: [1, 2\n", "at line 2, column 1"),
        ("backend: ddp\n  seed: 3\n", "at line 2, column 7"),
    ],
)
def test_malformed_yaml_is_one_line_naming_the_file_and_the_problem(
    tmp_path, clean_env, text, where
):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(config_file=path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"config file {str(path)!r} is not valid YAML: ")
    assert where in message and message.endswith("; fix the syntax there")


def test_malformed_json_without_pyyaml_names_the_file_and_the_problem(
    tmp_path, clean_env, monkeypatch
):
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` raises ImportError
    path = tmp_path / "bad.json"
    path.write_text('{"backend": "ddp",}')
    with pytest.raises(ConfigError) as err:
        load_config(config_file=path)
    assert str(err.value).startswith(f"config file {str(path)!r} is not valid JSON: ")
    assert "at line 1, column 19" in str(err.value)
    path.write_text('{"backend": "ddp"}')
    assert load_config(config_file=path).backend == "ddp"


def test_a_directory_as_the_config_file_is_named_as_such(tmp_path, clean_env):
    with pytest.raises(ConfigError, match="is a directory; pass the path of a YAML file"):
        load_config(config_file=tmp_path)


def test_sync_memory_budget_and_its_old_name(clean_env):
    assert load_config(sync_memory_budget=5).memory_budget() == (5, "sync_memory_budget")
    assert load_config(fsdp_memory_budget=7).memory_budget() == (7, "fsdp_memory_budget")
    assert load_config().memory_budget() == (None, "sync_memory_budget")
    clean_env.setenv("GRADSYNC_SYNC_MEMORY_BUDGET", "1024")
    assert load_config().memory_budget() == (1024, "sync_memory_budget")
    with pytest.raises(
        ConfigError,
        match=r"fsdp_memory_budget=3 contradicts sync_memory_budget=1024.*set only sync_memory_budget",
    ):
        load_config(fsdp_memory_budget=3)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("sync_memory_budget", -1),
        ("sync_memory_budget", "lots"),
        ("fsdp_memory_budget", True),
        ("sync_memory_budget", 1.5),
    ],
)
def test_a_budget_must_be_bytes(clean_env, key, value):
    with pytest.raises(ConfigError, match=rf"{key}={value!r} must be a number of bytes >= 0"):
        load_config(**{key: value})


def test_keep_params_option_and_its_deprecated_predecessor(clean_env):
    assert load_config(fsdp_keep_params_in_window=True).fsdp_keep_params_in_window is True
    with pytest.raises(
        ConfigError, match=r"fsdp_keep_params_in_window='yes' must be True, False or None"
    ):
        load_config(fsdp_keep_params_in_window="yes")
    with pytest.warns(
        DeprecationWarning,
        match="fsdp_reshard_after_backward is deprecated; use fsdp_keep_params_in_window",
    ):
        load_config(fsdp_reshard_after_backward=False)
    with pytest.raises(
        ConfigError,
        match=r"fsdp_reshard_after_backward=True contradicts fsdp_keep_params_in_window=True",
    ):
        load_config(fsdp_reshard_after_backward=True, fsdp_keep_params_in_window=True)
    clean_env.setenv("GRADSYNC_FSDP_KEEP_PARAMS_IN_WINDOW", "0")
    assert load_config().fsdp_keep_params_in_window is False


@pytest.mark.parametrize(
    "key, suggestion",
    [
        ("gradient_accumulation", "gradient_accumulation_steps"),
        ("gradient_acumulation_steps", "gradient_accumulation_steps"),
        ("sync_polcy", "sync_policy"),
        ("find_unused_params", "find_unused_parameters"),
    ],
)
def test_unknown_keyword_suggests_the_closest_setting(clean_env, key, suggestion):
    with pytest.raises(ConfigError) as err:
        load_config(**{key: 4})
    assert f"unknown setting(s) {key}=4 (did you mean {suggestion}?)" in str(err.value)


def test_unknown_yaml_key_suggests_the_closest_setting(tmp_path, clean_env):
    path = tmp_path / "g.yaml"
    path.write_text("gradient_acumulation_steps: 8\nseed: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(config_file=path)
    assert "gradient_acumulation_steps=8 (did you mean gradient_accumulation_steps?)" in str(
        err.value
    )


def test_nothing_close_gets_no_suggestion(clean_env):
    with pytest.raises(ConfigError) as err:
        load_config(zzz=1)
    assert "did you mean" not in str(err.value)


def test_a_misspelt_variable_draws_a_warning(clean_env, caplog):
    clean_env.setenv("GRADSYNC_GRADIENT_ACUMULATION_STEPS", "4")
    clean_env.setenv("GRADSYNC_SELFCHECK", "0")
    clean_env.setenv("GRADSYNC_DEVICE", "cpu")  # not a setting, but gradsync's own: no warning
    clean_env.setenv("GRADSYNC_SOMETHING_ELSE", "1")  # close to nothing: no warning
    with caplog.at_level("WARNING", logger="gradsync"):
        cfg = load_config()
    assert cfg.gradient_accumulation_steps is None
    assert (
        "GRADSYNC_GRADIENT_ACUMULATION_STEPS='4' is not a gradsync setting and is ignored "
        "(did you mean GRADSYNC_GRADIENT_ACCUMULATION_STEPS?)"
    ) in caplog.text
    assert "(did you mean GRADSYNC_SELF_CHECK?)" in caplog.text
    assert "GRADSYNC_DEVICE" not in caplog.text and "SOMETHING_ELSE" not in caplog.text


def test_new_switches_from_env_and_validation(clean_env):
    clean_env.setenv("GRADSYNC_SELF_CHECK", "0")
    clean_env.setenv("GRADSYNC_FIND_UNUSED_PARAMETERS", "1")
    clean_env.setenv("GRADSYNC_DATASET_SHARDS_ITSELF", "yes")
    cfg = load_config()
    assert (cfg.self_check, cfg.find_unused_parameters, cfg.dataset_shards_itself) == (
        False,
        True,
        True,
    )
    with pytest.raises(ConfigError, match="self_check='no' must be True or False"):
        load_config(self_check="no")


def test_find_unused_contradicting_ddp_kwargs(clean_env):
    from gradsync.backends.ddp import DDPBackend

    cfg = load_config(find_unused_parameters=True, ddp_kwargs={"find_unused_parameters": False})
    with pytest.raises(ConfigError, match="find_unused_parameters=True contradicts ddp_kwargs"):
        DDPBackend().setup(cfg)


def test_deepspeed_batch_contradiction_is_reported_when_the_accelerator_is_built(clean_env):
    pytest.importorskip("deepspeed")
    from gradsync import Accelerator

    # no process group and no launcher variables: the check comes before either is needed
    with pytest.raises(ConfigError) as err:
        Accelerator(
            backend="deepspeed",
            gradient_accumulation_steps=4,
            deepspeed_config={"gradient_accumulation_steps": 8},
        )
    assert (
        "deepspeed_config gradient_accumulation_steps=8 contradicts gradsync's gradient_accumulation_steps=4"
        in str(err.value)
    )
    with pytest.raises(
        ConfigError,
        match="train_micro_batch_size_per_gpu=4 contradicts gradsync's train_micro_batch_size_per_gpu=2",
    ):
        Accelerator(
            backend="deepspeed",
            micro_batch_size=2,
            gradient_accumulation_steps=2,
            deepspeed_config={"train_micro_batch_size_per_gpu": 4},
        )


@pytest.mark.parametrize(
    "key, text, value",
    [
        ("GRADSYNC_TIMEOUT", "600", 600.0),
        ("GRADSYNC_ACTIVATION_CHECKPOINTING", "Block, Attention", ["Block", "Attention"]),
        ("GRADSYNC_COMPILE", "yes", True),
        ("GRADSYNC_COMPILE", '{"mode": "max-autotune"}', {"mode": "max-autotune"}),
        ("GRADSYNC_GRAD_SCALER", '{"init_scale": 1024}', {"init_scale": 1024}),
        ("GRADSYNC_DEEPSPEED_CONFIG", "ds.json", "ds.json"),
        ("GRADSYNC_GRADIENT_ACCUMULATION_STEPS", " 0:2 100:4 ", "0:2 100:4"),
        ("GRADSYNC_FSDP_KEEP_PARAMS_IN_WINDOW", "off", False),
    ],
)
def test_variables_are_read_by_the_settings_type(clean_env, key, text, value):
    name = key[len("GRADSYNC_") :].lower()
    assert from_env({key: text}) == {name: value}


@pytest.mark.parametrize(
    "key, text, message",
    [
        (
            "GRADSYNC_TIMEOUT",
            "soon",
            "GRADSYNC_TIMEOUT='soon' is not a number; set it to the seconds to wait, e.g. 600",
        ),
        ("GRADSYNC_SEED", "x", "GRADSYNC_SEED='x' is not an integer; set it to a whole number"),
        (
            "GRADSYNC_MICRO_BATCH_SIZE",
            "x",
            "GRADSYNC_MICRO_BATCH_SIZE='x' is not an integer; set it to a whole number >= 1",
        ),
        ("GRADSYNC_AUDIT", "maybe", "GRADSYNC_AUDIT='maybe' is not a boolean; set it to 1 or 0"),
        (
            "GRADSYNC_DDP_KWARGS",
            "{x",
            "GRADSYNC_DDP_KWARGS='{x' is not JSON; set it to a JSON object",
        ),
    ],
)
def test_a_variable_of_the_wrong_type_is_named(clean_env, key, text, message):
    with pytest.raises(ConfigError) as err:
        from_env({key: text})
    assert str(err.value).startswith(message)


def test_a_path_for_save_on_sigterm_is_kept_as_text(tmp_path, clean_env):
    assert load_config(save_on_sigterm=tmp_path).save_on_sigterm == str(tmp_path)
