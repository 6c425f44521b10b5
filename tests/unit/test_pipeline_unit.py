"""Pipeline parallelism's settings and split, without a process group: the ``pp`` dim in every
spelling of ``parallelism``, the split of an ``nn.Sequential`` into stages, and bad input as
one ConfigError line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradsync import ConfigError, mesh
from gradsync.backends._pipeline import Cut, check_microbatches
from gradsync.settings import Config


def _seq() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 4),
        nn.Tanh(),
        nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)),
        nn.Linear(4, 1),
    )


@pytest.mark.parametrize(
    "value",
    [{"pp": 2, "dp_shard": 2}, "pp=2,dp_shard=2", '{"pp": 2, "dp_shard": 2}', "pp:2,dp_shard:-1"],
)
def test_pp_is_the_outermost_dim_in_every_spelling(value):
    dims = mesh.parse(value).resolve(4)
    assert dims == mesh.Parallelism(dp_shard=2, pp=2)
    assert dims.shape == (2, 1, 2, 1) and dims.names == ("pp", "dp_replicate", "dp_shard", "tp")
    assert dims.data_parallel == 2 and dims.text() == "pp=2,dp_shard=2"


def test_without_pp_the_mesh_is_as_before():
    dims = mesh.parse({"dp_shard": 2, "tp": 2}).resolve(4)
    assert dims.shape == (1, 2, 2) and "pp" not in dims.sizes


def test_accelerates_parallelism_config_has_no_pp():
    with pytest.raises(ConfigError, match="ParallelismConfig has no pipeline dim"):
        mesh.parse({"parallelism_config_pp_size": 2})


@pytest.mark.parametrize("backend", ["deepspeed", "fairscale"])
def test_pp_on_a_backend_that_cannot_pipeline(backend):
    with pytest.raises(ConfigError, match=f"backend='{backend}' cannot pipeline") as info:
        Config(backend=backend, parallelism={"pp": 2}).validate()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("dims", [{"pp": 2, "dp_shard": 2}, {"pp": 2, "tp": 2}, "pp=2,dp_shard=-1"])
def test_pp_on_ddp_replicates_only(dims):
    """ddp pipelines over dp_replicate; dp_shard or tp with it stays one line."""
    with pytest.raises(ConfigError, match="backend='ddp' replicates each stage") as info:
        Config(backend="ddp", parallelism=dims).validate()
    assert "\n" not in str(info.value) and "parallelism=" in str(info.value)
    config = Config(backend="ddp", parallelism="pp=2,dp_replicate=-1", pp_split=["4"]).validate()
    assert config.parallelism == {"pp": 2, "dp_replicate": -1, "dp_shard": 1, "tp": 1, "cp": 1}
    with pytest.raises(ConfigError, match="an N-D mesh"):
        Config(backend="ddp", parallelism={"dp_replicate": 2}).validate()


def test_the_schedule_and_split_forms():
    config = Config(
        backend="fsdp", parallelism="pp=2", pp_split="2.1", pp_schedule="gpipe"
    ).validate()
    assert config.pp_split == ["2.1"] and config.pp_schedule == "GPipe"
    for bad, words in [
        ({"pp_schedule": "zb"}, "is no schedule"),
        ({"pp_split": []}, "is no split"),
        ({"pp_split": ["1", "1"]}, "names a module twice"),
        ({"pp_microbatches": 0}, "pp_microbatches"),
    ]:
        with pytest.raises(ConfigError, match=words):
            Config(backend="fsdp", parallelism="pp=2", **bad).validate()


def test_a_split_keeps_one_stage_with_the_whole_models_names():
    names = [n for n, _ in _seq().named_parameters()]
    kept = [dict(Cut(_seq(), ["2.1"], 2).stage(s).named_parameters()) for s in (0, 1)]
    assert sorted(kept[0]) == ["0.bias", "0.weight", "2.0.bias", "2.0.weight"]
    assert sorted([*kept[0], *kept[1]]) == sorted(names)
    x = torch.randn(3, 4)
    assert torch.equal(
        Cut(_seq(), ["2.1"], 2).stage(1)(Cut(_seq(), ["2.1"], 2).stage(0)(x)), _seq()(x)
    )


@pytest.mark.parametrize(
    "split, words",
    [
        (["9"], "'9' names no module"),
        (["0"], "leaves stage 0 empty"),
        (["3", "2.1"], "leaves stage 1 empty"),
        (["0.weight"], "names no module"),
        (["2"], "names 1 module(s), and pp=3 needs 2"),
    ],
)
def test_bad_splits(split, words):
    stages = 3 if len(split) == 2 or words.startswith("names 1") else 2
    with pytest.raises(ConfigError) as info:
        Cut(_seq(), split, stages)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_a_split_inside_a_module_that_is_not_a_sequence():
    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    with pytest.raises(ConfigError, match="cuts an nn.Sequential"):
        Cut(Wrapped(), ["inner.1"], 2)
    with pytest.raises(ConfigError, match="lies inside a module that is not an nn.Sequential"):
        Cut(nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2)])), ["1.0"], 2)


WB = ("weight", "bias")


def test_a_callable_split():
    model = _seq()
    x = torch.randn(2, 4)
    want = model[2](model[1](model[0](x)))
    stage = Cut(model, lambda m, n: [nn.Sequential(m[0], m[1], m[2]), m[3]], 2).stage(0)
    # the whole model's names, not the fresh Sequential's (numbered from 0 in both stages)
    assert list(stage.state_dict()) == [f"{i}.{k}" for i in ("0", "2.0", "2.2") for k in WB]
    assert torch.equal(stage(x), want)  # run by the callable's module
    with pytest.raises(
        ConfigError, match=r"leaves 4 of the model's parameters and buffers in no stage"
    ):
        Cut(_seq(), lambda m, n: [m[0], m[3]], 2).stage(0)
    with pytest.raises(ConfigError, match="needs a list of 2 nn.Modules"):
        Cut(model, lambda m, n: [m[0]], 2)
    with pytest.raises(ConfigError, match="left stage 1 without trainable parameters"):
        Cut(model, lambda m, n: [m[0], m[1]], 2)


def test_microbatches_against_the_micro_batch():
    check_microbatches(2, 4, 2)
    check_microbatches(4, None, 2)
    with pytest.raises(ConfigError, match="pp_microbatches=3 does not divide micro_batch_size=4"):
        check_microbatches(3, 4, 2)
    with pytest.raises(ConfigError, match="fewer than the pp=2 stages"):
        check_microbatches(1, 4, 2)


def test_the_environment_the_launcher_and_yaml_carry_pp(tmp_path):
    from gradsync.cli import build_parser, launch_config
    from gradsync.config import from_env, load_config

    env = from_env(
        {
            "GRADSYNC_PARALLELISM": "pp=2,dp_shard=-1",
            "GRADSYNC_PP_SPLIT": "4,blocks.2",
            "GRADSYNC_PP_SCHEDULE": "gpipe",
            "GRADSYNC_PP_MICROBATCHES": "4",
        }
    )
    assert env["parallelism"]["pp"] == 2 and env["pp_split"] == ["4", "blocks.2"]
    args = build_parser().parse_args(
        ["launch", "--backend", "fsdp", "--parallelism", "pp=2,dp_shard=2", "x.py"]
    )
    assert launch_config(args).parallelism == {
        "pp": 2,
        "dp_replicate": 1,
        "dp_shard": 2,
        "tp": 1,
        "cp": 1,
    }
    path = tmp_path / "c.yaml"
    path.write_text(
        "backend: fsdp\nparallelism: {pp: 2, dp_shard: 2}\npp_split: ['4']\n"
        "pp_schedule: GPipe\npp_microbatches: 4\n"
    )
    config = load_config(config_file=path)
    assert config.parallelism["pp"] == 2 and config.pp_split == ["4"]
    assert (config.pp_schedule, config.pp_microbatches) == ("GPipe", 4)


def test_launch_flags_carry_the_pipeline_settings(tmp_path, capsys):
    """--pp-split, --pp-schedule and --pp-microbatches reach the workers' environment, which
    reads them back as the keywords would give them."""
    from gradsync.cli import main
    from gradsync.config import from_env

    script = tmp_path / "s.py"
    script.write_text("print(1)\n")
    flags = ["--pp-split", "model.layers.2,model.layers.4", "--pp-schedule", "gpipe"]
    code = main(
        [
            "launch",
            "--dry-run",
            "--backend",
            "fsdp",
            "--nproc-per-node",
            "3",
            "--parallelism",
            "pp=3",
            *flags,
            "--pp-microbatches",
            "6",
            str(script),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    env = dict(line.strip().split("=", 1) for line in out.splitlines() if "GRADSYNC_PP_" in line)
    assert env == {
        "GRADSYNC_PP_SPLIT": "model.layers.2,model.layers.4",
        "GRADSYNC_PP_SCHEDULE": "gpipe",
        "GRADSYNC_PP_MICROBATCHES": "6",
    }
    read = from_env(env)
    assert read["pp_split"] == ["model.layers.2", "model.layers.4"]
    assert read["pp_microbatches"] == 6
    assert from_env({"GRADSYNC_PP_SPLIT": '["4", "blocks.2"]'})["pp_split"] == ["4", "blocks.2"]
    assert main(["launch", "--dry-run", "--pp-schedule", "Interleaved", str(script)]) == 2
    assert "is no schedule" in capsys.readouterr().err


def test_a_callable_split_with_several_stages_per_rank_keeps_the_models_names():
    """Four slices, stages 1 and 3 kept: the model with stages 0 and 2 removed, each kept
    stage's steps its own Linear, and the slices run the kept stages."""
    model = _seq()
    slices = lambda m, n: [m[0:2], m[2:3], m[3:4], m[3:]]  # noqa: E731
    with pytest.raises(ConfigError, match="stages 2 and 3 share a parameter") as info:
        Cut(model, slices, 4).keep([1, 3])
    assert "\n" not in str(info.value)
    split = lambda m, n: [m[0:2], m[2][0:2], m[2][2:], m[3:]]  # noqa: E731
    root, steps, runs = Cut(model, split, 4).keep([1, 3])
    assert root is model and sorted(n for n, _ in root.named_parameters()) == [
        "2.0.bias",
        "2.0.weight",
        "3.bias",
        "3.weight",
    ]
    first, last = model.get_submodule("2"), model.get_submodule("3")  # "2" keeps 2.0, 2.1
    assert steps == [[first], [last]] and runs[1][0] is last
    # what the kept stages run and nothing else: stage 0's Tanh "1" and 2.2 are gone too
    assert [n for n, _ in root.named_modules()] == ["", "2", "2.0", "2.1", "3"]
    foreign = lambda m, n: [m[0:2], nn.Linear(4, 4), m[2][2:], m[3:]]  # noqa: E731
    with pytest.raises(ConfigError, match="parameters that are not the model's"):
        Cut(_seq(), foreign, 4).keep([0, 2])


