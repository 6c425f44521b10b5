"""`gradsync launch` takes `accelerate launch`'s flags and Accelerate's config file: the
translation (checked against Accelerate's own launcher and plugins on the same flags and
files), what is ignored with a warning and what is refused in one line, flags over the file,
and the dry run. No process group, no worker.

The files in tests/data/accelerate are Accelerate's: default_config.yaml as `accelerate config
default` writes it, the others written by Accelerate's ClusterConfig.to_yaml_file as `accelerate
config` does; Accelerate's own loader reads every one of them here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from unittest import mock

import pytest

from gradsync import cli
from gradsync.accelerate import _compat as ac
from gradsync.config import from_env, load_config, read_yaml
from gradsync.errors import ConfigError
from gradsync.launch import LaunchConfig, Launcher

DATA = Path(__file__).resolve().parents[1] / "data" / "accelerate"
SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "report_rank.py")
FILES = [
    "default_config.yaml",
    "multi_cpu.yaml",
    "fsdp.yaml",
    "deepspeed.yaml",
    "deepspeed_file.yaml",
]


@pytest.fixture
def here(tmp_path, monkeypatch, clean_env):
    """A working folder holding copies of the Accelerate files (deepspeed_file.yaml names
    ds_config.json relative to it, as Accelerate reads it), no scheduler's variables."""
    for p in DATA.iterdir():
        shutil.copy(p, tmp_path / p.name)
    monkeypatch.chdir(tmp_path)
    for key in list(os.environ):
        if key.startswith(("SLURM_", "PET_", "OMPI_", "PMI_")) or key in (
            "CUDA_VISIBLE_DEVICES",
            "OMP_NUM_THREADS",
        ):
            monkeypatch.delenv(key)
    return tmp_path


def launcher(*argv: str, environ: dict[str, str] | None = None) -> Launcher:
    """The Launcher `gradsync launch ARGV script` builds (nothing is started)."""
    args = cli.build_parser().parse_args(["launch", *argv, SCRIPT])
    return Launcher(cli.launch_config(args), environ={} if environ is None else environ)


