"""The N-D mesh and tensor parallelism, the parts that need no process group: the
``parallelism`` forms (mapping, text, JSON, Accelerate's ParallelismConfig and config-file
keys), the -1 and the world, every bad-input line, the plan's patterns and styles, and the
divisibility checks against a Linear's features and a Transformers config's heads."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from gradsync import Accelerator, ConfigError, mesh
from gradsync.backends import _tensor_parallel
from gradsync.backends.fsdp import FSDPBackend
from gradsync.cli import build_parser, launch_config
from gradsync.config import Config, from_env, load_config


def _error(**settings) -> str:
    with pytest.raises(ConfigError) as info:
        Config(**settings).validate()
    message = str(info.value)
    assert "\n" not in message
    return message


# -- the forms -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value",
    [
        {"dp_shard": 2, "tp": 2},
        "dp_shard=2,tp=2",
        "dp_shard:2, tp:2",
        '{"dp_shard": 2, "tp": 2}',
        {"dp_shard": "2", "tp": 2, "dp_replicate": None},
    ],
)
def test_parallelism_forms(value):
    assert mesh.parse(value) == mesh.Parallelism(dp_shard=2, tp=2)


@dataclass
class ParallelismConfig:
    """Accelerate's ParallelismConfig as far as gradsync reads it (its size attributes)."""

    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    tp_size: int = 1
    cp_size: int = 1


def test_accelerates_parallelism_config_and_its_file_keys():
    assert mesh.parse(
        ParallelismConfig(dp_replicate_size=2, dp_shard_size=-1, tp_size=2)
    ) == mesh.Parallelism(2, -1, 2)
    keys = {
        "parallelism_config_dp_shard_size": 2,
        "parallelism_config_tp_size": 2,
        "parallelism_config_cp_comm_strategy": "allgather",
    }
    assert mesh.parse(keys) == mesh.Parallelism(dp_shard=2, tp=2)


@pytest.mark.parametrize(
    "value, world, expected",
    [
        ({"dp_shard": -1, "tp": 2}, 8, (1, 4, 2)),
        ({"dp_replicate": 2, "dp_shard": -1, "tp": 2}, 8, (2, 2, 2)),
        ({"dp_replicate": 2, "tp": -1}, 4, (2, 1, 2)),
        ({"dp_shard": 4}, 4, (1, 4, 1)),
    ],
)
def test_the_minus_one_is_inferred_from_the_world(value, world, expected):
    dims = mesh.parse(value).resolve(world)
    assert dims.shape == expected and dims.data_parallel == expected[0] * expected[1]
    assert mesh.data_parallel_size(value, world) == expected[0] * expected[1]
    assert mesh.data_parallel_size(None, world) == world


def test_the_text_form_reads_back():
    dims = mesh.Parallelism(2, 2, 2)
    assert dims.text() == "dp_replicate=2,dp_shard=2,tp=2" and mesh.parse(dims.text()) == dims


def test_the_setting_keeps_every_dim_and_reads_from_the_environment_and_the_launcher():
    config = Config(backend="fsdp", parallelism="dp_shard=2,tp=2").validate()
    assert config.parallelism == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "cp": 1}
    env = from_env({"GRADSYNC_PARALLELISM": "dp_shard=-1,tp=2"})
    assert env["parallelism"] == {"dp_replicate": 1, "dp_shard": -1, "tp": 2, "cp": 1}
    args = build_parser().parse_args(
        ["launch", "--backend", "fsdp", "--parallelism", "tp=2,dp_shard=2", "x.py"]
    )
    assert launch_config(args).parallelism == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "cp": 1}


