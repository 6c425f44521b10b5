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
import math
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradsync import extensions
from gradsync._util import human_bytes
from gradsync.errors import ConfigError
from gradsync.verify.recorder import (
    ENV_RECORD,
    ENV_REPLAY,
    ENV_STEPS,
    mismatched_readers,
    params_file,
    read_meta,
)

#: The module the launched and the reference run load as an extension (records or replays).
RECORDER = "gradsync.verify.recorder"

if TYPE_CHECKING:
    from gradsync.launch.torchrun import LaunchConfig, Launcher

#: Relative tolerance by the lowest precision in play (the parameters' dtype, or the mixed
#: precision's): fp32 differs only by the order of the gradient sums; bf16 / fp16 also by
#: a gradient reduction in that dtype (FSDP2's and DeepSpeed's reduce dtype), about 2-5
#: roundoffs of the format (bf16: 2^-8 = 3.9e-3, fp16: 2^-11 = 4.9e-4).
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 2e-3}

#: Exit statuses: the runs agree; they do not; it could not be verified.
EXACT, DIFFERS, UNVERIFIABLE = 0, 1, 2

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


@dataclass
class Step:
    """One optimizer step of the comparison.

    Args:
        step: the step (1 for the first).
        loss: the launched run's window loss (None when unknown).
        reference_loss: the reference's window loss.
        max_abs: the largest absolute difference of any parameter element.
        max_rel: ``||a - b||_2 / ||b||_2`` over every parameter (see ``param_difference``).
        off_boundary_bytes: the launched run's gradient reduction bytes (rank 0) off the
            boundary in the window (None: no audit).
        ok: within the tolerance.
        worst: the parameter that differs most relative to its own size.
    """

    step: int
    loss: float | None
    reference_loss: float | None
    max_abs: float
    max_rel: float
    off_boundary_bytes: int | None
    ok: bool
    worst: str = ""


@dataclass
class Report:
    """What ``verify`` found.

    Args:
        exit_code: 0 exact within the tolerance, 1 different, 2 could not be verified.
        verdict: one line saying which, and why.
        steps: the compared steps.
        tolerance: the relative tolerance used.
        precision: the precision it was chosen for (``"fp32"``, ``"bf16"``, ``"fp16"``).
        notes: what verification changed or could not control.
        title: the run described (script, backend, processes, k).
        folder: where the records are (kept with ``keep=True``).
    """

    exit_code: int
    verdict: str
    steps: list[Step] = field(default_factory=list)
    tolerance: float = TOLERANCE["fp32"]
    precision: str = "fp32"
    notes: list[str] = field(default_factory=list)
    title: str = ""
    folder: str | None = None

    def render(self) -> str:
        """The report as text: a title, the table, the notes and the verdict.

        Returns:
            Lines for a terminal.
        """
        lines = [f"gradsync verify: {self.title}"] if self.title else []
        if self.steps:
            head = (
                "step",
                "loss (launched)",
                "loss (1 process)",
                "max abs diff",
                "rel diff",
                "grad bytes off boundary",
                "verdict",
            )
            rows = [head] + [
                (
                    str(s.step),
                    _num(s.loss),
                    _num(s.reference_loss),
                    f"{s.max_abs:.2e}",
                    f"{s.max_rel:.2e}",
                    "-" if s.off_boundary_bytes is None else human_bytes(s.off_boundary_bytes),
                    "ok" if s.ok else "DIFFERS",
                )
                for s in self.steps
            ]
            widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
            lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
            lines.append(f"tolerance: {self.tolerance:g} relative ({self.precision})")
        lines += [f"note: {n}" for n in self.notes]
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.7g}"


# -- comparing two recorded runs ---------------------------------------------------------
def _precision(meta: Mapping[str, Any]) -> str:
    found = {str(meta.get("mixed_precision") or "no"), *map(str, meta.get("dtypes", []))}
    if "bf16" in found or "bfloat16" in found:
        return "bf16"
    if "fp16" in found or "float16" in found:
        return "fp16"
    return "fp32"


def _close(a: float | None, b: float | None, tol: float) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= tol * max(abs(b), 1e-12)