def refusal(*argv: str, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        launcher(*argv, environ=environ)
    text = str(err.value)
    assert "\n" not in text, text
    return text


# -- the files are Accelerate's -----------------------------------------------------------
@pytest.mark.parametrize("name", FILES)
def test_every_fixture_is_read_by_accelerates_own_loader(name, here):
    accelerate = pytest.importorskip("accelerate.commands.config.config_args")
    loaded = accelerate.load_config_from_file(name)
    assert loaded.compute_environment.value == "LOCAL_MACHINE"
    assert ac.is_accelerate(read_yaml(name))


def test_a_default_config_written_now_is_silent_and_single(here, caplog):
    default = pytest.importorskip("accelerate.commands.config.default")
    default.write_basic_config(save_location=str(here / "fresh.yaml"))
    for name in ("fresh.yaml", "default_config.yaml"):
        data = read_yaml(name)
        assert ac.is_accelerate(data)
        t = ac.translate(data, ac.Source(repr(name)))
        assert t.notes == [], f"{name}: Accelerate's defaults must stay silent"
        assert t.settings == {"backend": "single"}
        with caplog.at_level(logging.WARNING, logger="gradsync"):
            assert load_config(config_file=name).backend == "single"
        assert not caplog.records
    run = launcher("--config_file", "default_config.yaml")
    assert run.config.world_size == 1 and "--standalone" in run.torchrun_argv()
    env = run.run_env()
    assert env["GRADSYNC_BACKEND"] == "single" and env["GRADSYNC_DEVICE"] == "cpu"  # use_cpu: true
    assert "GRADSYNC_CONFIG" not in env  # translated here, once


def test_a_gradsync_file_is_still_a_gradsync_file(here):
    (here / "g.yaml").write_text("backend: ddp\nmixed_precision: bf16\ndeepspeed_config: {}\n")
    assert not ac.is_accelerate(read_yaml("g.yaml"))
    run = launcher("--config", "g.yaml", "--nproc-per-node", "2")
    assert run.worker_env()["GRADSYNC_CONFIG"] == str(here / "g.yaml")


# -- the same as Accelerate's launcher ---------------------------------------------------
def accelerate_env(argv: list[str], monkeypatch) -> tuple[object, dict[str, str]]:
    """What `accelerate launch ARGV train.py` hands its workers: its arguments after its own
    validation, and the ACCELERATE_* / FSDP_* variables it sets."""
    launch = pytest.importorskip("accelerate.commands.launch")
    from accelerate.utils import launch as utils

    monkeypatch.setattr(launch, "default_config_file", "/nonexistent/default_config.yaml")
    args = launch.launch_command_parser().parse_args([*argv, "train.py"])
    args, defaults, _ = launch._validate_launch_command(args)
    before = dict(os.environ)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = (
            ",".join(defaults.deepspeed_config) if defaults else ""
        )
        _, env = utils.prepare_deepspeed_cmd_env(args)
    else:
        env = utils.prepare_multi_gpu_env(args)
    return args, {k: v for k, v in env.items() if before.get(k) != v}


def test_fsdp_file_means_what_accelerates_plugin_makes_of_it(here, monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin

    _, env = accelerate_env(["--config_file", "fsdp.yaml"], monkeypatch)
    with mock.patch.dict(os.environ, env, clear=True):
        plugin = FullyShardedDataParallelPlugin()
    config = load_config(config_file="fsdp.yaml")
    assert config.backend == "fsdp" and plugin.fsdp_version == 2
    assert config.mixed_precision == env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert config.fsdp_wrap == plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert plugin.activation_checkpointing and config.activation_checkpointing == [
        "LlamaDecoderLayer"
    ]
    run = launcher("--config_file", "fsdp.yaml")
    assert run.config.nproc_per_node == 8 and run.config.world_size == 8


@pytest.mark.parametrize("how", ["file", "flag"])
def test_fsdp_state_dict_type_chooses_the_accelerate_layout_save_state_writes(
    how, here, monkeypatch
):
    from accelerate.utils import FullyShardedDataParallelPlugin

    if how == "file":
        text = Path("fsdp.yaml").read_text().replace("SHARDED_STATE_DICT", "FULL_STATE_DICT")
        Path("full.yaml").write_text(text)
        argv = ["--config_file", "full.yaml"]
    else:
        argv = ["--config_file", "fsdp.yaml", "--fsdp_state_dict_type", "FULL_STATE_DICT"]
    _, env = accelerate_env(argv, monkeypatch)
    with mock.patch.dict(os.environ, env, clear=True):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.state_dict_type.name == "FULL_STATE_DICT"
    config = load_config(environ=launcher(*argv, "--nproc-per-node", "2").run_env())
    assert config.fsdp_state_dict_type == "FULL_STATE_DICT"
    sharded = load_config(environ=launcher("--config_file", "fsdp.yaml").run_env())
    assert sharded.fsdp_state_dict_type is None  # SHARDED_STATE_DICT: the default, silent


def test_deepspeed_file_means_what_accelerates_plugin_makes_of_it(here, monkeypatch):
    from accelerate.utils import DeepSpeedPlugin

    _, env = accelerate_env(["--config_file", "deepspeed.yaml"], monkeypatch)
    with mock.patch.dict(os.environ, env, clear=True):
        theirs = DeepSpeedPlugin().deepspeed_config
    config = load_config(config_file="deepspeed.yaml")
    ours = config.deepspeed_config
    assert config.backend == "deepspeed" and config.mixed_precision == "bf16"
    assert config.gradient_accumulation_steps == theirs["gradient_accumulation_steps"] == 4
    zero = theirs["zero_optimization"]
    assert ours["zero_optimization"]["stage"] == zero["stage"] == 2
    assert (
        ours["zero_optimization"]["offload_optimizer"]["device"]
        == zero["offload_optimizer"]["device"]
        == "cpu"
    )
    assert "offload_param" not in ours["zero_optimization"]  # "none": nothing to offload
    assert ours["gradient_clipping"] == theirs["gradient_clipping"] == 1.0


@pytest.mark.parametrize(
    "argv",
    [
        ["--use_deepspeed", "--num_processes", "2"],
        [
            "--use_deepspeed",
            "--zero_stage",
            "3",
            "--offload_param_device",
            "cpu",
            "--zero3_save_16bit_model",
            "true",
            "--num_processes",
            "2",
        ],
        [
            "--use_deepspeed",
            "--zero_stage",
            "1",
            "--gradient_clipping",
            "0.5",
            "--num_processes",
            "2",
        ],
    ],
)
def test_deepspeed_flags_mean_what_accelerates_plugin_makes_of_them(argv, here, monkeypatch):
    from accelerate.utils import DeepSpeedPlugin

    _, env = accelerate_env(argv, monkeypatch)
    with mock.patch.dict(os.environ, env, clear=True):
        theirs = DeepSpeedPlugin().deepspeed_config
    run = launcher(*argv)
    ours = run._given()["deepspeed_config"]
    assert run._given()["backend"] == "deepspeed"
    for path in (
        ("zero_optimization", "stage"),
        ("zero_optimization", "offload_param", "device"),
        ("zero_optimization", "stage3_gather_16bit_weights_on_model_save"),
        ("gradient_clipping",),
    ):
        mine, want = ac._get(ours, path), ac._get(theirs, path)
        if want in (None, "none", False, "auto"):  # Accelerate's "nothing": absent in ours
            assert mine in (None, False), f"{path}: {mine!r} where Accelerate has {want!r}"
        else:
            assert mine == want, f"{path}: {mine!r}, Accelerate {want!r}"


@pytest.mark.parametrize(
    "argv",
    [
        ["--num_processes", "2"],
        ["--multi_gpu", "--num_processes", "4", "--main_process_port", "29555"],
        [
            "--multi_gpu",
            "--num_processes",
            "8",
            "--num_machines",
            "2",
            "--machine_rank",
            "1",
            "--main_process_ip",
            "10.0.0.1",
            "--main_process_port",
            "6000",
            "--same_network",
        ],
        [
            "--multi_gpu",
            "--num_processes",
            "4",
            "--num_machines",
            "2",
            "--machine_rank",
            "1",
            "--main_process_ip",
            "10.0.0.1",
        ],
        [
            "--multi_gpu",
            "--num_processes",
            "4",
            "--num_machines",
            "2",
            "--machine_rank",
            "1",
            "--main_process_ip",
            "10.0.0.1",
            "--rdzv_backend",
            "c10d",
        ],
    ],
)
def test_the_processes_and_rendezvous_are_accelerates(argv, here, monkeypatch):
    """Both spellings of each flag give the same launch, with Accelerate's processes per
    node, nodes, node rank and rendezvous."""
    theirs, _ = accelerate_env(argv, monkeypatch)
    run = launcher(*argv)
    dashed = launcher(*[w.replace("_", "-") if w.startswith("--") else w for w in argv])
    assert run.torchrun_argv() == dashed.torchrun_argv()
    c = run.config
    assert str(c.nproc_per_node) == str(theirs.nproc_per_node)
    assert c.world_size == theirs.num_processes
    if getattr(theirs, "nnodes", None) is not None:
        assert (str(c.nnodes), c.node_rank) == (theirs.nnodes, theirs.node_rank)
    endpoint = getattr(theirs, "rdzv_endpoint", None)
    if endpoint and theirs.rdzv_backend != "static":
        assert c.rdzv_endpoint == endpoint and c.rdzv_backend == theirs.rdzv_backend
    elif getattr(theirs, "master_addr", None) or endpoint:
        # Accelerate's static rendezvous at MAIN:PORT, as an endpoint or as the master: the same
        addr, port = (
            endpoint.rsplit(":", 1) if endpoint else (theirs.master_addr, theirs.master_port)
        )
        assert (c.master_addr, str(c.master_port)) == (addr, str(port))
    elif "--main_process_port" in argv:
        assert str(c.master_port) == str(theirs.master_port)
    else:  # one machine, no port given: Accelerate's 29500 (if free), gradsync a free one
        assert "--standalone" in run.torchrun_argv()


# -- flags and the file together ----------------------------------------------------------
def test_flags_win_over_the_file(here):
    run = launcher(
        "--config_file",
        "deepspeed.yaml",
        "--num_processes",
        "4",
        "--zero_stage",
        "3",
        "--mixed_precision",
        "no",
        "--gradient_accumulation_steps",
        "2",
    )
    assert run.config.nproc_per_node == 4
    env = run.worker_env()
    assert (
        env["GRADSYNC_MIXED_PRECISION"] == "no"
        and env["GRADSYNC_GRADIENT_ACCUMULATION_STEPS"] == "2"
    )
    ds = json.loads(env["GRADSYNC_DEEPSPEED_CONFIG"])
    assert ds["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"}}  # merged
    assert ds["gradient_clipping"] == 1.0


def test_the_workers_read_the_translated_settings(here):
    run = launcher("--config_file", "deepspeed.yaml", "--nproc-per-node", "2")
    config = load_config(environ=run.run_env())
    assert (config.backend, config.mixed_precision, config.gradient_accumulation_steps) == (
        "deepspeed",
        "bf16",
        4,
    )
    from gradsync.backends._deepspeed_config import load_ds_config

    assert load_ds_config(config.deepspeed_config)["zero_optimization"]["stage"] == 2
    fsdp = load_config(environ=launcher("--config", "fsdp.yaml", "--nproc-per-node", "2").run_env())
    assert fsdp.fsdp_wrap == ["LlamaDecoderLayer"] == fsdp.activation_checkpointing


def test_the_environment_wins_over_the_file_and_flags_over_both(here):
    environ = {
        "GRADSYNC_MIXED_PRECISION": "fp16",
        "CUDA_VISIBLE_DEVICES": "3",
        "OMP_NUM_THREADS": "5",
    }
    (here / "ids.yaml").write_text(
        "distributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: bf16\n"
        "gpu_ids: 0,1\nnum_cpu_threads_per_process: 7\n"
    )
    env = launcher("--config_file", "ids.yaml", environ=environ).run_env()
    assert (
        "GRADSYNC_MIXED_PRECISION" not in env
        and "CUDA_VISIBLE_DEVICES" not in env
        and "OMP_NUM_THREADS" not in env
    )
    env = launcher("--config_file", "ids.yaml").run_env()
    assert (
        env["GRADSYNC_MIXED_PRECISION"],
        env["CUDA_VISIBLE_DEVICES"],
        env["OMP_NUM_THREADS"],
    ) == ("bf16", "0,1", "7")
    env = launcher(
        "--config_file",
        "ids.yaml",
        "--gpu_ids",
        "2,3",
        "--num_cpu_threads_per_process",
        "3",
        "--cpu",
        environ=environ,
    ).run_env()
    assert (env["CUDA_VISIBLE_DEVICES"], env["OMP_NUM_THREADS"], env["GRADSYNC_DEVICE"]) == (
        "2,3",
        "3",
        "cpu",
    )


def test_zero_stage_goes_into_the_deepspeed_config_file(here):
    run = launcher(
        "--use_deepspeed",
        "--deepspeed_config_file",
        "ds_config.json",
        "--zero_stage",
        "3",
        "--offload_optimizer_device",
        "cpu",
    )
    ds = run._given()["deepspeed_config"]
    assert ds["zero_optimization"] == {
        "stage": 3,
        "overlap_comm": True,
        "offload_optimizer": {"device": "cpu"},
    }
    assert ds["bf16"] == {"enabled": "auto"}  # the rest of the file kept
    alone = launcher("--use_deepspeed", "--deepspeed_config_file", "ds_config.json")._given()
    assert alone["deepspeed_config"] == str(here / "ds_config.json")  # the file, as given
    text = refusal(
        "--use_deepspeed", "--deepspeed_config_file", "ds_config.json", "--zero_stage", "2"
    )
    assert text.startswith(
        "--zero_stage=2 contradicts zero_optimization.stage=3 in --deepspeed_config_file=ds_config.json"
    )


def test_zero_stage_goes_into_a_gradsync_files_deepspeed_config(here):
    (here / "g.yaml").write_text(
        'backend: deepspeed\ndeepspeed_config: {"zero_optimization": {"stage": 1}, "steps_per_print": 7}\n'
    )
    ds = launcher("--config", "g.yaml", "--zero_stage", "3", "--use_deepspeed")._given()[
        "deepspeed_config"
    ]
    assert ds == {
        "zero_optimization": {"stage": 3},
        "steps_per_print": 7,
    }  # the flag wins over the file


def test_gradsync_keys_sit_beside_accelerates(here, caplog):
    (here / "mixed.yaml").write_text(
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\nsync_policy: defer\nseed: 3\n"
    )
    config = load_config(config_file="mixed.yaml")
    assert (config.backend, config.sync_policy, config.seed) == ("fsdp", "defer", 3)
    (here / "clash.yaml").write_text("distributed_type: FSDP\nbackend: ddp\n")
    with pytest.raises(
        ConfigError,
        match=r"backend='ddp' in 'clash.yaml' contradicts distributed_type='FSDP' in 'clash.yaml'",
    ):
        load_config(config_file="clash.yaml")


# -- ignored keys: one warning each; defaults silent ----------------------------------------
def test_a_key_that_does_not_map_is_one_warning_naming_it(here, caplog, monkeypatch):
    (here / "odd.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\ndebug: true\nenable_cpu_affinity: true\n"
        "main_training_function: train\nfsdp_config:\n  fsdp_version: 2\n  fsdp_offload_params: true\n"
        "  fsdp_reshard_after_forward: false\n"
        "  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  fsdp_min_num_params: 1000\n"
        "downcast_bf16: 'no'\ntpu_use_cluster: false\nsame_network: true\nrdzv_backend: static\n"
    )
    t = ac.translate(read_yaml("odd.yaml"), ac.Source("'odd.yaml'"))
    named = sorted(n.split("=", 1)[0] for n in t.notes)
    assert named == [
        "debug",
        "enable_cpu_affinity",
        "fsdp_config.fsdp_auto_wrap_policy",
        "fsdp_config.fsdp_offload_params",
        "fsdp_config.fsdp_reshard_after_forward",
        "main_training_function",
    ]
    for note in t.notes:
        assert "\n" not in note and " in 'odd.yaml' is ignored: " in note, note
    assert "debug=True in 'odd.yaml' is ignored: gradsync has no debug mode" in t.notes[0]
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        load_config(config_file="odd.yaml")
    assert len(caplog.records) == len(t.notes)
    caplog.clear()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        load_config(config_file="odd.yaml")
    assert not caplog.records, "the same file on every rank: rank 0 says it"


def test_the_launcher_prints_each_warning_once(here, capsys):
    (here / "odd.yaml").write_text("distributed_type: MULTI_CPU\nnum_processes: 2\ndebug: true\n")
    assert (
        cli.main(
            ["launch", "--dry-run", "--config_file", "odd.yaml", "--enable_cpu_affinity", SCRIPT]
        )
        == 0
    )
    err = capsys.readouterr().err.splitlines()
    assert (
        "gradsync: warning: debug=True in 'odd.yaml' is ignored: gradsync has no debug mode (--audit counts the collectives)"
        in err
    )
    assert any(
        line.startswith("gradsync: warning: --enable_cpu_affinity is ignored: ") for line in err
    )


def test_cpu_with_several_processes_says_accelerate_would_start_one(here, capsys):
    assert cli.main(["launch", "--dry-run", "--cpu", "--num_processes", "2", SCRIPT]) == 0
    err = capsys.readouterr().err.splitlines()
    assert (
        "gradsync: warning: --cpu with --num_processes=2: gradsync starts 2 processes on the CPU, "
        "where accelerate launch would start one (it needs --multi_gpu with ACCELERATE_USE_CPU=1 "
        "for 2)"
    ) in err
    assert (
        cli.main(["launch", "--dry-run", "--cpu", "--multi_gpu", "--num_processes", "2", SCRIPT])
        == 0
    )
    assert "accelerate launch would start one" not in capsys.readouterr().err


def test_fsdp_config_without_a_version_says_fsdp1(here):
    (here / "old.yaml").write_text(
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n"
        "  fsdp_backward_prefetch: BACKWARD_PRE\n"
    )
    t = ac.translate(read_yaml("old.yaml"), ac.Source("'old.yaml'"))
    assert t.notes == [
        "fsdp_config in 'old.yaml' has no fsdp_version, which means FSDP1 to Accelerate: "
        "gradsync runs FSDP2 (fully_shard); add fsdp_version: 2"
    ]


# -- refusals: one line, naming the value and the fix ---------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--num_processes", "3", "--num_machines", "2", "--main_process_ip", "h"],
            "--num_processes=3 does not divide evenly over 2 machines (from --num_machines=2); give a multiple of 2",
        ),
        (
            ["--num_processes", "4", "--nproc-per-node", "2"],
            "--num_processes=4 contradicts --nproc-per-node=2 on 1 machine(s) (2 processes); give one of them",
        ),
        (
            ["--num_machines", "2", "--nnodes", "3", "--main_process_ip", "h"],
            "--num_machines=2 contradicts --nnodes=3",
        ),
        (
            [
                "--machine_rank",
                "1",
                "--node-rank",
                "0",
                "--num_machines",
                "2",
                "--main_process_ip",
                "h",
            ],
            "--machine_rank=1 contradicts --node-rank=0",
        ),
        (
            ["--main_process_ip", "a", "--master-addr", "b", "--num_machines", "2"],
            "--main_process_ip=a contradicts --master-addr=b",
        ),
        (
            ["--main_process_ip", "a", "--num_machines", "2", "--rdzv-endpoint", "b:1"],
            "--main_process_ip=a and --rdzv-endpoint both say where the nodes meet",
        ),
        (
            ["--num_processes", "4", "--nnodes", "1:2", "--rdzv-endpoint", "h:1"],
            "is a range; give --nproc-per-node instead",
        ),
        (
            ["--use_fsdp", "--backend", "ddp"],
            "--use_fsdp means backend='fsdp', which contradicts --backend=ddp",
        ),
        (
            ["--multi_gpu", "--use_deepspeed"],
            "--multi_gpu and --use_deepspeed each choose the backend; give one of them",
        ),
        (["--tpu"], "--tpu: gradsync does not run on TPUs (XLA)"),
        (["--use_megatron_lm"], "--use_megatron_lm: gradsync does not run Megatron-LM"),
        (
            ["--use_fsdp", "--fsdp_version", "1"],
            "--fsdp_version=1: gradsync runs FSDP2 (fully_shard), not FSDP1; set fsdp_version: 2",
        ),
        (
            ["--use_fsdp", "--fsdp_sharding_strategy", "HYBRID_SHARD"],
            "--fsdp_sharding_strategy=HYBRID_SHARD: gradsync's FSDP2 shards over all ranks",
        ),
        (["--use_deepspeed", "--zero_stage", "4"], "--zero_stage=4 must be a whole number 0 to 3"),
        (
            ["--use_deepspeed", "--offload_param_device", "disk"],
            "--offload_param_device=disk is unknown; use none, cpu or nvme",
        ),
        (
            ["--config", "a.yaml", "--config_file", "b.yaml"],
            "--config='a.yaml' and --config_file='b.yaml' name two files",
        ),
    ],
)
def test_contradictions_and_refused_flags_are_one_line(argv, message, here):
    for name in ("a.yaml", "b.yaml"):
        (here / name).write_text("seed: 1\n")
    try:
        text = refusal(*argv)
    except ConfigError as err:  # raised by launch_config itself (two files)
        text = str(err)
    assert message in text, text


