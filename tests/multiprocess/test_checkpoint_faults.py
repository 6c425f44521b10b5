"""A checkpoint write that fails for real (a full tmpfs: ENOSPC; one rank's file-size
limit: EFBIG; a read-only bind mount: EROFS) on DDP, FSDP2 (1-D, and the 2-D mesh on 4 ranks), DeepSpeed ZeRO 2 and 3 and
fairscale, synchronous and background saves: every rank raises the same one-line
CheckpointError naming the folder, the file, the OS error and the checkpoint kept, without
waiting for a collective timeout; the temporary folder is gone, keep_last deleted nothing,
the previous checkpoint loads bitwise (from the read-only mount), training goes on and the
next save succeeds. And save_on_signal onto a full disk under ``gradsync launch`` exits
non-zero without a requeue."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from harness import Scenario, run_scenarios
from harness.cluster import clean_env
from scenarios import faults

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (needs root)")

BACKENDS = {
    "ddp": ("ddp", None),
    "fsdp": ("fsdp", None),
    "zero2": ("deepspeed", 2),
    "zero3": ("deepspeed", 3),
    "fairscale": ("fairscale", None),
}
FAULTS = {
    "full": ("enospc", False),
    "full_background": ("enospc", True),
    "efbig_rank1": ("efbig:1", False),
}
WORDS = {"enospc": "No space left on device (ENOSPC)", "efbig:1": "File too large (EFBIG)"}
CASES = [f"{b}_{f}" for b in BACKENDS for f in FAULTS]
MESH_CASES = ["hsdp_full", "hsdp_efbig_rank3"]


@pytest.fixture(scope="module")
def disks():
    """A 4 MiB tmpfs, and the same seen through a read-only bind mount (unmounted afterwards)."""
    where = Path(tempfile.mkdtemp(prefix="gradsync-disk-"))
    disk, ro = where / "disk", where / "ro"
    disk.mkdir()
    ro.mkdir()
    mounted = []
    try:
        for args in (
            ["-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
            ["--bind", str(disk), str(ro)],
            ["-o", "remount,ro,bind", str(ro)],
        ):
            subprocess.run(["mount", *args], check=True)
            mounted.append(Path(args[-1]))
        yield disk, ro
    finally:
        for path in (ro, disk):  # the bind mount first
            if (
                path in mounted
                and subprocess.run(["umount", str(path)], check=False).returncode != 0
            ):
                subprocess.run(["umount", "-l", str(path)], check=False)  # never left mounted
        disk.rmdir()
        ro.rmdir()
        where.rmdir()


@pytest.fixture(scope="module")
def results(disks):
    disk, ro = disks
    scenarios = {
        f"{name}_{fault}": Scenario(
            faults.failed_save,
            backend=backend,
            stage=stage,
            fault=kind,
            background=background,
            folder=str(disk / f"{name}_{fault}"),
            read_only=str(ro / f"{name}_{fault}"),
        )
        for name, (backend, stage) in BACKENDS.items()
        for fault, (kind, background) in FAULTS.items()
    }
    return run_scenarios(scenarios, timeout=900)


@pytest.fixture(scope="module")
def mesh_results(disks):
    disk, ro = disks
    scenarios = {
        name: Scenario(
            faults.failed_save,
            backend="fsdp",
            mesh=[2, 2],
            fault=fault,
            folder=str(disk / name),
            read_only=str(ro / name),
        )
        for name, fault in (("hsdp_full", "enospc"), ("hsdp_efbig_rank3", "efbig:3"))
    }
    return run_scenarios(scenarios, nproc=4, timeout=900)


def _check(ranks: list[dict], words: str, victim: int | None, background: bool = False) -> float:
    """The assertions every case shares; returns the seconds from the failing save's start
    to the error on the last rank."""
    first = ranks[0]
    folder = str(Path(first["good"]).parent)
    for rank, r in enumerate(ranks):
        assert r["kind"] == "CheckpointError", (
            rank,
            r["kind"],
            r["error"],
        )  # not a CollectiveError
        assert r["error"] == first["error"], "every rank raises the same line"
        error = r["error"]
        assert "\n" not in error
        what = (
            f"the background save of '{folder}/bad'"
            if background
            else f"save_state('{folder}/bad')"
        )
        assert error.startswith(f"{what} failed: rank "), error
        assert words in error, error
        assert f"the checkpoint kept is '{first['good']}'" in error, error
        assert "could not write " in error, error
        assert r["listing_after_failure"] == ["good"], (
            r
        )  # no temporary folder; keep_last deleted nothing
        assert r["latest"] == first["good"]
        assert r["bitwise"], f"rank {rank}: the previous checkpoint does not load bitwise"
        assert r["listing_after_save"] == ["after"], r  # committed, then keep_last deleted good
        # good loaded (bitwise, above) through a read-only mount, where a save fails in one line
        ro = str(Path(folder).parent.parent / "ro" / Path(folder).name)
        assert r["read_only_error"] == (
            f"CheckpointError: save_state('{ro}/bad') failed: rank 0 could not create '{ro}/.bad.gradsync-tmp': "
            f"Read-only file system (EROFS); nothing was saved there, the checkpoint kept is '{ro}/good'; the "
            "filesystem is read-only: save into a writable folder"
        )
    if victim is not None:
        assert f"failed: rank {victim} could not write" in first["error"], first["error"]
    return max(r["failed_at"] for r in ranks) - min(r["started"] for r in ranks)


@pytest.mark.parametrize("case", CASES)
def test_a_failed_write_is_one_line_on_every_rank_and_loses_nothing(results, case):
    fault = case.partition("_")[2]
    kind, background = FAULTS[fault]
    seconds = _check(results[case], WORDS[kind], 1 if kind == "efbig:1" else None, background)
    print(f"{case}: the failing save raised on every rank {seconds:.2f} s after it started")


@pytest.mark.parametrize("case", MESH_CASES)
def test_on_the_2d_mesh_too(mesh_results, case):
    efbig = "efbig" in case
    words = "File too large (EFBIG)" if efbig else "No space left on device (ENOSPC)"
    seconds = _check(mesh_results[case], words, 3 if efbig else None)
    print(f"{case}: the failing save raised on every rank {seconds:.2f} s after it started")


def test_the_file_is_named(results):
    """The file that could not be written is named inside the checkpoint folder."""
    assert "could not write rng_rank1.pt: File too large" in results["ddp_efbig_rank1"][0]["error"]
    assert "could not write dcp_" in results["fsdp_efbig_rank1"][0]["error"]
    assert "could not write deepspeed/state/" in results["zero2_efbig_rank1"][0]["error"]


PREEMPT = Path(__file__).resolve().parents[1] / "scripts" / "preempt_train.py"


def test_save_on_signal_onto_a_full_disk_exits_non_zero_and_is_not_requeued(tmp_path):
    """``gradsync launch`` of 2 ranks with ``save_on_signal`` (and ``--requeue``) onto a full
    tmpfs: SIGUSR1 makes every rank try to save; the line is printed, the job exits
    non-zero and no requeue is tried."""
    out = tmp_path / "out"
    ckpt = out / "ckpt"
    ckpt.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(ckpt)], check=True)
    try:
        faults.fill(ckpt)
        env = clean_env()
        job = subprocess.Popen(
            [
                str(Path(env["PATH"].split(os.pathsep)[0]) / "gradsync"),
                "launch",
                "--nproc-per-node",
                "2",
                str(PREEMPT),
                str(out),
                "--requeue",
                "--slow",
                "0.3",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        try:
            deadline = time.monotonic() + 180
            while (
                not (out / "started-0").exists()
                and job.poll() is None
                and time.monotonic() < deadline
            ):
                time.sleep(0.2)
            job.send_signal(signal.SIGUSR1)
            output = job.communicate(timeout=180)[0]
        finally:
            if job.poll() is None:
                job.kill()
                job.communicate()
    finally:
        if subprocess.run(["umount", str(ckpt)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(ckpt)], check=False)
    assert job.returncode != 0, output
    line = re.search(
        r"gradsync: SIGUSR1 received; save_state\('([^']*)'\) failed: rank \d could not write \S+: "
        r"No space left on device \(ENOSPC\); nothing was saved there, the checkpoint kept is none; "
        r"free space there \(or save elsewhere\), then save again; not requeued, exiting with "
        r"status 1\n",
        output,
    )
    assert line is not None and line.group(1).startswith(f"{ckpt}/step-"), output
    assert "(no SLURM_JOB_ID): not requeued" not in output  # requeue() was never called