def param_difference(
    ours: Sequence[Mapping[str, Any]],
    theirs: Sequence[Mapping[str, Any]],
    names: Sequence[Sequence[str]],
) -> tuple[float, float, str]:
    """How far two lists of state dicts are apart, over the parameters.

    The relative difference is norm-wise over every parameter of every model,
    ``||a - b|| / ||b||``: an elementwise or per-tensor ratio would flag parameters whose
    gradient is zero up to roundoff (a key projection's bias under softmax), which Adam
    turns into updates of noise the size of the learning rate in both runs alike.

    Args:
        ours: one state dict per trained model.
        theirs: the same models' in the other run.
        names: per model, its parameters' names (buffers are left out: running statistics
            legitimately differ between N ranks and one process).

    Returns:
        (the largest absolute difference of any element, ``||a - b||_2 / ||b||_2`` over all
        parameters, the parameter whose own ``max |a - b| / max |b|`` is the largest).

    Raises:
        ConfigError: the two runs hold different models or parameters.
    """
    if len(ours) != len(theirs):
        raise ConfigError(
            f"the launched run trained {len(ours)} model(s), the reference {len(theirs)}"
        )
    max_abs = diff_sq = ref_sq = 0.0
    worst, worst_rel = "", -1.0
    for j, (a_state, b_state) in enumerate(zip(ours, theirs)):
        keys = [k for k in (names[j] if j < len(names) else a_state) if k in a_state]
        if not keys:
            keys = [k for k, v in a_state.items() if v.is_floating_point()]
        for key in keys:
            if key not in b_state:
                raise ConfigError(
                    f"parameter {key!r} of model {j + 1} is missing from the reference"
                )
            a = a_state[key].double()
            b = b_state[key].double()
            if a.shape != b.shape:
                raise ConfigError(
                    f"parameter {key!r} has shape {tuple(a.shape)} in the launched run "
                    f"and {tuple(b.shape)} in the reference"
                )
            if a.numel() == 0:
                continue
            d = (a - b).abs()
            top, scale = float(d.max()), float(b.abs().max())
            max_abs = max(max_abs, top)
            diff_sq += float((d * d).sum())
            ref_sq += float((b * b).sum())
            rel = top / scale if scale > 0 else (0.0 if top == 0 else math.inf)
            if rel > worst_rel:
                worst, worst_rel = (key if len(ours) == 1 else f"model {j + 1}: {key}"), rel
    if ref_sq == 0:
        return max_abs, 0.0 if diff_sq == 0 else math.inf, worst
    return max_abs, math.sqrt(diff_sq / ref_sq), worst


_NO_STEP = (
    "cannot verify: the script completed no optimizer step inside `with "
    "accel.accumulate(model):` (it never entered accumulate, or its data ended first)"
)


def compare(
    launched: str | os.PathLike[str], reference: str | os.PathLike[str], rtol: float | None = None
) -> Report:
    """Compare the records of the launched run and of the reference.

    Args:
        launched: the launched run's folder.
        reference: the reference's folder.
        rtol: the relative tolerance (default: ``TOLERANCE`` by precision).

    Returns:
        The report (its title and notes about the runs are left to ``verify``).
    """
    import torch

    run, ref = read_meta(launched), read_meta(reference)
    precision = _precision(run)
    tol = rtol if rtol is not None else TOLERANCE[precision]
    report = Report(UNVERIFIABLE, "", tolerance=tol, precision=precision)
    for meta in (run, ref):
        if meta.get("unverifiable"):
            report.verdict = f"cannot verify: {meta['unverifiable']}"
            return report
    if not run.get("rows"):
        report.verdict = _NO_STEP
        return report
    names = run.get("param_names", [])
    rows_ref = {r["step"]: r for r in ref.get("rows", [])}
    first_bad = None
    for row in run["rows"]:
        n = row["step"]
        if n not in rows_ref:
            break
        ours = torch.load(Path(launched) / params_file(n), weights_only=False)
        theirs = torch.load(Path(reference) / params_file(n), weights_only=False)
        max_abs, max_rel, worst = param_difference(ours, theirs, names)
        loss, ref_loss = row.get("loss"), rows_ref[n].get("loss")
        ok = max_rel <= tol and _close(loss, ref_loss, tol)
        report.steps.append(
            Step(n, loss, ref_loss, max_abs, max_rel, row.get("off_boundary_bytes"), ok, worst)
        )
        if not ok and first_bad is None:
            first_bad = n
    if not report.steps:
        report.verdict = "cannot verify: the reference completed no optimizer step"
        return report
    wanted = int(run.get("steps_wanted", len(report.steps)))
    if len(report.steps) < wanted:
        report.notes.append(
            f"the script stopped after {len(report.steps)} of the {wanted} "
            "optimizer steps asked for (its data ran out): those are compared"
        )
    drawn = ref.get("rng_drawn") or []
    if first_bad is None:
        report.exit_code = EXACT
        report.verdict = (
            f"the launched run equals one process on the same global windows for "
            f"{len(report.steps)} optimizer step(s), within {tol:g} (exit 0)"
        )
        if drawn:
            report.notes.append(
                f"the training loop draws random numbers ({', '.join(drawn)}), yet the runs agree"
            )
    elif drawn:
        report.exit_code = UNVERIFIABLE
        report.verdict = (
            f"cannot verify: the script is not deterministic: its training loop draws random "
            f"numbers ({', '.join(drawn)} generator) in the forward, the loss or between the "
            f"micro-steps, which N processes and one process draw differently; the runs differ "
            f"from step {first_bad} on, which says nothing about gradsync. Make the step "
            "deterministic (e.g. draw noise in the dataset, whose batches verify replays) (exit 2)"
        )
    elif (moved := _first_lr_difference(run["rows"], rows_ref, first_bad)) is not None:
        report.exit_code = DIFFERS
        report.verdict = _schedule_verdict(run, first_bad, *moved)
    else:
        report.exit_code = DIFFERS
        report.verdict = (
            f"the launched run differs from one process from step {first_bad} on (beyond "
            f"{tol:g}; most in {report.steps[first_bad - 1].worst or 'the window loss'}): the update is not the global window's mean; look for a loss or "
            "gradient that depends on the rank or the world size, or a model changed outside "
            "gradsync (exit 1)"
        )
    return report