@pytest.mark.parametrize(
    "yaml, message",
    [
        (
            "distributed_type: XLA\n",
            "distributed_type='XLA' in 'x.yaml': gradsync does not run on TPUs (XLA); use MULTI_GPU",
        ),
        (
            "distributed_type: MEGATRON_LM\n",
            "distributed_type='MEGATRON_LM' in 'x.yaml': gradsync does not run Megatron-LM",
        ),
        (
            "distributed_type: MULTI_NPU\n",
            "distributed_type='MULTI_NPU' in 'x.yaml': gradsync runs on CUDA GPUs and CPUs; use MULTI_GPU or MULTI_CPU",
        ),
        (
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 1\n",
            "fsdp_config.fsdp_version=1 in 'x.yaml': gradsync runs FSDP2",
        ),
        (
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
            "  fsdp_state_dict_type: LOCAL_STATE_DICT\n",
            "fsdp_config.fsdp_state_dict_type='LOCAL_STATE_DICT' in 'x.yaml': FSDP2 has no "
            "LOCAL_STATE_DICT",
        ),
        (
            "distributed_type: MULTI_GPU\nmixed_precision: fp8\n",
            "mixed_precision='fp8' in 'x.yaml': gradsync has no fp8 training; use bf16",
        ),
        (
            "compute_environment: AMAZON_SAGEMAKER\ndistributed_type: MULTI_GPU\nec2_instance_type: x\n",
            "compute_environment='AMAZON_SAGEMAKER' in 'x.yaml': gradsync launches on the machines you start it on",
        ),
        (
            "distributed_type: FSDP\nparallelism_config:\n  parallelism_config_cp_size: 2\n",
            "parallelism_config.parallelism_config_cp_size=2 in 'x.yaml': context parallel needs a GPU (CUDA)",
        ),
        (
            "distributed_type: FSDP\nparallelism_config:\n  parallelism_config_sp_size: 2\n",
            "parallelism_config.parallelism_config_sp_size=2 in 'x.yaml': gradsync's mesh has dp_replicate, dp_shard and tp",
        ),
        (
            "distributed_type: MULTI_GPU\nparallelism_config:\n  parallelism_config_tp_size: 2\n",
            "parallelism='tp=2' asks for tensor parallelism (tp=2), which runs on FSDP2, and backend='ddp'",
        ),
        (
            "distributed_type: MULTI_GPU\nnum_procesess: 2\n",
            "unknown key(s) num_procesess (did you mean num_processes?) in 'x.yaml'",
        ),
        (
            "distributed_type: MULTI_GPU\nnum_processes: two\n",
            "num_processes='two' in 'x.yaml' must be a whole number >= 1",
        ),
        (
            "distributed_type: MULTI_GPU\nnum_machines: 2\nmachine_rank: 2\n",
            "machine_rank=2 in 'x.yaml' must be below num_machines=2",
        ),
    ],
)
def test_a_value_gradsync_cannot_honour_is_a_config_error(yaml, message, here):
    (here / "x.yaml").write_text(yaml)
    with pytest.raises(ConfigError) as err:
        load_config(config_file="x.yaml")
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_distributed_type_no_with_several_processes_is_refused(here):
    text = refusal("--config_file", "default_config.yaml", "--num_processes", "2")
    assert text.startswith(
        "distributed_type='NO' in 'default_config.yaml' runs one process, but this launch starts 2"
    )
    assert (
        launcher(
            "--config_file", "default_config.yaml", "--num_processes", "2", "--multi_gpu"
        ).config.world_size
        == 2
    )