def test_a_callable_splits_stage_holds_its_own_buffers_only():
    """Batch norms without parameters: each stage keeps its own running statistics, not the
    other stage's (which only the other rank updates); a buffer no stage runs is refused."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False), nn.Linear(4, 4),
        nn.BatchNorm1d(4, affine=False), nn.Linear(4, 1),
    )  # fmt: skip
    stage = Cut(model, lambda m, n: [m[0:2], m[2:]], 2).stage(0)
    norm = ("running_mean", "running_var", "num_batches_tracked")
    assert list(stage.state_dict()) == ["0.weight", "0.bias", *(f"1.{b}" for b in norm)]
    model = _seq()
    model.register_buffer("scale", torch.ones(1))
    with pytest.raises(ConfigError, match=r"no stage \('scale' first\)"):
        Cut(model, lambda m, n: [m[0:2], m[2:]], 2).stage(1)


def _llama():
    pytest.importorskip("transformers")  # the hf extra
    from scenarios.pp_decoder import SEQ, make_llama

    return make_llama(), SEQ


def test_a_decoders_stages_with_several_per_rank_run_the_whole_model():
    """Four stages of one layer each (the modules several stages per rank run), chained, give
    the whole model's logits, with and without a left padding mask."""
    from gradsync.backends import _pipeline_decoder

    whole, seq = _llama()
    model, _ = _llama()
    cut = Cut(model, ["model.layers.1", "model.layers.2", "model.layers.3"], 4)
    runs = _pipeline_decoder.parts(model, cut._bounds)
    x = torch.randint(0, 64, (2, seq))
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[0, :3] = 0
    for given in (None, mask):
        hidden = x
        for run in runs:
            hidden = run(hidden, attention_mask=given)
        assert torch.allclose(hidden, whole(x, attention_mask=given).logits, atol=1e-6)
    root, steps, _ = cut.keep([1, 3])
    assert [len(s) for s in steps] == [1, 3]  # layer 1; layer 3, the norm and the head
    assert "model.embed_tokens.weight" not in dict(root.named_parameters())


