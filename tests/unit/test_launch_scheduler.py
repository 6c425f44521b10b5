"""`gradsync launch` inside a scheduler: its defaults from SLURM's and Kubeflow's (``PET_*``)
variables, the contradictions and the N² launches it refuses, the thread count from the CPUs
this process may use, parsers that never abbreviate, torchrun's arguments built without
parsing the script's, and the SIGUSR1 forwarding's parts. No process group, no worker."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync import cli
from gradsync._support import environment
from gradsync.errors import ConfigError
from gradsync.launch import LaunchConfig, Launcher, signals
from gradsync.launch import cluster as scheduler
from gradsync.launch.config import torchrun_namespace

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "report_rank.py")


def slurm(nodes: int = 2, node: int = 1, tasks: int | None = None, **extra: str) -> dict[str, str]:
    """What a task of `srun -N NODES --ntasks-per-node=1 gradsync launch ...` sees."""
    tasks = nodes if tasks is None else tasks
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(node),
        "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_NODEID": str(node),
        "SLURM_LOCALID": "0",
        "SLURM_STEP_TASKS_PER_NODE": f"{tasks // nodes}(x{nodes})",
        "SLURM_STEP_NODELIST": "gpu[07-08]" if nodes == 2 else "gpu07",
    }
    env.update(extra)
    return env


def launch(environ: dict[str, str], **given: object) -> Launcher:
    return Launcher(LaunchConfig(script=SCRIPT, **given), environ=environ)  # type: ignore[arg-type]


def after(argv: list[str], flag: str) -> str:
    return next(word.split("=", 1)[1] for word in argv if word.startswith(flag + "="))


# -- SLURM ------------------------------------------------------------------------------


def test_slurm_two_nodes_gives_nodes_rank_gpus_endpoint_and_id():
    launcher = launch(slurm(SLURM_GPUS_ON_NODE="4"))
    c = launcher.config
    assert (c.nnodes, c.node_rank, c.nproc_per_node) == (2, 1, 4)
    port = environment.derived_port("slurm-4242-0")
    assert c.rdzv_endpoint == f"gpu07:{port}" and c.rdzv_id == "4242"
    argv = launcher.torchrun_argv()
    assert argv[:5] == [
        "--nproc-per-node=4",
        "--nnodes=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=gpu07:{port}",
        "--rdzv-id=4242",
    ]
    assert "--standalone" not in argv
    assert launcher.sources["nnodes"] == "SLURM_STEP_NUM_NODES=2"
    assert (
        "from the environment (slurm): --nnodes=2 (SLURM_STEP_NUM_NODES=2)" in launcher.describe()
    )


def test_slurm_one_node_runs_standalone_with_the_default_processes():
    launcher = launch(slurm(nodes=1, node=0))
    assert launcher.config.nproc_per_node == 1  # no SLURM_GPUS_ON_NODE: today's default
    assert launcher.torchrun_argv()[:3] == ["--nproc-per-node=1", "--nnodes=1", "--standalone"]


def test_slurm_flags_given_win():
    launcher = launch(
        slurm(SLURM_GPUS_ON_NODE="4"), nproc_per_node=2, rdzv_endpoint="head:29400", rdzv_id="mine"
    )
    c = launcher.config
    assert (c.nproc_per_node, c.rdzv_endpoint, c.rdzv_id, c.nnodes) == (2, "head:29400", "mine", 2)
    # --master-addr given: a static rendezvous, the port derived from the job
    static = launch(slurm(), master_addr="head").torchrun_argv()
    assert "--node-rank=1" in static and "--master-addr=head" in static
    assert after(static, "--master-port") == str(environment.derived_port("slurm-4242-0"))
    assert not any(w.startswith("--rdzv-endpoint") for w in static)
    # an endpoint given: the id is still the job's
    assert launch(slurm(), rdzv_endpoint="head:1234").config.rdzv_id == "4242"


def test_slurm_nnodes_given_in_a_two_node_step_needs_no_master_addr():
    assert launch(slurm(), nnodes=2).config.rdzv_endpoint is not None
    assert launch(slurm(), nnodes="1:2").config.rdzv_endpoint is not None


@pytest.mark.parametrize(
    "env, given, words",
    [
        (slurm(nodes=1, node=0), {"nnodes": 2}, ["--nnodes=2", "SLURM_STEP_NUM_NODES=1"]),
        (slurm(), {"nnodes": "3:4"}, ["--nnodes=3:4", "SLURM_STEP_NUM_NODES=2"]),
        (slurm(), {"node_rank": 0}, ["--node-rank=0", "SLURM_NODEID=1"]),
        (slurm(), {"standalone": True}, ["--standalone", "SLURM_STEP_NUM_NODES=2"]),
        (
            {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1"},
            {"nnodes": 1},
            ["--nnodes=1", "PET_NNODES=2"],
        ),
        (
            {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "m"},
            {"node_rank": 0},
            ["--node-rank=0", "PET_NODE_RANK=1"],
        ),
    ],
)
def test_flags_that_contradict_the_scheduler_are_one_line_naming_both(env, given, words):
    with pytest.raises(ConfigError) as info:
        launch(env, **given)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_several_launches_per_slurm_node_are_refused():
    with pytest.raises(ConfigError) as info:
        launch(slurm(nodes=1, node=0, tasks=2))
    message = str(info.value)
    assert "\n" not in message
    assert "SLURM started 2 tasks on 1 node(s)" in message
    assert "srun --ntasks-per-node=1 gradsync launch" in message
    with pytest.raises(ConfigError, match="srun --ntasks-per-node=1"):  # flags do not excuse it
        launch(slurm(nodes=2, node=0, tasks=4), nnodes=2, node_rank=0, rdzv_endpoint="h:1")


def test_the_cli_refuses_n_squared_launches_in_one_line(monkeypatch, capsys):
    for key, value in slurm(nodes=1, node=0, tasks=2).items():
        monkeypatch.setenv(key, value)
    assert cli.main(["launch", "--dry-run", SCRIPT]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gradsync: error: SLURM started 2 tasks"), err


# -- Kubeflow (torchrun's PET_* variables) ----------------------------------------------


def test_trainjob_pet_variables_give_a_static_rendezvous():
    env = {
        "PET_NPROC_PER_NODE": "2",
        "PET_NNODES": "2",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "job-node-0-0.job",
        "PET_MASTER_PORT": "29400",
    }
    launcher = launch(env)  # validate() does not ask for --master-addr
    argv = launcher.torchrun_argv()
    assert argv[:5] == [
        "--nproc-per-node=2",
        "--nnodes=2",
        "--node-rank=1",
        "--master-addr=job-node-0-0.job",
        "--master-port=29400",
    ]
    assert launcher.sources["master_addr"] == "PET_MASTER_ADDR=job-node-0-0.job"
    assert launcher.config.world_size == 4


def test_elastic_pytorchjob_pet_variables_give_the_c10d_rendezvous():
    env = {
        "PET_NPROC_PER_NODE": "auto",
        "PET_NNODES": "1:3",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": "job-elastic:29400",
        "PET_RDZV_ID": "job-elastic",
        "PET_MAX_RESTARTS": "2",
    }
    c = launch(env).config
    assert (c.nnodes, c.rdzv_endpoint, c.rdzv_backend, c.rdzv_id, c.max_restarts) == (
        "1:3",
        "job-elastic:29400",
        "c10d",
        "job-elastic",
        2,
    )


def test_pet_flags_given_win_and_a_rendezvous_given_is_taken_whole():
    env = {
        "PET_NPROC_PER_NODE": "2",
        "PET_NNODES": "1",
        "PET_RDZV_ENDPOINT": "far:1",
        "PET_MASTER_PORT": "29411",
    }
    c = launch(env, nproc_per_node=1, master_addr="near").config
    assert (c.nproc_per_node, c.master_addr, c.rdzv_endpoint, c.master_port) == (
        1,
        "near",
        None,
        29411,
    )
    assert launch({"PET_NPROC_PER_NODE": "2", "PET_NNODES": "1"}).torchrun_argv()[:3] == [
        "--nproc-per-node=2",
        "--nnodes=1",
        "--standalone",
    ]


def test_a_pytorchjob_pod_meets_at_torchs_master_variables():
    env = {
        "PET_NPROC_PER_NODE": "2",
        "PET_NNODES": "2",
        "PET_NODE_RANK": "1",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
    }
    argv = launch(env).torchrun_argv()
    assert argv[:5] == [
        "--nproc-per-node=2",
        "--nnodes=2",
        "--node-rank=1",
        "--master-addr=job-master-0",
        "--master-port=23456",
    ]


@pytest.mark.parametrize(
    "key, value", [("PET_NNODES", "two"), ("PET_NPROC_PER_NODE", "0"), ("PET_MASTER_PORT", "70000")]
)
def test_a_malformed_pet_variable_is_named(key, value):
    with pytest.raises(ConfigError, match=f"{key}='{value}' must be"):
        launch({key: value})


# -- the rendezvous id outside a scheduler ----------------------------------------------


def test_the_rendezvous_id_outside_a_scheduler():
    one = launch({}, rdzv_endpoint="127.0.0.1:29400").config.rdzv_id
    assert one is not None and one.startswith("gradsync-") and str(os.getpid()) in one
    # several nodes must agree on it and nothing names the job: the shared default
    assert launch({}, nnodes=2, rdzv_endpoint="127.0.0.1:29400").config.rdzv_id == "gradsync"
    assert launch({}, rdzv_endpoint="h:1", rdzv_id="x").config.rdzv_id == "x"


def test_outside_a_scheduler_the_defaults_are_torchruns():
    launcher = launch({})
    c = launcher.config
    assert (c.nproc_per_node, c.nnodes, c.node_rank, c.max_restarts) == (1, 1, 0, 0)
    assert launcher.sources == {} and launcher.warnings == []
    with pytest.raises(ConfigError, match="--nnodes=2 needs --rdzv-endpoint"):
        launch({}, nnodes=2)


# -- threads ----------------------------------------------------------------------------


@pytest.fixture
def eight_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(scheduler, "cgroup_cpus", lambda root=None: None)


def test_threads_come_from_the_cpus_this_process_may_use(eight_cpus, monkeypatch):
    assert scheduler.usable_cpus({}) == 8
    assert launch({}, nproc_per_node=2).thread_env() == {"OMP_NUM_THREADS": "4"}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine's count is not what we may use
    assert launch({}, nproc_per_node=2).thread_env() == {"OMP_NUM_THREADS": "1"}
    assert launch({"OMP_NUM_THREADS": "5"}, nproc_per_node=2).thread_env() == {}


def test_threads_under_slurm_follow_cpus_per_task(eight_cpus):
    env = slurm(nodes=1, node=0, SLURM_CPUS_PER_TASK="6", SLURM_GPUS_ON_NODE="2")
    assert launch(env).thread_env() == {"OMP_NUM_THREADS": "3"}
    assert launch(env).warnings == []  # GPU ranks


def test_more_cpu_ranks_than_slurm_cpus_is_one_warning_line(eight_cpus, monkeypatch, capsys):
    env = slurm(nodes=1, node=0, SLURM_CPUS_PER_TASK="2")
    launcher = launch(env, nproc_per_node=4)
    assert len(launcher.warnings) == 1
    assert (
        "4 CPU processes on this node but SLURM gave this launch 2 CPU(s) (SLURM_CPUS_PER_TASK=2)"
        in launcher.warnings[0]
    )
    assert launcher.thread_env() == {"OMP_NUM_THREADS": "1"}
    assert launch(env, nproc_per_node=2).warnings == []
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["launch", "--dry-run", "--nproc-per-node", "4", SCRIPT]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gradsync: warning: 4 CPU processes"), err


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_cgroup_cpu_quota_limits_the_cpus(tmp_path, version):
    proc = tmp_path / "cgroup"
    if version == "v2":
        proc.write_text("0::/kubepods/pod1/c1\n")
        (tmp_path / "kubepods" / "pod1" / "c1").mkdir(parents=True)
        (tmp_path / "kubepods" / "pod1" / "c1" / "cpu.max").write_text("max 100000\n")
        (tmp_path / "kubepods" / "pod1" / "cpu.max").write_text("250000 100000\n")
        (tmp_path / "cpu.max").write_text("max 100000\n")
    else:
        proc.write_text("4:memory:/x\n1:cpu,cpuacct:/kubepods/pod1\n")
        folder = tmp_path / "cpu,cpuacct" / "kubepods" / "pod1"
        folder.mkdir(parents=True)
        (folder / "cpu.cfs_quota_us").write_text("150000\n")
        (folder / "cpu.cfs_period_us").write_text("100000\n")
    assert scheduler.cgroup_cpus(tmp_path, proc) == (3 if version == "v2" else 2)
    assert scheduler.cgroup_cpus(tmp_path, tmp_path / "missing") is None


# -- no parser abbreviates; torchrun never parses the script's arguments --------------


def test_the_scripts_flags_pass_through_gradsyncs_parser():
    argv = [
        "launch",
        "--nproc-per-node",
        "2",
        "train.py",
        "--micro",
        "3",
        "--max",
        "5",
        "--seed",
        "1",
        "--nnodes",
        "4",
        "-m",
        "x",
    ]
    args, unknown = cli.build_parser().parse_known_args(argv)
    assert unknown == [] and args.nproc_per_node == 2 and args.seed is None
    assert cli.script_words(argv, args.script, args.script_args) == argv[4:]
    dashes = ["launch", "train.py", "a", "--", "--max", "5"]
    args, _ = cli.build_parser().parse_known_args(dashes)
    assert cli.script_words(dashes, args.script, args.script_args) == ["a", "--", "--max", "5"]


def test_no_gradsync_parser_abbreviates(capsys):
    parser = cli.build_parser()
    assert parser.allow_abbrev is False
    subs = next(a for a in parser._actions if a.dest == "command").choices  # type: ignore[attr-defined]
    assert all(p.allow_abbrev is False for p in subs.values())
    assert cli.main(["launch", "--dry-run", "--micro", "2", SCRIPT]) == 2
    assert (
        "unknown flag --micro for gradsync launch (did you mean --micro-batch-size?)"
        in capsys.readouterr().err
    )
    assert cli.main(["plan", "--micro", "2"]) == 2
    assert "unknown flag --micro for gradsync plan" in capsys.readouterr().err


def test_the_launch_config_keeps_the_scripts_words(capsys):
    assert (
        cli.main(
            [
                "launch",
                "--dry-run",
                "--nproc-per-node",
                "2",
                SCRIPT,
                "--micro",
                "3",
                "--max",
                "5",
                "--",
                "--x",
            ]
        )
        == 0
    )
    command = next(
        line for line in capsys.readouterr().out.splitlines() if line.startswith("command: ")
    )
    assert command.endswith(f"-m gradsync.launch.worker {SCRIPT} --micro 3 --max 5 -- --x")


@pytest.mark.parametrize("module", [False, True])
def test_torchruns_arguments_leave_the_scripts_alone(monkeypatch, module):
    monkeypatch.setenv("PET_MAX_RESTARTS", "7")  # gradsync read them; torchrun must not
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "elsewhere:1")
    monkeypatch.setenv("PET_STANDALONE", "0")
    script = "pkg.train" if module else SCRIPT
    config = LaunchConfig(
        script=script,
        module=module,
        nproc_per_node=2,
        master_addr="head",
        master_port=29400,
        script_args=["--micro", "3", "--max", "5", "--nnodes", "9", "-m"],
    )
    launcher = Launcher(config, environ={}) if not module else None
    own, tail = (launcher or _unvalidated(config))._torchrun_parts()
    args = torchrun_namespace(own, tail)
    assert args.training_script == "gradsync.launch.worker" and args.module
    assert args.training_script_args == [
        *(["-m"] if module else []),
        script,
        "--micro",
        "3",
        "--max",
        "5",
        "--nnodes",
        "9",
        "-m",
    ]
    assert (args.max_restarts, args.nnodes, args.nproc_per_node) == (0, "1", "2")
    assert (args.rdzv_endpoint, args.master_addr, args.master_port, args.standalone) == (
        "",
        "head",
        29400,
        False,
    )
    assert os.environ["PET_MAX_RESTARTS"] == "7"  # put back


def _unvalidated(config: LaunchConfig) -> Launcher:
    """A Launcher for a module that does not exist here (validate() would look for it)."""
    launcher = Launcher.__new__(Launcher)
    launcher.config = dataclasses.replace(config, **scheduler.resolve(config, {}).values)
    return launcher


def test_no_python_runs_the_program_with_its_words():
    launcher = Launcher(
        LaunchConfig(script="bash", script_args=["-c", "echo --max"], no_python=True), environ={}
    )
    args = torchrun_namespace(*launcher._torchrun_parts())
    assert args.no_python and args.training_script == "bash"
    assert args.training_script_args == ["-c", "echo --max"]


@pytest.mark.parametrize("module", [False, True])
def test_fork_start_has_torchruns_agent_run_gradsyncs_wrapper_in_each_copy(module):
    from torch.distributed.run import config_from_args, run_script_path

    from gradsync.launch import failures, worker

    config = LaunchConfig(
        script="pkg.train" if module else SCRIPT,
        script_args=["--max", "5"],
        module=module,
        nproc_per_node=2,
        start_method="fork",
    )
    launcher = _unvalidated(config) if module else Launcher(config, environ={})
    args = torchrun_namespace(*launcher._torchrun_parts())
    assert args.run_path and args.start_method == "fork" and not args.module
    assert args.training_script == str(Path(worker.__file__).resolve())
    assert worker.ERRORS_ENV == failures.ERRORS_ENV  # the wrapper writes where the report reads
    assert args.training_script_args == [*(["-m"] if module else []), config.script, "--max", "5"]
    launch_config, entry, entry_args = config_from_args(args)
    assert entry is run_script_path and launch_config.start_method == "fork"
    assert entry_args == [args.training_script, *args.training_script_args]
    # The default, and exec said so: a fresh interpreter runs the wrapper module.
    for method in (None, "exec"):
        own, _ = launch({}, start_method=method)._torchrun_parts()
        assert own[-2:] == ["-m", "gradsync.launch.worker"] and "--run-path" not in own


@pytest.mark.parametrize(
    "given, words",
    [
        ({"start_method": "spawn"}, "--start-method='spawn' is unknown; use exec"),
        ({"start_method": "fork", "no_python": True}, "drop one of them"),
    ],
)
def test_a_start_method_it_cannot_honour_is_refused_before_anything_starts(given, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        launch({}, **given)


def test_fork_is_refused_where_torch_sees_a_cuda_device(monkeypatch):
    import gc

    import torch

    from gradsync.launch import torchrun

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    frozen = gc.get_freeze_count()
    with pytest.raises(
        ConfigError, match="torch sees a CUDA device here.*drop --start-method fork"
    ):
        torchrun._prepare_fork()
    assert gc.get_freeze_count() == frozen  # refused before anything is frozen


def test_the_cli_passes_the_start_method_to_the_launch():
    args = cli.build_parser().parse_args(["launch", "--start-method", "fork", SCRIPT])
    assert cli.launch_config(args).start_method == "fork"
    args = cli.build_parser().parse_args(["launch", "--start_method", "exec", SCRIPT])
    assert cli.launch_config(args).start_method == "exec"


# -- SIGUSR1 forwarding, in parts -------------------------------------------------------


def test_children_are_the_processes_this_one_started():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in signals.children(os.getpid())
        assert os.getpid() not in signals.children(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert child.pid not in signals.children(os.getpid())


def test_children_from_proc_stat_without_the_children_files(tmp_path):
    for pid, ppid in ((10, 1), (11, 10), (12, 10), (13, 11)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (py thon) S {ppid} 1 1 0\n")
    assert signals.children(10, tmp_path) == [11, 12]


def test_forwarding_installs_its_handler_and_puts_the_old_one_back():
    before = signal.getsignal(signal.SIGUSR1)
    with signals.forwarding():
        assert signal.getsignal(signal.SIGUSR1) is signals._handler
    assert signal.getsignal(signal.SIGUSR1) == before


def test_gradsync_env_prints_where_it_runs(monkeypatch, capsys):
    for key, value in slurm(nodes=1, node=0, tasks=2, SLURM_PROCID="1", SLURM_LOCALID="1").items():
        monkeypatch.setenv(key, value)
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "where this process runs:" in out
    assert "  scheduler: slurm (job 4242)" in out and "  rank 1 of 2; local rank 1 of 2" in out
