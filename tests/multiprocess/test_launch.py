"""`gradsync launch` and `gradsync plan`: real processes, real rendezvous on 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync.launch import LaunchConfig, Launcher

#: Each test starts its own processes and shares nothing with the others: xdist may run
#: them on either worker (tests/conftest.py).
INDEPENDENT_TESTS = True

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "report_rank.py"


def gradsync(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    full.update({"OMP_NUM_THREADS": "1", **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "gradsync", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full,
    )


def reports(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]


@pytest.mark.multiprocess
def test_two_workers_report_the_config_files_backend_the_flags_and_their_exit_status(tmp_path):
    """One launch: the config file's backend reaches both workers (through GRADSYNC_CONFIG,
    not a variable of its own), a flag wins over the file, the script's arguments arrive, and
    rank 1's exit status is the launch's."""
    cfg = write(tmp_path / "cfg.yaml", "backend: fsdp\ngradient_accumulation_steps: 2\n")
    proc = gradsync(
        "launch",
        "--nproc-per-node",
        "2",
        "--config",
        str(cfg),
        "--gradient-accumulation-steps",
        "3",
        str(SCRIPT),
        str(tmp_path),
        "--flag",
        "value",
        env={"REPORT_EXIT_CODE": "3"},
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    got = reports(tmp_path)
    assert [r["rank"] for r in got] == [0, 1]
    for r in got:
        assert r["world_size"] == 2 and r["rank_sum"] == 1.0 and r["args"] == ["--flag", "value"]
        assert (r["backend"], r["env_backend"], r["accumulation"]) == ("fsdp", None, 3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.multiprocess
def test_two_nodes_on_one_machine_form_one_job(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    full = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    full["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "gradsync",
        "launch",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-endpoint",
        endpoint,
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "2",
        str(SCRIPT),
        str(tmp_path),
    ]
    nodes = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full)
        for _ in range(2)
    ]
    outs = [n.communicate(timeout=180)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    got = reports(tmp_path)
    assert sorted(r["rank"] for r in got) == [0, 1]
    for r in got:
        # 8 = 2 per micro-batch x 2 processes x 2 accumulation steps
        assert r["world_size"] == 2 and r["accumulation"] == 2 and r["micro_batch_size"] == 2
        assert r["rank_sum"] == 1.0


def test_dry_run_prints_the_command_and_settings(tmp_path):
    proc = gradsync(
        "launch",
        "--nproc-per-node",
        "2",
        "--gradient-accumulation-steps",
        "4",
        "--backend",
        "ddp",
        "--dry-run",
        str(SCRIPT),
        "x",
    )
    assert proc.returncode == 0, proc.stderr
    assert "torch.distributed.run --nproc-per-node=2 --nnodes=1 --standalone" in proc.stdout
    assert "GRADSYNC_GRADIENT_ACCUMULATION_STEPS=4" in proc.stdout
    assert "GRADSYNC_BACKEND=ddp" in proc.stdout
    assert f"{SCRIPT} x" in proc.stdout


def test_plan_prints_the_sizes():
    proc = gradsync(
        "plan", "--global-batch-size", "64", "--micro-batch-size", "4", "--nproc-per-node", "2"
    )
    assert proc.returncode == 0, proc.stderr
    assert "accumulation steps:      8" in proc.stdout
    assert "global batch size:       64" in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (
            [
                "plan",
                "--global-batch-size",
                "60",
                "--micro-batch-size",
                "4",
                "--nproc-per-node",
                "2",
            ],
            "global_batch_size=60 is not divisible by micro_batch_size x world size = 4 x 2 = 8",
        ),
        (
            [
                "launch",
                "--nproc-per-node",
                "2",
                "--global-batch-size",
                "60",
                "--micro-batch-size",
                "4",
                str(SCRIPT),
            ],
            "global_batch_size=60 is not divisible",
        ),
        (
            ["launch", "--nproc-per-node", "2", "no_such_script.py"],
            "script 'no_such_script.py' does not exist",
        ),
        (
            ["launch", "--backend", "horovod", str(SCRIPT)],
            "backend='horovod' is unknown; available: auto, ",
        ),
        (
            ["launch", "--gradient-accumulation-steps", "0", str(SCRIPT)],
            "gradient_accumulation_steps=0 must be >= 1",
        ),
        (
            ["launch", "--gradient-accumulation-steps", "-2", str(SCRIPT)],
            "gradient_accumulation_steps=-2 must be >= 1",
        ),
        (
            ["launch", "--sync-policy", "sometimes", str(SCRIPT)],
            "--sync-policy='sometimes' is unknown",
        ),
        (["launch", "--nnodes", "2", str(SCRIPT)], "--nnodes=2 needs --rdzv-endpoint"),
    ],
)
def test_bad_input_is_one_line_without_traceback(args, message):
    proc = gradsync(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradsync: error: ")
    assert message in lines[0]


def test_non_integer_accumulation_is_rejected_by_the_parser():
    proc = gradsync("launch", "--gradient-accumulation-steps", "four", str(SCRIPT))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--gradient-accumulation-steps: invalid int value: 'four'" in proc.stderr


def test_launcher_is_usable_from_python(tmp_path):
    launcher = Launcher(
        LaunchConfig(script=str(SCRIPT), nproc_per_node=2, gradient_accumulation_steps=4)
    )
    assert launcher.plan.gradient_accumulation_steps == 4
    assert launcher.worker_env()["GRADSYNC_GRADIENT_ACCUMULATION_STEPS"] == "4"
    assert "--standalone" in launcher.torchrun_argv()


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_dry_run_with_a_config_file_exports_only_what_was_given(tmp_path):
    cfg = write(
        tmp_path / "cfg.yaml", "backend: fsdp\nsync_policy: defer\ngradient_accumulation_steps: 4\n"
    )
    proc = gradsync(
        "launch", "--nproc-per-node", "2", "--config", str(cfg), "--dry-run", str(SCRIPT)
    )
    assert proc.returncode == 0, proc.stderr
    env = [line.strip() for line in proc.stdout.splitlines() if line.startswith("  GRADSYNC_")]
    assert f"GRADSYNC_CONFIG={cfg.resolve()}" in env
    assert "GRADSYNC_GRADIENT_ACCUMULATION_STEPS=4" in env
    # The file's backend and sync policy reach the workers through GRADSYNC_CONFIG, not beaten
    # by launcher defaults in the environment.
    assert not [
        line for line in env if line.startswith(("GRADSYNC_BACKEND=", "GRADSYNC_SYNC_POLICY="))
    ], env
    assert sorted(line.split("=")[0] for line in env) == [
        "GRADSYNC_CONFIG",
        "GRADSYNC_GRADIENT_ACCUMULATION_STEPS",
    ]


def test_workers_see_the_config_files_backend_and_flags_still_win(tmp_path, clean_env):
    from gradsync.config import load_config

    cfg = write(tmp_path / "cfg.yaml", "backend: fsdp\nsync_policy: defer\nmixed_precision: bf16\n")
    launcher = Launcher(LaunchConfig(script=str(SCRIPT), nproc_per_node=2, config_file=str(cfg)))
    assert launcher.worker_env() == {"GRADSYNC_CONFIG": str(cfg.resolve())}
    worker = load_config(environ=launcher.worker_env())  # what each worker's Accelerator() reads
    assert (worker.backend, worker.sync_policy, worker.mixed_precision) == ("fsdp", "defer", "bf16")

    # An explicit flag wins over the file, even when it names the default.
    launcher = Launcher(
        LaunchConfig(
            script=str(SCRIPT),
            nproc_per_node=2,
            config_file=str(cfg),
            backend="auto",
            sync_policy="auto",
            mixed_precision="no",
        )
    )
    worker = load_config(environ=launcher.worker_env())
    assert (worker.backend, worker.sync_policy, worker.mixed_precision) == ("auto", "auto", "no")


def test_no_batch_size_given_exports_no_accumulation_steps():
    launcher = Launcher(LaunchConfig(script=str(SCRIPT), nproc_per_node=2))
    assert launcher.worker_env() == {}
    launcher = Launcher(
        LaunchConfig(
            script=str(SCRIPT),
            nproc_per_node=2,
            global_batch_size=16,
            micro_batch_size=2,
            seed=7,
            audit=True,
        )
    )
    assert launcher.worker_env() == {
        "GRADSYNC_GRADIENT_ACCUMULATION_STEPS": "4",
        "GRADSYNC_MICRO_BATCH_SIZE": "2",
        "GRADSYNC_SEED": "7",
        "GRADSYNC_AUDIT": "1",
    }


@pytest.mark.parametrize(
    "yaml_text, flags, message",
    [
        (
            "backend: horovod\n",
            [],
            "config file '{cfg}': backend='horovod' is unknown; available: auto, ",
        ),
        (
            "sync_policy: sometimes\n",
            [],
            "config file '{cfg}': sync_policy='sometimes' is unknown; use one of",
        ),
        ("mixed_precision: fp8\n", [], "config file '{cfg}': mixed_precision='fp8' is unknown"),
        ("micro_batch_size: 0\n", [], "config file '{cfg}': micro_batch_size=0 must be >= 1"),
        ("seed: abc\n", [], "config file '{cfg}': seed='abc' must be an integer"),
        ("a: [1, 2\n", [], "config file '{cfg}' is not valid YAML: "),
        (
            "backend: ddp\n",
            ["--mixed-precision", "fp8"],
            "--mixed-precision='fp8' is unknown; use one of no, bf16",
        ),
        (
            "backend: ddp\n",
            ["--comm-hook", "powersgd"],
            "--comm-hook='powersgd' is unknown (did you mean power_sgd?); use one of no, fp16,",
        ),
        (
            "comm_hook: fp61\n",
            [],
            "config file '{cfg}': comm_hook='fp61' is unknown (did you mean fp16?)",
        ),
        ("backend: ddp\n", ["--micro-batch-size", "0"], "micro_batch_size=0 must be >= 1"),
        (
            "",
            ["--rdzv-endpoint", "127.0.0.1:abc"],
            "--rdzv-endpoint='127.0.0.1:abc' has port 'abc'",
        ),
        (
            "",
            ["--rdzv-endpoint", "127.0.0.1:70000"],
            "--rdzv-endpoint='127.0.0.1:70000' has port '70000'",
        ),
        ("", ["--rdzv-endpoint", "127.0.0.1"], "--rdzv-endpoint='127.0.0.1' must be HOST:PORT"),
    ],
)
def test_bad_settings_stop_before_any_process_starts(tmp_path, yaml_text, flags, message):
    cfg = write(tmp_path / "cfg.yaml", yaml_text)
    out = tmp_path / "out"
    out.mkdir()
    proc = gradsync(
        "launch", "--nproc-per-node", "2", "--config", str(cfg), *flags, str(SCRIPT), str(out)
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradsync: error: "), proc.stderr
    assert message.format(cfg=cfg) in lines[0]
    assert not list(out.iterdir())  # no worker ran


def test_a_directory_as_the_script_is_named_as_such(tmp_path):
    proc = gradsync("launch", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"gradsync: error: script {str(tmp_path)!r} is a directory; give the path of your training "
        "script inside it (or -m module.name to run a module)"
    )


@pytest.mark.parametrize("flag", ["--nproc-per-node", "--nnodes"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_process_counts_below_one_are_rejected_by_the_parser(flag, value):
    proc = gradsync("launch", flag, value, str(SCRIPT))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"argument {flag}: {value} must be >= 1" in proc.stderr


def test_the_launcher_sets_omp_threads_for_the_workers_when_unset(monkeypatch):
    """The CPUs this process may use (affinity; cgroup quota and SLURM_CPUS_PER_TASK where
    set), split over the node's processes."""
    import gradsync.launch.cluster

    launcher = Launcher(LaunchConfig(script=str(SCRIPT), nproc_per_node=2))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.setattr(gradsync.launch.cluster, "cgroup_cpus", lambda *a, **k: None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert launcher.thread_env() == {"OMP_NUM_THREADS": "4"}
    assert "  OMP_NUM_THREADS=4" in launcher.describe().splitlines()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert launcher.thread_env() == {"OMP_NUM_THREADS": "1"}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stays
    assert launcher.thread_env() == {}


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"


@pytest.mark.multiprocess
def test_the_readme_example_prints_no_warning_and_shows_learning():
    """The README's first command (its launch part), with nothing set in the environment."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GRADSYNC_") and k != "OMP_NUM_THREADS"
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradsync",
            "launch",
            "--nproc-per-node",
            "2",
            "--gradient-accumulation-steps",
            "4",
            str(EXAMPLE),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "warning" not in out.lower(), out
    summary = [line for line in proc.stdout.splitlines() if line.startswith("held-out loss ")]
    assert len(summary) == 1, proc.stdout
    first, last = (float(v) for v in summary[0].split()[2:5:2])
    assert last < first / 5, summary[0]


@pytest.mark.multiprocess
def test_the_example_checkpoints_in_the_background_and_resumes(tmp_path):
    """examples/train.py --checkpoints: the first run saves every 5 steps in the background
    (keep_last=2); a second run resumes from the newest and finishes the same 24 steps."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    cmd = [
        sys.executable,
        "-m",
        "gradsync",
        "launch",
        "--nproc-per-node",
        "2",
        "--gradient-accumulation-steps",
        "4",
        str(EXAMPLE),
        "--checkpoints",
        str(tmp_path),
    ]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-15", "step-20"]
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"resumed from {tmp_path / 'step-20'} at step 20" in second.stdout, second.stdout
    assert "done: 24 optimizer steps" in second.stdout