@pytest.mark.parametrize(
    "flag, why",
    [
        ("--megatron_lm_tp_degree", "gradsync does not run Megatron-LM"),
        ("--megatron-lm-pp-degree", "gradsync does not run Megatron-LM"),
        ("--fp8_backend", "gradsync has no fp8 training"),
        ("--parallelism_config_sp_size", "gradsync has no sequence parallel"),
        ("--tpu_cluster", "TPU"),
        ("--aws_access_key_id", "not on SageMaker"),
    ],
)
def test_accelerate_flags_gradsync_refuses_are_one_line_naming_why(flag, why, here, capsys):
    assert cli.main(["launch", flag, "2", SCRIPT]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"gradsync: error: {flag} (accelerate launch's) is not taken by gradsync launch: "
    )
    assert why in err[0]


# -- the dry run ------------------------------------------------------------------------------
def test_dry_run_prints_the_command_and_variables_and_starts_nothing(here, capsys):
    assert (
        cli.main(
            [
                "launch",
                "--dry-run",
                "--config_file",
                "multi_cpu.yaml",
                "--gradient_accumulation_steps",
                "3",
                SCRIPT,
                "--x",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "torch.distributed.run --nproc-per-node=2 --nnodes=1 --standalone" in out
    assert f"{SCRIPT} --x 1" in out
    for line in (
        "  GRADSYNC_BACKEND=ddp",
        "  GRADSYNC_MIXED_PRECISION=bf16",
        "  GRADSYNC_DEVICE=cpu",
        "  GRADSYNC_GRADIENT_ACCUMULATION_STEPS=3",
    ):
        assert line in out.splitlines(), out
    assert "--nproc-per-node=2 (num_processes=2 in 'multi_cpu.yaml')" in out
    assert not list(here.glob("rank*.json"))
    settings = from_env(
        {
            k.strip(): v
            for k, v in (
                line.split("=", 1) for line in out.splitlines() if line.startswith("  GRADSYNC_")
            )
        }
    )
    assert settings == {
        "backend": "ddp",
        "mixed_precision": "bf16",
        "gradient_accumulation_steps": 3,
    }


def test_dynamo_flags_are_gradsyncs_compile(here):
    given = launcher(
        "--dynamo_backend", "INDUCTOR", "--dynamo_mode", "max-autotune", "--dynamo_use_fullgraph"
    )._given()
    assert given["compile"] == {"backend": "inductor", "mode": "max-autotune", "fullgraph": True}
    assert "compile" not in launcher("--dynamo_backend", "no")._given()


def test_every_accelerate_flag_has_both_spellings_and_a_help():
    parser = cli.build_parser()
    launch = next(a for a in parser._actions if a.dest == "command").choices["launch"]
    options = {o for a in launch._actions for o in a.option_strings}
    for flag in ac.FLAGS:
        assert {f"--{flag.name}", "--" + flag.name.replace("_", "-")} <= options, flag.name
        assert flag.help and "\n" not in flag.help
    for spelling in (
        "--config_file",
        "--config-file",
        "--module",
        "--mixed_precision",
        "--gradient_accumulation_steps",
    ):
        assert spelling in options


def test_launch_config_takes_accelerates_flags_from_python(here):
    run = Launcher(
        LaunchConfig(script=SCRIPT, accelerate={"num_processes": 2, "use_fsdp": True}), environ={}
    )
    assert run.config.nproc_per_node == 2 and run.worker_env()["GRADSYNC_BACKEND"] == "fsdp"
    with pytest.raises(
        ConfigError,
        match=r"'num_process' is not an accelerate launch flag gradsync takes \(did you mean num_processes\?\)",
    ):
        Launcher(LaunchConfig(script=SCRIPT, accelerate={"num_process": 2}), environ={})


def test_a_section_counts_with_its_backend_only(here, capsys):
    given = launcher(
        "--backend", "fsdp", "--fsdp_transformer_layer_cls_to_wrap", "Block,Head"
    )._given()
    assert given["fsdp_wrap"] == ["Block", "Head"] and given["backend"] == "fsdp"
    run = launcher("--fsdp_transformer_layer_cls_to_wrap", "Block", "--nproc-per-node", "2")
    assert "fsdp_wrap" not in run._given()
    assert run.warnings == [
        "--fsdp_transformer_layer_cls_to_wrap=Block is ignored: fsdp_config is read "
        "with distributed_type FSDP (--use_fsdp), and the backend here is not given"
    ]
    file_run = launcher("--config_file", "fsdp.yaml", "--backend", "ddp")
    assert (
        "fsdp_wrap" not in file_run._from_file()
        and file_run.worker_env()["GRADSYNC_BACKEND"] == "ddp"
    )
    assert any(
        w.startswith(
            "fsdp_config.fsdp_activation_checkpointing=True in 'fsdp.yaml' (and 7 more of fsdp_config) is ignored"
        )
        for w in file_run.warnings
    ), file_run.warnings