def test_a_yaml_file_sets_parallelism_and_the_plan(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("backend: fsdp\nparallelism: {dp_shard: 2, tp: 2}\ntp_plan: auto\n")
    config = load_config(config_file=path)
    assert config.parallelism["tp"] == 2 and config.tp_plan == "auto"


# -- bad input: one line each, before any collective ------------------------------------------
@pytest.mark.parametrize(
    "value, words",
    [
        ({"dp_shard": 2, "sp": 2}, "'sp', which is no dim"),
        ({"dp_shard": 0}, "must be positive"),
        ({"dp_shard": -1, "tp": -1}, "more than one -1"),
        ("dp_shard2", "is not dim=size"),
        ("{not json", "is not JSON"),
        ({"tp": 1.5}, "is not a whole number"),
        (3, "is not a parallelism"),
    ],
)
def test_bad_forms(value, words):
    assert words in _error(backend="fsdp", parallelism=value)


def test_a_product_that_is_not_the_world():
    with pytest.raises(
        ConfigError, match=r"holds 2 x 2 x 2 x 1 = 8 processes, but the world has 4"
    ):
        mesh.parse({"dp_replicate": 2, "dp_shard": 2, "tp": 2}).resolve(4)
    with pytest.raises(
        ConfigError, match=r"3 does not divide the world of 4 processes, so dp_shard=-1"
    ):
        mesh.parse({"dp_shard": -1, "tp": 3}).resolve(4)


def test_a_product_that_is_not_the_world_stops_the_accelerator(clean_env):
    with pytest.raises(ConfigError, match="but the world has 1"):
        Accelerator(backend="fsdp", parallelism={"dp_shard": 2, "tp": 2}, tp_plan="auto")


@pytest.mark.parametrize("backend", ["ddp", "deepspeed", "fairscale", "single", "auto"])
def test_tensor_parallel_elsewhere_than_fsdp(backend):
    message = _error(backend=backend, parallelism={"dp_shard": 2, "tp": 2})
    assert "tensor parallelism (tp=2)" in message and "use backend='fsdp'" in message
    assert "runs on FSDP2" in _error(backend=backend, tp_plan="auto")


def test_context_parallel_needs_a_gpu():
    message = _error(backend="fsdp", parallelism={"dp_shard": 2, "cp": 2})
    assert "cp=2" in message and "needs a GPU (CUDA)" in message


@pytest.mark.parametrize(
    "fsdp_mesh, words",
    [
        ((2, 2), "contradicts fsdp_mesh=(2, 2)"),
        ("node", "give one of them"),
    ],
)
def test_parallelism_against_fsdp_mesh(fsdp_mesh, words):
    assert words in _error(
        backend="fsdp", fsdp_mesh=fsdp_mesh, parallelism={"dp_shard": 2, "tp": 2}
    )
    Config(
        backend="fsdp", fsdp_mesh=(1, 2), parallelism={"dp_shard": 2, "tp": 2}
    ).validate()  # agrees


@pytest.mark.parametrize(
    "plan, words",
    [
        ("all", "is not a plan"),
        ({}, "names no module"),
        ({"a": "diagonal"}, "'diagonal' is no style"),
        (7, "is not a plan"),
    ],
)
def test_bad_plans(plan, words):
    assert words in _error(backend="fsdp", parallelism={"tp": 2}, tp_plan=plan)


def _setup_error(monkeypatch, world: int, **settings) -> str:
    """What the fsdp adapter's setup says before it joins a group, on ``world`` ranks."""
    monkeypatch.setattr("gradsync._support.dist.world_size", lambda: world)
    with pytest.raises(ConfigError) as info:
        FSDPBackend()._parallelism(Config(backend="fsdp", **settings).validate())
    assert "\n" not in str(info.value)
    return str(info.value)


def test_setup_refusals(monkeypatch):
    assert "has tp=2 and no tp_plan" in _setup_error(
        monkeypatch, 4, parallelism={"dp_shard": 2, "tp": 2}
    )
    assert "has tp=1; give tp > 1" in _setup_error(
        monkeypatch, 4, parallelism={"dp_shard": 4}, tp_plan="auto"
    )
    assert "no parallelism gives one" in _setup_error(monkeypatch, 4, tp_plan="auto")
    assert "contradicts fsdp_mesh=(-1, 4)" in _setup_error(
        monkeypatch, 8, parallelism={"dp_shard": 2, "tp": 2, "dp_replicate": -1}, fsdp_mesh=(-1, 4)
    )


# -- the plan against the model -----------------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 12)
        self.down = nn.Linear(12, 8)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList([Block(), Block()])


def test_patterns_pick_modules_in_transformers_style():
    chosen = _tensor_parallel.resolve(Net(), {"layers.*.up": "colwise", "layers.*.down": "rowwise"})
    assert chosen == {
        "layers.0.up": "colwise",
        "layers.1.up": "colwise",
        "layers.0.down": "rowwise",
        "layers.1.down": "rowwise",
    }


def test_a_pattern_naming_no_module():
    with pytest.raises(ConfigError) as info:
        _tensor_parallel.resolve(Net(), {"blocks.*.up": "colwise"})
    assert "'blocks.*.up' names no module of the Net; module names look like 'layers.*.up'" in str(
        info.value
    )


@pytest.mark.parametrize(
    "plan, degree, words",
    [
        ({"layers.0.up": "colwise"}, 5, "out_features=12 over tp=5"),
        ({"layers.0.down": "rowwise"}, 5, "in_features=12 over tp=5"),
        ({"embed": "embedding_rowwise"}, 3, "num_embeddings=10 over tp=3"),
        ({"layers.0.up": 3.0}, 2, "is no style"),
    ],
)
def test_a_degree_that_does_not_divide_the_features(plan, degree, words):
    with pytest.raises(ConfigError, match=words):
        _tensor_parallel.check(Net(), plan, degree)
    _tensor_parallel.check(
        Net(), {"layers.0.up": "colwise", "layers.0.down": "rowwise"}, 4
    )  # 12 / 4


def tiny_llama(heads: int = 4, kv_heads: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=24,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )
    return LlamaForCausalLM(config)


def test_auto_reads_a_transformers_models_own_plan():
    model = tiny_llama()
    chosen = _tensor_parallel.resolve(model, "auto")
    assert chosen["model.layers.0.self_attn.q_proj"] == "colwise"
    assert chosen["model.layers.0.self_attn.o_proj"] == "rowwise"
    assert chosen["lm_head"] == "colwise_gather_output"
    _tensor_parallel.check(model, chosen, 2)


def test_a_degree_that_does_not_divide_the_heads():
    model = tiny_llama(heads=6, kv_heads=3)
    with pytest.raises(
        ConfigError, match=r"tp=2 does not divide the model's num_key_value_heads=3"
    ):
        _tensor_parallel.check(model, _tensor_parallel.resolve(model, "auto"), 2)


def test_auto_on_a_model_without_a_plan():
    with pytest.raises(ConfigError, match="the Net has none"):
        _tensor_parallel.resolve(Net(), "auto")


def test_every_style_word_builds_a_torch_style():
    from torch.distributed.tensor.parallel import ParallelStyle

    for word, (make, _) in _tensor_parallel.STYLES.items():
        assert isinstance(make(), ParallelStyle), word
    assert torch.distributed.is_available()


# -- Accelerate's spellings ---------------------------------------------------------------------
def test_accelerates_config_file_and_flags_give_the_mesh(tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text(
        "distributed_type: FSDP\nnum_processes: 4\nparallelism_config:\n"
        "  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 2\n"
        "  parallelism_config_cp_comm_strategy: allgather\n"
    )
    config = load_config(config_file=path)
    assert config.backend == "fsdp" and config.parallelism == {
        "dp_replicate": 1,
        "dp_shard": 2,
        "tp": 2,
        "cp": 1,
    }
    args = build_parser().parse_args(
        [
            "launch",
            "--use_fsdp",
            "--use_parallelism_config",
            "--parallelism_config_dp_replicate_size",
            "2",
            "--parallelism_config_tp_size",
            "2",
            "x.py",
        ]
    )
    launch = launch_config(args)
    assert launch.accelerate["parallelism_config_tp_size"] == 2


def test_gradsync_accelerate_takes_a_parallelism_config(clean_env):
    """Read as the parallelism setting on backend fsdp: here 2 x 2 ranks in a world of 1."""
    from gradsync.accelerate import Accelerator as AccelerateAccelerator

    with pytest.raises(
        ConfigError,
        match=r"parallelism='dp_shard=2,tp=2' holds 1 x 2 x 2 x 1 = 4 processes, but the world has 1",
    ):
        AccelerateAccelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    with pytest.raises(ConfigError, match="got parallelism_config and parallelism"):
        AccelerateAccelerator(parallelism_config=ParallelismConfig(), parallelism={"tp": 1})


def test_plan_counts_the_data_parallel_ranks_of_the_mesh(capsys):
    from gradsync.cli import main

    assert (
        main(
            [
                "plan",
                "--micro-batch-size",
                "4",
                "--gradient-accumulation-steps",
                "8",
                "--nproc-per-node",
                "8",
                "--parallelism",
                "dp_shard=-1,tp=2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "data-parallel processes: 4 of 8 (1 node(s) x 8), mesh dp_shard=4,tp=2" in out
    assert "global batch size:       128 per optimizer step" in out  # 4 x 8 x (1 x 4)
    assert (
        main(
            [
                "plan",
                "--micro-batch-size",
                "4",
                "--nproc-per-node",
                "6",
                "--parallelism",
                "dp_shard=-1,tp=4",
            ]
        )
        == 2
    )
    assert "4 does not divide the world of 6 processes" in capsys.readouterr().err


def test_the_launcher_plans_over_the_data_parallel_ranks_and_refuses_a_wrong_product(
    tmp_path, capsys, clean_env
):
    from gradsync.cli import main

    script = tmp_path / "s.py"
    script.write_text("print(1)\n")
    common = ["launch", "--dry-run", "--nproc-per-node", "4", "--backend", "fsdp"]
    assert (
        main(
            [
                *common,
                "--parallelism",
                "dp_shard=2,tp=2",
                "--micro-batch-size",
                "2",
                "--gradient-accumulation-steps",
                "4",
                str(script),
            ]
        )
        == 0
    )
    assert "x data_parallel_size=2 = global_batch_size=16" in capsys.readouterr().out
    assert main([*common, "--parallelism", "dp_shard=3,tp=2", str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds 1 x 3 x 2 x 1 = 6 processes, but the world has 4" in err[0]