def test_numpy_is_a_base_dependency():
    """torch warns at import ("Failed to initialize NumPy") where numpy is missing."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    names = [
        d.split(">")[0].split("=")[0].split("<")[0].strip()
        for d in pyproject["project"]["dependencies"]
    ]
    assert "numpy" in names


def test_the_reported_rank_is_the_one_that_exited_not_the_one_the_launcher_stopped():
    """torchrun SIGTERMs the other workers once one exits; that stop may be timestamped first."""
    from gradsync.launch.failures import first_cause

    class Failure:
        def __init__(self, exitcode: int, timestamp: float, signal: str = "") -> None:
            self.exitcode, self.timestamp, self.local_rank = exitcode, timestamp, 0
            self.error_file_data = None
            self._signal = signal

        def signal_name(self) -> str:
            return self._signal

    assert first_cause({0: Failure(-15, 1.0, "SIGTERM"), 1: Failure(3, 2.0)})[0] == 1
    assert first_cause({0: Failure(-9, 2.0, "SIGKILL"), 1: Failure(-15, 1.0, "SIGTERM")})[0] == 0


@pytest.mark.multiprocess
def test_a_forked_worker_starts_and_ends_as_a_fresh_interpreter_would(tmp_path):
    """The same script under --start-method exec (the default) and fork: the same arguments,
    ``__main__``, ``sys.path[0]``, stop-signal handlers, signal mask and thread count (the
    launcher's, set after the copy's torch was imported), a session of its own, output
    written through, NumPy draws that differ between the ranks, the same trained step, exit
    handlers run after the threads, and rank 1's exception reported the same way; the copies
    share no store with the agent. Then a forked launch whose workers all end by
    ``sys.exit()`` succeeds."""
    script = SCRIPT.with_name("start_state.py")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GRADSYNC_") and k != "OMP_NUM_THREADS"
    }

    def launch(method: str, mode: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
        out = tmp_path / f"{method}-{mode}"
        out.mkdir()
        return out, subprocess.run(
            [
                sys.executable,
                "-m",
                "gradsync",
                "launch",
                "--nproc-per-node",
                "2",
                "--start-method",
                method,
                str(script),
                str(out),
                mode,
            ],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )

    states = {}
    for method in ("exec", "fork"):
        out, proc = launch(method, "raise")
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "gradsync: rank 1 (local rank 1) failed (exit code 1)" in proc.stderr, proc.stderr
        assert "ValueError: rank 1 raises after its step, on purpose" in proc.stderr
        assert "Traceback" in proc.stderr and "Terminating process" not in proc.stderr
        assert [p.read_text() for p in sorted(out.glob("exit*"))] == ["after the thread"] * 2, (
            proc.stderr
        )
        draws = [p.read_text() for p in sorted(out.glob("draw*"))]
        assert len(draws) == 2 and draws[0] != draws[1]
        states[method] = reports(out)
    for method, ranks in states.items():
        assert [state.pop("argv") for state in ranks] == [
            [str(tmp_path / f"{method}-raise"), "raise"]
        ] * 2
    exec_, fork = states["exec"], states["fork"]
    # the copies keep no connection to the agent's store, whose thread names each peer
    assert [s.pop("agent_store") for s in fork] == ["False"] * 2
    assert [s.pop("agent_store") for s in exec_] == ["True"] * 2
    assert fork == exec_
    for state in fork:
        assert state["name"] == "__main__" and state["own_session"] and state["written_through"]
        assert state["path0"] == str(script.parent) and state["blocked"] == []
        assert (
            state["handlers"]["SIGTERM"] == "0"
            and state["handlers"]["SIGINT"] == "default_int_handler"
        )
        assert state["omp"] is not None and state["threads"] == int(state["omp"])
    out, proc = launch("fork", "exit")  # torchrun's agent alone would wait for these forever
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [p.read_text() for p in sorted(out.glob("exit*"))] == ["after the thread"] * 2
