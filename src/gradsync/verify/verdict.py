"""`gradsync verify`'s verdict: the launched run's records against the one-process
reference's, step by step, and the report (gradsync.verify.runner runs both)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradsync._support.util import human_bytes
from gradsync.errors import ConfigError
from gradsync.verify import compression as comm
from gradsync.verify.records import params_file, read_meta

#: Relative tolerance by the lowest precision in play (the parameters' dtype, or the mixed
#: precision's): fp32 differs only by the order of the gradient sums; bf16 / fp16 also by
#: a gradient reduction in that dtype (FSDP2's and DeepSpeed's reduce dtype), about 2-5
#: roundoffs of the format (bf16: 2^-8 = 3.9e-3, fp16: 2^-11 = 4.9e-4).
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 2e-3}

#: Exit statuses: the runs agree; they do not; it could not be verified.
EXACT, DIFFERS, UNVERIFIABLE = 0, 1, 2


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
        ok: within the tolerance (a step not judged: its window loss is finite).
        worst: the parameter that differs most relative to its own size.
        judged: compared with one process (False: a compressed update one process does
            not compute, PowerSGD's; shown, not judged).
    """

    step: int
    loss: float | None
    reference_loss: float | None
    max_abs: float
    max_rel: float
    off_boundary_bytes: int | None
    ok: bool
    worst: str = ""
    judged: bool = True


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
                    ("ok" if s.ok else "DIFFERS")
                    if s.judged
                    else ("approx." if s.ok else "NOT FINITE"),
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


NO_STEP = (
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
    precision = comm.precision(run, _precision(run))
    tol = rtol if rtol is not None else TOLERANCE[precision]
    hook = comm.hook(run)
    shown = precision if hook == "no" else f"{precision}, comm_hook={hook}"
    report = Report(UNVERIFIABLE, "", tolerance=tol, precision=shown)
    if (hook_note := comm.note(run, tol)) is not None:
        report.notes.append(hook_note)
    for meta in (run, ref):
        if meta.get("unverifiable"):
            report.verdict = f"cannot verify: {meta['unverifiable']}"
            return report
    if not run.get("rows"):
        report.verdict = NO_STEP
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
        judged = comm.judged(run, n)
        ok = max_rel <= tol and _close(loss, ref_loss, tol) if judged else comm.finite(loss)
        report.steps.append(
            Step(
                n,
                loss,
                ref_loss,
                max_abs,
                max_rel,
                row.get("off_boundary_bytes"),
                ok,
                worst,
                judged,
            )
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
    other_cause = first_bad is not None and (
        bool(drawn) or _first_lr_difference(run["rows"], rows_ref, first_bad) is not None
    )
    if hook != "no" and not other_cause:
        return _compressed_verdict(report, hook, first_bad)
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


def _compressed_verdict(report: Report, hook: str, first_bad: int | None) -> Report:
    """The verdict of a run with a comm_hook (unless the random draws or the schedule
    explain a difference): what was judged, at which tolerance, and the exact check."""
    judged = [s for s in report.steps if s.judged]
    exact = "run with --comm-hook no for an exact check"
    if first_bad is not None and not report.steps[first_bad - 1].judged:
        report.exit_code = DIFFERS
        report.verdict = (
            f"the launched run's window loss is not finite at step {first_bad} under "
            f"comm_hook={hook!r} (a low-rank approximation there, not compared with one "
            f"process); {exact} of the synchronisation (exit 1)"
        )
        return report
    if first_bad is not None:
        report.exit_code = DIFFERS
        report.verdict = (
            f"with comm_hook={hook!r}, the launched run differs from one process from step "
            f"{first_bad} on, beyond {report.tolerance:g} (the compression's tolerance; most "
            f"in {report.steps[first_bad - 1].worst or 'the window loss'}); {exact}: it says "
            "whether the synchronisation itself or the compression departs (exit 1)"
        )
        return report
    if not judged:
        report.exit_code = UNVERIFIABLE
        report.verdict = (
            f"cannot verify: comm_hook={hook!r} approximates the reduction of every compared "
            f"step (from step 1 on), which one process does not compute; {exact}, or a "
            "start_powerSGD_iter past --steps (exit 2)"
        )
        return report
    report.exit_code = EXACT
    rest = len(report.steps) - len(judged)
    first, last = len(judged) + 1, len(report.steps)
    span = f"step {first} is" if first == last else f"steps {first}-{last} are"
    after = (
        f"; {span} PowerSGD's approximation: the window loss is finite, not compared bitwise"
        if rest
        else ""
    )
    report.verdict = (
        f"with comm_hook={hook!r}, the launched run equals one process on the same global "
        f"windows for {len(judged)} optimizer step(s) within {report.tolerance:g}, the "
        f"tolerance the compression implies{after}; {exact} (exit 0)"
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
