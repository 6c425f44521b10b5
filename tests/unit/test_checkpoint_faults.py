"""Checkpoint writes that fail for real, in one process (backend "single"): a full tmpfs
(ENOSPC), synchronous and background (also when only a background commit's marker no longer
fits); a read-only bind mount (EROFS: saving fails, loading works); a user who may not write
there (EACCES) and a file-size limit (EFBIG), in a process run as another user; save_on_signal
onto a full disk exits 1 and is not requeued; an old checkpoint that keep_last cannot delete,
and a temporary folder that cannot be removed, are one warning each. (Every backend on 2 and
4 ranks: tests/multiprocess/test_checkpoint_faults.py.)"""

from __future__ import annotations

import errno
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import gradsync
from gradsync import CheckpointError
from gradsync.storage.failure import os_error
from gradsync.storage.folder import save_file

from harness.signals import run_until_signal
from scenarios.checkpoints import fresh, trained
from scenarios.faults import fill

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts filesystems (needs root)")
TESTS = Path(__file__).resolve().parents[1]


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def _umount(where: Path) -> None:
    """Unmount ``where``; a file a failed write left open (held by a traceback) is closed
    first, and what is still busy is detached (``umount -l``), never left mounted."""
    gc.collect()
    if subprocess.run(["umount", str(where)], check=False, capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (unmounted afterwards)."""
    where = tmp_path / "disk"
    where.mkdir()
    _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where))
    try:
        yield where
    finally:
        _umount(where)


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(a folder, a read-only bind mount of it)."""
    writable, ro = tmp_path / "rw", tmp_path / "ro"
    writable.mkdir()
    ro.mkdir()
    _mount("--bind", str(writable), str(ro))
    try:
        _mount("-o", "remount,ro,bind", str(ro))
        yield writable, ro
    finally:
        _umount(ro)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _loads_bitwise(folder: Path, want: dict[str, torch.Tensor]) -> bool:
    accel, model, *_ = fresh()
    accel.load_state(folder)
    return all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("background", [False, True], ids=["sync", "background"])
def test_a_full_disk_is_one_line_and_loses_nothing(small_disk, clean_env, background):
    accel, model, *_ = trained()
    good = accel.save_state(small_disk / "good")
    want = _weights(model)
    filler = fill(small_disk)
    with pytest.raises(CheckpointError) as err:
        accel.save_state(small_disk / "bad", keep_last=1, background=background)
        accel.wait_for_checkpoint()
    bad = f"'{small_disk / 'bad'}'"
    what = f"the background save of {bad}" if background else f"save_state({bad})"
    assert str(err.value) == (
        f"{what} failed: could not write "
        "model_0.pt: No space left on device (ENOSPC); nothing was saved there, the checkpoint "
        f"kept is '{good}'; free space there (or save elsewhere), then save again"
    )
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "good"]  # no temporary folder
    assert gradsync.latest_checkpoint(small_disk) == good
    assert _loads_bitwise(Path(good), want)
    filler.unlink()  # space again: training goes on and the next save succeeds
    accel.save_state(small_disk / "after", keep_last=1, background=background)
    accel.wait_for_checkpoint()
    assert sorted(p.name for p in small_disk.iterdir()) == ["after"]


def test_with_nothing_saved_before_the_checkpoint_kept_is_none(small_disk, clean_env):
    accel, *_ = trained()
    fill(small_disk)
    with pytest.raises(
        CheckpointError,
        match=r"could not write model_0.pt: No space left on device \(ENOSPC\); "
        r"nothing was saved there, the checkpoint kept is none; free space",
    ):
        accel.save_state(small_disk / "first")


