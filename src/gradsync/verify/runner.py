"""``gradsync verify``: is this script, launched this way, exactly one process on the same
global windows?

It runs the script twice, for ``steps`` optimizer steps each:

1. as ``gradsync launch`` would (the same flags, any backend and world size), recording
   every batch each rank's prepared loaders read, every trained model's full parameters at
   the start and after each step, the window losses and the audit's gradient bytes;
2. as the reference: one process on the ``single`` backend whose window ``w`` holds the
   same k x N micro-batches the N ranks read in window ``w`` (replayed by the prepared
   loaders in (micro-step, rank) order), starting from the launched run's initial
   parameters; on an N-D mesh with tensor parallelism N is the data-parallel size R x S
   (the ranks of one tensor-parallel group read the same micro-batches, checked before the
   reference runs) and the parameters are the DTensors' full tensors;

then compares them step by step (``Report``). The in-process side is
``gradsync.verify.recorder``.

    from gradsync.verify.runner import verify
    report = verify("train.py", ["--epochs", "1"], launch={"nproc_per_node": 2, "backend": "fsdp"})
    print(report.render()); raise SystemExit(report.exit_code)
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradsync import extensions
from gradsync.errors import ConfigError
from gradsync.verify.records import (
    ENV_RECORD,
    ENV_REPLAY,
    ENV_STEPS,
    mismatched_readers,
    read_meta,
)
from gradsync.verify.verdict import NO_STEP, UNVERIFIABLE, Report, compare, rules_note

#: The module the launched and the reference run load as an extension (records or replays).
RECORDER = "gradsync.verify.recorder"

if TYPE_CHECKING:
    from gradsync.launch.config import LaunchConfig
    from gradsync.launch.torchrun import Launcher

#: Variables of a scheduler or of torchrun that would make the reference think it is one of
#: several processes.
_RANK_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MV2_", "PET_", "TORCHELASTIC_")
_RANK_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_WORLD_SIZE",
)


def _launch_config(
    script: str | LaunchConfig, args: Sequence[str], launch: Mapping[str, Any] | None
) -> LaunchConfig:
    from gradsync.launch.config import LaunchConfig

    if isinstance(script, LaunchConfig):
        return script
    return LaunchConfig(script=script, script_args=list(args), **dict(launch or {}))


def _one_process_env(launcher: Launcher) -> dict[str, str]:
    """The reference's variables: ours without any rank or scheduler variable, plus the
    settings the launch gives its workers (verification then forces its own)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_RANK_PREFIXES) and k not in _RANK_NAMES
    }
    env.update(
        {k: v for k, v in launcher.run_env().items() if k != "OMP_NUM_THREADS" or k in os.environ}
    )
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return env


def _run(argv: list[str], env: Mapping[str, str], log: Path, deadline: float) -> int | None:
    """Run ``argv`` in a session of its own, output into ``log``; its exit status, or None
    when it ran past ``deadline`` (it is then stopped, its children too)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, env=dict(env), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            return None
        finally:
            if proc.poll() is None:
                proc.kill()


def _why(log: Path) -> str:
    """The line of ``log`` that says why a run failed (gradsync's one-line report of the
    first failing rank, else the last line)."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    for line in lines:  # the worker's own line: "gradsync: rank R failed: Error: message"
        if line.startswith("gradsync: rank") and " failed: " in line:
            return line
    for line in reversed(lines):
        if line.startswith("gradsync: rank") or line.startswith("gradsync: error"):
            return line
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line
    return lines[-1] if lines else ""


def verify(
    script: str | LaunchConfig,
    args: Sequence[str] = (),
    *,
    launch: Mapping[str, Any] | None = None,
    steps: int = 3,
    max_seconds: float = 900.0,
    rtol: float | None = None,
    folder: str | os.PathLike[str] | None = None,
    python: str | None = None,
) -> Report:
    """Run ``script`` as launched and as one process on the same global windows, and compare.

    Args:
        script: the training script, or a whole ``LaunchConfig`` (``args`` and ``launch``
            are then ignored).
        args: the script's arguments.
        launch: ``LaunchConfig`` fields, e.g. ``{"nproc_per_node": 2, "backend": "fsdp"}``.
        steps: the optimizer steps to run and compare.
        max_seconds: how long both runs together may take.
        rtol: the relative tolerance (default: ``TOLERANCE`` by precision).
        folder: where to keep the records (default: a temporary folder, removed after).
        python: the interpreter of the reference (default: this one).

    Returns:
        The report; ``exit_code`` 0 exact, 1 different, 2 could not be verified.

    Raises:
        ConfigError: a launch that ``gradsync launch`` would refuse, a launch over several
            nodes, ``no_python``, or ``steps`` < 1.
    """
    from gradsync.launch.torchrun import Launcher

    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"--steps={steps!r} must be a whole number >= 1")
    config = _launch_config(script, args, launch)
    if config.no_python:
        raise ConfigError(
            "gradsync verify runs the script in one Python process as the reference; "
            "drop --no-python"
        )
    launcher = Launcher(config)
    if launcher.config.node_range[1] > 1:
        raise ConfigError(
            f"gradsync verify runs on one node; --nnodes={launcher.config.nnodes} "
            "asks for several: verify on one node with the same backend and settings"
        )
    world = launcher.config.world_size
    if folder is None:
        with tempfile.TemporaryDirectory(prefix="gradsync-verify-") as tmp:
            return _verify(launcher, world, steps, max_seconds, rtol, Path(tmp), python, keep=False)
    return _verify(launcher, world, steps, max_seconds, rtol, Path(folder), python, keep=True)