def _first_lr_difference(
    rows: Sequence[Mapping[str, Any]], reference: Mapping[int, Mapping[str, Any]], until: int
) -> tuple[int, float, float] | None:
    """The first step, up to ``until``, after which the two runs' learning rates differ, and
    the first differing rate of each (launched, reference); None when they agree (or were
    not recorded)."""
    for row in rows:
        n = row["step"]
        if n > until or n not in reference:
            return None
        ours, theirs = row.get("lr"), reference[n].get("lr")
        if ours is None or theirs is None:
            return None
        if len(ours) != len(theirs):
            return n, math.nan, math.nan
        for a, b in zip(ours, theirs):
            if not _close(a, b, 1e-9):
                return n, a, b
    return None


def _rules_text(meta: Mapping[str, Any]) -> str:
    """The scheduler rule of the launched run's rule book, in words."""
    rules = meta.get("rules") or {}
    steps = int(rules.get("scheduler_steps", 1))
    if rules.get("name") == "accelerate":
        times = "once" if steps == 1 else f"{steps} times"
        return (
            f"under Accelerate's rules (gradsync.accelerate) the prepared scheduler steps "
            f"{times} per optimizer step on {meta.get('world', 1)} process(es), and the "
            f"reference steps it {times} too"
        )
    return (
        "under gradsync's rules the prepared scheduler steps once per optimizer step in both runs"
    )


def _schedule_verdict(
    meta: Mapping[str, Any], first_bad: int, step: int, a: float, b: float
) -> str:
    """The verdict when the runs' learning rates part before (or where) their parameters do:
    a rule of the schedule, not the synchronisation."""
    rates = "" if math.isnan(a) else f" ({a:.6g} launched, {b:.6g} in one process)"
    return (
        f"the launched run differs from one process from step {first_bad} on because the "
        f"learning rate differs after step {step}{rates}, not because of the gradient "
        f"synchronisation: {_rules_text(meta)}, so the schedule itself depends on the number "
        "of processes (sized with accelerator.num_processes, e.g. num_warmup_steps * "
        "num_processes, or stepped by hand per process); size it without the process count "
        "to verify the rest (exit 1)"
    )


def rules_note(meta: Mapping[str, Any]) -> str | None:
    """A note naming the rule book the two runs followed, when it is not gradsync's."""
    rules = meta.get("rules") or {}
    if rules.get("name") != "accelerate":
        return None
    return (
        f"{_rules_text(meta)}; each micro-batch's loss is divided by "
        "gradient_accumulation_steps and whole batches are dealt to the ranks, as Accelerate "
        "does (the reference replays them)"
    )


# -- running the script twice -------------------------------------------------------------
def _launch_config(
    script: str | LaunchConfig, args: Sequence[str], launch: Mapping[str, Any] | None
) -> LaunchConfig:
    from gradsync.launch.torchrun import LaunchConfig

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
        return done(Report(UNVERIFIABLE, _NO_STEP, title=title))
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