def test_a_read_only_folder_loads_and_refuses_a_save(read_only, clean_env):
    writable, ro = read_only
    accel, model, *_ = trained()
    accel.save_state(writable / "good")
    assert _loads_bitwise(ro / "good", _weights(model))
    with pytest.raises(CheckpointError) as err:
        accel.save_state(ro / "bad")
    assert str(err.value) == (
        f"save_state('{ro / 'bad'}') failed: could not create '{ro / '.bad.gradsync-tmp'}': Read-only file "
        f"system (EROFS); nothing was saved there, the checkpoint kept is '{ro / 'good'}'; the filesystem "
        "is read-only: save into a writable folder"
    )
    with pytest.raises(
        CheckpointError, match=r"could not create .*\.good\.gradsync-tmp': Read-only file system"
    ):
        accel.save_state(ro / "good")  # replacing it: the one there is kept
    assert _loads_bitwise(ro / "good", _weights(model))


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A folder every user can reach (pytest's tmp_path is its owner's only)."""
    where = Path(tempfile.mkdtemp(prefix="gradsync-perm-"))
    os.chmod(where, 0o755)
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_no_permission_and_a_file_size_limit(shared_tmp, clean_env):
    """In a process run as "nobody": EACCES in a folder it may not write, EFBIG past its
    file-size limit (the checks of permissions and limits do not apply to root)."""
    tmp_path = shared_tmp
    folder, other = tmp_path / "root-only", tmp_path / "open"
    folder.mkdir()
    other.mkdir()
    os.chmod(other, 0o777)
    accel, model, *_ = trained()
    accel.save_state(folder / "good")
    torch.save(_weights(model), tmp_path / "expected.pt")
    env = {**os.environ, "HOME": str(other), "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    done = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            str(TESTS / "scripts" / "unwritable_save.py"),
            str(folder),
            str(other),
            str(tmp_path / "expected.pt"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=other,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["bitwise"]
    assert out["eacces"]["kind"] == "CheckpointError"
    assert out["eacces"]["error"] == (
        f"save_state('{folder / 'bad'}') failed: could not create '{folder / '.bad.gradsync-tmp'}': "
        f"Permission denied (EACCES); nothing was saved there, the checkpoint kept is '{folder / 'good'}'; "
        "this process may not write there: fix the folder's permissions or save elsewhere"
    )
    assert out["efbig"]["kind"] == "CheckpointError"
    assert out["efbig"]["error"] == (
        f"save_state('{other / 'big'}') failed: could not write model_0.pt: File too large (EFBIG); "
        "nothing was saved there, the checkpoint kept is none; raise this process's file-size "
        "limit (ulimit -f), then save again"
    )
    assert out["after"] == {"kind": "", "error": ""}
    assert sorted(p.name for p in other.iterdir() if not p.name.startswith(".")) == ["after"]


@pytest.fixture
def _handlers():
    saved = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, saved)


def test_save_on_signal_onto_a_full_disk_exits_1_and_is_not_requeued(
    small_disk, clean_env, capfd, _handlers
):
    clean_env.setenv("SLURM_JOB_ID", "4242")  # a requeue would be attempted (and warn: no scontrol)
    accel = gradsync.Accelerator(
        backend="single",
        gradient_accumulation_steps=2,
        seed=0,
        save_on_signal=small_disk / "preempted",
        requeue=True,
    )
    fill(small_disk)
    stop = run_until_signal(accel, signal.SIGTERM)
    assert stop.code == 1
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("gradsync:")]
    assert lines == [
        f"gradsync: SIGTERM received; save_state('{small_disk / 'preempted' / 'step-1'}') failed: could not "
        "write model_0.pt: No space left on device (ENOSPC); nothing was saved there, the checkpoint kept "
        "is none; free space there (or save elsewhere), then save again; not requeued, exiting with status 1"
    ], err
    assert "scontrol" not in err and "requeue" not in err.replace("not requeued", "")


def test_keep_last_warns_about_an_old_checkpoint_it_cannot_delete(tmp_path, clean_env):
    accel, *_ = trained()
    old = Path(accel.save_state(tmp_path / "a"))
    pinned = old / "pinned"  # a mount point inside it: rmtree cannot remove it (EBUSY)
    pinned.mkdir()
    _mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(pinned))
    try:
        with pytest.warns(
            RuntimeWarning,
            match=rf"could not remove an old checkpoint \(keep_last\) '{old}' "
            r"\(.*Device or resource busy.*\); delete it by hand",
        ):
            accel.save_state(tmp_path / "b", keep_last=1)
        assert gradsync.latest_checkpoint(tmp_path) == str(tmp_path / "b")
    finally:
        _umount(pinned)


def test_a_temporary_folder_that_cannot_be_removed_is_one_warning(tmp_path, clean_env):
    """A killed save's temporary folder holds a mount point: the next save of that name can
    neither clear nor remove it (EBUSY): one error line, one warning naming the folder."""
    accel, *_ = trained()
    tmp = tmp_path / ".next.gradsync-tmp"
    pinned = tmp / "pinned"
    pinned.mkdir(parents=True)
    _mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(pinned))
    try:
        with (
            pytest.warns(
                RuntimeWarning,
                match=rf"could not remove the unfinished checkpoint folder '{tmp}' "
                r"\(.*Device or resource busy.*\); delete it by hand",
            ),
            pytest.raises(
                CheckpointError,
                match=r"could not write 'pinned': Device or resource busy \(EBUSY\); "
                "nothing was saved there, the checkpoint kept is none$",
            ),
        ):
            accel.save_state(tmp_path / "next")
    finally:
        _umount(pinned)
    accel.save_state(tmp_path / "next")  # once it can be removed, the save goes on
    assert sorted(p.name for p in tmp_path.iterdir()) == ["next"]


def _free(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def test_a_background_commit_that_finds_the_disk_full_is_one_line(small_disk, clean_env, capfd):
    """The files fit, the marker rank 0's thread writes last does not: a disk left with
    exactly the room a trial save's files took, less the marker's page."""
    accel, *_ = trained()
    good = accel.save_state(small_disk / "good")
    before = _free(small_disk)
    accel.save_state(small_disk / "trial")
    needed = before - _free(small_disk)
    marker = (small_disk / "trial" / gradsync.checkpoint.MANIFEST).stat().st_size
    shutil.rmtree(small_disk / "trial")
    filler = fill(small_disk)
    page = os.statvfs(small_disk).f_frsize
    os.truncate(filler, filler.stat().st_size - (needed - -(-marker // page) * page))
    accel.save_state(small_disk / "bad", background=True)  # every file is written
    with pytest.raises(CheckpointError) as err:
        accel.wait_for_checkpoint()
    assert str(err.value) == (
        f"the background save of '{small_disk / 'bad'}' failed: could not write "
        "gradsync_checkpoint.json.part: No space left on device (ENOSPC); nothing was saved there, the "
        f"checkpoint kept is '{good}'; free space there (or save elsewhere), then save again"
    )
    assert f"gradsync: {err.value}" in capfd.readouterr().err  # said at once, too
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "good"]
    filler.unlink()
    accel.save_state(small_disk / "after", background=True)
    assert accel.wait_for_checkpoint() == str(small_disk / "after")


def test_what_torch_says_over_a_full_disk(small_disk):
    """torch.save onto a full disk by path: its legacy writer quotes the OS error, which is
    found by its words; its zip writer does not ("unexpected pos"), which is why gradsync
    writes through a file object of its own (whose OSError torch chains)."""
    big = {"w": torch.zeros(1 << 18)}
    filler = fill(small_disk)
    os.truncate(filler, filler.stat().st_size - (16 << 10))  # room for the pickle, not the tensor
    with pytest.raises(RuntimeError) as legacy:
        torch.save(big, small_disk / "legacy.pt", _use_new_zipfile_serialization=False)
    found = os_error(legacy.value)
    assert found is not None and found.errno == errno.ENOSPC
    with pytest.raises(RuntimeError) as by_path:
        torch.save(big, small_disk / "zip.pt")
    assert "unexpected pos" in str(by_path.value)
    with pytest.raises(OSError) as ours:
        save_file(big, small_disk / "ours.pt")
    assert (ours.value.errno, ours.value.filename) == (errno.ENOSPC, str(small_disk / "ours.pt"))


def test_a_failure_that_is_not_the_disks_names_its_exception(tmp_path, clean_env):
    accel, *_ = trained()
    accel.register_for_checkpointing(Unpicklable())
    with pytest.raises(
        CheckpointError,
        match=r"^save_state\('.*/x'\) failed: raised .*Error: .*lock.*; nothing was "
        r"saved there, the checkpoint kept is none$",
    ):
        accel.save_state(tmp_path / "x")
    assert list(tmp_path.iterdir()) == []


class Unpicklable:
    """A registered object whose state holds a lock."""

    def state_dict(self) -> dict[str, object]:
        return {"lock": threading.Lock()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        pass
