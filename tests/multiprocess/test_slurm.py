"""SLURM for real: a one-node cluster on this machine (``scripts/slurm/local-cluster.sh``:
munged, slurmctld and slurmd on localhost, 2 CPUs, no cgroups), started once for this module
and stopped after it. Every SLURM test of the suite lives in this module, so under
``pytest -n 2 --dist loadgroup`` (tests/conftest.py) one worker runs them all against the one cluster.

``srun -n 2 python train.py`` (one task per process, nothing else) and ``sbatch`` of the
docs' one-node script (``srun --ntasks-per-node=1 gradsync launch --nproc-per-node 2
train.py``) each train one 2-rank group equal to one process; ``srun -n 2 gradsync launch``
(two launches on one node: 4 workers) is refused in one line before anything trains.

Needs Debian's slurm-wlm and munge (``bash scripts/test.sh`` installs them when it runs as
root) and root (the daemons run as root); skipped otherwise, with the reason. To run the
tests against a cluster already started with ``local-cluster.sh``, set
``GRADSYNC_TEST_SLURM_CONF`` to its slurm.conf: nothing is started or stopped then.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.cluster import TRAIN, assert_one_group_equal_to_one_process, clean_env, reports

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "scripts" / "slurm" / "local-cluster.sh"
ONE_NODE = ROOT / "scripts" / "slurm" / "one-node.sbatch"  # shown in docs/clusters.md
SRUN_NAME = "gradsync-test"  # the tests' srun jobs, cancelled by name after a timeout


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """SLURM_CONF of a running one-node cluster: started here unless given, stopped after."""
    given = os.environ.get("GRADSYNC_TEST_SLURM_CONF")
    if given:
        yield {"SLURM_CONF": given}
        return
    missing = [
        tool
        for tool in ("munged", "slurmctld", "slurmd", "srun", "sbatch")
        if shutil.which(tool) is None
    ]
    if missing:
        pytest.skip(
            f"SLURM is not installed ({', '.join(missing)} not found): `bash scripts/test.sh` "
            "installs Debian's slurm-wlm and munge when it runs as root (scripts/slurm/install.sh)"
        )
    if os.geteuid() != 0:
        pytest.skip(
            "the local SLURM cluster runs its daemons as root (SlurmUser=root); run the tests "
            "as root, or start scripts/slurm/local-cluster.sh as root and set "
            "GRADSYNC_TEST_SLURM_CONF to its slurm.conf"
        )
    folder = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(
        ["bash", str(CLUSTER), "start", str(folder)], capture_output=True, text=True, timeout=120
    )
    if started.returncode != 0:
        logs = "\n".join(
            f"== {p.name}\n{p.read_text()[-2000:]}" for p in sorted((folder / "log").glob("*.log"))
        )
        pytest.fail(
            f"the local SLURM cluster did not start:\n{started.stdout}{started.stderr}\n{logs}"
        )
    try:
        yield {"SLURM_CONF": str(folder / "slurm.conf")}
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(folder)], capture_output=True, timeout=60)


def run(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """A SLURM client command; an srun job left behind by a timeout is cancelled."""
    try:
        return subprocess.run(
            args, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--name", SRUN_NAME], env=env, capture_output=True)
        raise


def sbatch(script: Path, env: dict[str, str], cwd: Path, timeout: float = 240) -> tuple[str, str]:
    """Submit ``script`` from ``cwd`` and wait for the job to end (polled every 0.2 s:
    ``sbatch --wait`` polls every 2 s and more); its final state and exit code."""
    submitted = run(["sbatch", "--parsable", "--time=5", str(script)], env, cwd)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    while True:
        shown = run(["scontrol", "-o", "show", "job", job], env, cwd, timeout=30).stdout
        state = re.search(r"JobState=(\S+)", shown)
        if state is not None and state.group(1) in ENDED:
            code = re.search(r"\bExitCode=(\S+)", shown)
            return state.group(1), code.group(1) if code else "?"
        if time.monotonic() > deadline:
            run(["scancel", job], env, cwd, timeout=30)
            raise AssertionError(f"job {job} did not end within {timeout} s: {shown}")
        time.sleep(0.2)


def train_py(folder: Path) -> Path:
    """``folder/train.py`` (what the scripts run from the submission folder): the tests'
    training job, writing to ``folder/out``, which is returned."""
    out = folder / "out"
    (folder / "train.py").write_text(
        f"import runpy, sys\nsys.argv = [{str(TRAIN)!r}, {str(out)!r}]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    return out


ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


def test_srun_two_tasks_train_one_group_equal_to_one_process(slurm, tmp_path):
    out = tmp_path / "out"
    proc = run(
        ["srun", "-n", "2", "--time=5", f"--job-name={SRUN_NAME}", "python", str(TRAIN), str(out)],
        clean_env(**slurm),
        tmp_path,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    got = assert_one_group_equal_to_one_process(
        out, local_ranks=[0, 1], local_main=[True, False], output=output
    )
    seen = [r["environment"] for r in got]  # what each task read before the Accelerator
    assert [
        (e["scheduler"], e["rank"], e["world_size"], e["local_rank"], e["local_world_size"])
        for e in seen
    ] == [("slurm", 0, 2, 0, 2), ("slurm", 1, 2, 1, 2)]
    assert seen[0]["master_addr"] == seen[1]["master_addr"] == socket.gethostname().split(".")[0]
    assert seen[0]["master_port"] == seen[1]["master_port"] is not None
    assert seen[0]["job_id"] == seen[1]["job_id"] is not None and seen[0]["problem"] is None


def test_sbatch_of_the_docs_one_node_script_trains_one_group_equal_to_one_process(slurm, tmp_path):
    out = train_py(tmp_path)
    text = ONE_NODE.read_text()
    assert "srun --ntasks-per-node=1 gradsync launch --nproc-per-node 2 train.py" in text
    state, code = sbatch(ONE_NODE, clean_env(**slurm), tmp_path)
    output = "".join(p.read_text() for p in tmp_path.glob("train-*.out"))  # the job's output
    assert (state, code) == ("COMPLETED", "0:0"), output
    got = assert_one_group_equal_to_one_process(
        out, local_ranks=[0, 1], local_main=[True, False], output=output
    )
    # The workers were started by the launch (torchrun's variables), one node of two processes.
    assert [(r["environment"]["scheduler"], r["environment"]["local_world_size"]) for r in got] == [
        ("torchrun", 2),
        ("torchrun", 2),
    ]


def test_srun_of_two_launches_on_one_node_is_one_line_and_nothing_trains(slurm, tmp_path):
    out = train_py(tmp_path)
    proc = run(
        [
            "srun",
            "-n",
            "2",
            "--time=5",
            f"--job-name={SRUN_NAME}",
            "gradsync",
            "launch",
            "--nproc-per-node",
            "2",
            "train.py",
        ],
        clean_env(**slurm),
        tmp_path,
        timeout=120,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("gradsync: error:")]
    assert len(errors) == 2, proc.stderr  # one line from each task
    assert all(
        "SLURM started 2 tasks on 1 node(s)" in e
        and "srun --ntasks-per-node=1 gradsync launch" in e
        for e in errors
    ), proc.stderr
    assert reports(out) == [] and not out.exists()


PREEMPT = ROOT / "tests" / "scripts" / "preempt_train.py"


def job_state(job: str, env: dict[str, str], cwd: Path) -> dict[str, str]:
    shown = run(["scontrol", "-o", "show", "job", job], env, cwd, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", shown))


def wait_for(what: str, check: object, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.2)


def test_usr1_saves_requeues_and_the_job_resumes_bitwise(slurm, tmp_path):
    """SLURM's preemption notice (``scancel --signal=USR1``, as ``--signal=USR1@90`` sends it):
    the launch forwards it, every rank saves at the next window, rank 0 requeues the job, and
    the requeued job resumes from the checkpoint and ends bitwise equal to a run never
    stopped. A requeued job waits out a BeginTime (~2.5 min on this one-node cluster): the
    test moves its start to now once SLURM has requeued it."""
    env = clean_env(**slurm)
    reference = tmp_path / "reference"
    done = subprocess.run(
        [
            str(Path(env["PATH"].split(os.pathsep)[0]) / "gradsync"),
            "launch",
            "--nproc-per-node",
            "2",
            str(PREEMPT),
            str(reference),
        ],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=tmp_path,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "preempt.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --job-name=gradsync-requeue\n#SBATCH --nodes=1\n"
        "#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=2\n#SBATCH --requeue\n"
        "#SBATCH --open-mode=append\n#SBATCH --output=train-%j.out\n"
        "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK\n"
        f"srun --ntasks-per-node=1 gradsync launch --nproc-per-node 2 {PREEMPT} {out} --requeue --slow 0.3\n"
    )
    submitted = run(["sbatch", "--parsable", "--time=5", str(script)], env, tmp_path)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    try:
        wait_for("the first run's start", lambda: (out / "started-0").exists())
        signalled = run(["scancel", "--signal=USR1", job], env, tmp_path, timeout=30)
        assert signalled.returncode == 0, signalled.stderr
        wait_for("the requeue", lambda: job_state(job, env, tmp_path).get("Restarts", "0") == "1")

        def started_again() -> bool:
            state = job_state(job, env, tmp_path).get("JobState")
            if state == "RUNNING" or state in ENDED:
                return True  # (PENDING, REQUEUED, COMPLETING: not yet)
            run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env, tmp_path, timeout=30)
            return False

        wait_for("the requeued job's start", started_again, timeout=240)
        wait_for(
            "the requeued job's end",
            lambda: job_state(job, env, tmp_path).get("JobState") in ENDED,
            timeout=180,
        )
    finally:
        run(["scancel", job], env, tmp_path, timeout=30)
    state = job_state(job, env, tmp_path)
    output = "".join(p.read_text() for p in tmp_path.glob("train-*.out"))
    assert (state.get("JobState"), state.get("ExitCode")) == ("COMPLETED", "0:0"), output
    saved = sorted(p.name for p in (out / "ckpt").iterdir())
    assert len(saved) == 1 and saved[0].startswith("step-"), saved
    assert f"SIGUSR1 received; saved {out / 'ckpt' / saved[0]}, job requeued, exiting" in output, (
        output
    )
    assert "sent it to the 2 worker process(es)" in output, output
    assert (out / "runs.txt").read_text() == f"run 1 resumed from {out / 'ckpt' / saved[0]}\n"
    import torch

    ref = torch.load(reference / "final.pt", weights_only=True)
    final = torch.load(out / "final.pt", weights_only=True)
    assert ref.keys() == final.keys() and all(torch.equal(ref[k], final[k]) for k in ref), {
        k: float((ref[k] - final[k]).abs().max()) for k in ref
    }