def test_a_sliding_window_decoder_is_refused_in_one_line():
    pytest.importorskip("transformers")
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    with pytest.raises(ConfigError, match="sliding-window attention") as info:
        Cut(MistralForCausalLM(config), ["model.layers.1"], 2)
    assert "sliding_window=4096" in str(info.value) and "\n" not in str(info.value)


def test_the_same_loop_with_a_padding_mask_runs_in_one_process():
    """``pipeline_step`` with ``inputs`` a mapping of ids and padding mask, without a pipeline:
    the model is given both (its gradient is plain torch's); a mask of the wrong shape is one
    UsageError line."""
    import torch.nn.functional as F

    from gradsync import Accelerator, UsageError

    whole, seq = _llama()
    model, _ = _llama()
    x = torch.randint(0, 64, (2, seq))
    y = torch.randint(0, 64, (2, seq))
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[0, :3] = 0
    y[mask == 0] = -100

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    accel = Accelerator(gradient_accumulation_steps=1)
    model = accel.prepare(model)
    with accel.accumulate(model):
        accel.pipeline_step(model, {"input_ids": x, "attention_mask": mask}, y, loss_fn)
    loss_fn(whole(x, attention_mask=mask).logits, y).backward()
    got = dict(model.named_parameters())
    for name, p in whole.named_parameters():
        assert torch.allclose(got[name].grad, p.grad, atol=1e-6), name
    with pytest.raises(UsageError, match=r"attention_mask'\] of shape \(2, 7\)") as info:
        with accel.accumulate(model):
            inputs = {"input_ids": x, "attention_mask": mask[:, 1:]}
            accel.pipeline_step(model, inputs, y, loss_fn)
    assert "\n" not in str(info.value)


def test_the_pipeline_canary_runs_only_above_the_tested_range(monkeypatch):
    from gradsync._support import torch_range
    from gradsync.backends._pipeline_canary import Canary

    assert not Canary().active  # this torch is in the range
    monkeypatch.setattr(torch_range, "NEWEST", "2.0")
    assert Canary().active