def _verify(
    launcher: Launcher,
    world: int,
    steps: int,
    max_seconds: float,
    rtol: float | None,
    folder: Path,
    python: str | None,
    keep: bool,
) -> Report:
    c = launcher.config
    python = python or sys.executable
    launched, reference = folder / "launched", folder / "reference"
    for path in (launched, reference):
        path.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + max_seconds
    title = f"{c.script} on {world} process(es), {steps} optimizer step(s)"

    def done(report: Report) -> Report:
        report.title = report.title or title
        report.folder = str(folder) if keep else None
        return report

    # 1. as launched
    pickled = folder / "launch.pickle"
    pickled.write_bytes(pickle.dumps(dataclasses.replace(c)))
    env = dict(os.environ)
    env.update({ENV_RECORD: str(launched), ENV_STEPS: str(steps), extensions.ENV: RECORDER})
    env.pop(ENV_REPLAY, None)
    code = _run(
        [python, "-m", "gradsync.verify.runner", str(pickled)],
        env,
        folder / "launched.log",
        deadline,
    )
    log_hint = f" (its output: {folder / 'launched.log'})" if keep else ""
    if code is None:
        return done(
            Report(
                UNVERIFIABLE,
                f"cannot verify: the launched run ran past --max-seconds={max_seconds:g}{log_hint}",
            )
        )
    run = read_meta(launched)
    if code != 0:
        return done(
            Report(
                UNVERIFIABLE,
                f"cannot verify: the script failed under gradsync launch "
                f"(exit {code}): {_why(folder / 'launched.log')}",
            )
        )
    if not run:
        return done(
            Report(UNVERIFIABLE, "cannot verify: the script never built a gradsync Accelerator")
        )
    data = int(run.get("world", world))  # the ranks that read distinct micro-batches
    title = (
        f"{c.script} on {run.get('backend')} with {world} process(es)"
        f"{f' ({data} data-parallel)' if data != world else ''} vs one process, "
        f"{steps} optimizer step(s)"
    )
    if run.get("unverifiable"):
        return done(Report(UNVERIFIABLE, f"cannot verify: {run['unverifiable']}", title=title))
    if not run.get("rows"):
        return done(Report(UNVERIFIABLE, NO_STEP, title=title))
    mismatch = mismatched_readers(launched)
    if mismatch is not None:
        return done(Report(UNVERIFIABLE, f"cannot verify: {mismatch}", title=title))
    # 2. the reference: one process on the same global windows
    ref_env = _one_process_env(launcher)
    ref_env.update(
        {
            ENV_RECORD: str(reference),
            ENV_STEPS: str(steps),
            ENV_REPLAY: str(launched),
            extensions.ENV: RECORDER,
        }
    )
    argv = [
        python,
        "-m",
        "gradsync.launch.worker",
        *(["-m"] if c.module else []),
        c.script,
        *c.script_args,
    ]
    code = _run(argv, ref_env, folder / "reference.log", deadline)
    if code is None:
        return done(
            Report(
                UNVERIFIABLE,
                f"cannot verify: the reference (one process) ran past "
                f"--max-seconds={max_seconds:g}",
                title=title,
            )
        )
    if code != 0:
        return done(
            Report(
                UNVERIFIABLE,
                f"cannot verify: the reference (one process) failed "
                f"(exit {code}): {_why(folder / 'reference.log')}",
                title=title,
            )
        )
    report = compare(launched, reference, rtol)
    report.title = title
    ks = run.get("k", [])
    if ks:
        k_text = str(ks[0]) if len(set(ks)) == 1 else ",".join(map(str, ks))
        report.title += f"; k={k_text} per process, {data * ks[0]} micro-batches per window"
    rules = rules_note(run)
    if rules is not None:
        report.notes.insert(0, rules)
    dropped = run.get("dropout", [])
    report.notes.insert(
        0,
        "dropout set to p=0 in both runs: " + ", ".join(dropped)
        if dropped
        else "no dropout module to switch off (functional dropout is not seen)",
    )
    return done(report)


def _launch_main(path: str) -> int:
    """Run the pickled LaunchConfig as ``gradsync launch`` would (the launched run)."""
    from gradsync.launch.torchrun import Launcher

    config = pickle.loads(Path(path).read_bytes())
    return Launcher(config).run()


if __name__ == "__main__":
    sys.exit(_launch_main(sys.argv[1]))
