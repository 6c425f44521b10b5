"""The sync-overhead benchmark: what deferral saves, what gradsync costs, against Accelerate.

    python benchmarks/sync_overhead.py [--quick] [--out DIR]       (or: gradsync bench ...)
    python benchmarks/sync_overhead.py --compression [--quick]     (the comm_hook axis)

Starts its own worker group (2 ranks, gloo on CPU / nccl on GPUs; this process is their
torchrun agent, ``elastic_launch``; on CPU the ranks are forks of it) and measures, per backend (ddp, fsdp, deepspeed
ZeRO 0 and 2, fairscale) and per accumulation k, five modes of the same training loop:

* naive       gradsync, ``sync_policy="every_step"``
* default     gradsync as ``Accelerator()`` gives it (no policy, no budget)
* gradsync    gradsync, the backend's best policy (set explicitly)
* manual      the loop by hand against the backend's own API (the floor for the wrapper)
* accelerate  Hugging Face Accelerate's ``accumulate`` (DDP path, where installed)

Then a one-process micro-benchmark of the wrapper alone. ``--compression`` runs the
compression axis instead (benchmarks/compression_bench.py: bytes per optimizer step, step
time, memory and final loss per backend x policy x comm_hook). Writes a Markdown table to
stdout and ``sync_overhead.{json,md,png}`` to the output folder. Run it under the shared
lock on a busy machine: ``flock /tmp/gradsync-mp.lock python benchmarks/sync_overhead.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "bench_worker.py"
BACKENDS = ("ddp", "fsdp", "deepspeed-0", "deepspeed-2", "fairscale")
MODES = ("naive", "default", "gradsync", "manual", "accelerate")

FULL = {
    "ks": [1, 4, 8],
    # ~4.2 M parameters (16 MiB of fp32 gradients), micro-batch 8: on one CPU core per rank
    # the all-reduce of the gradients costs about as much as a micro-step's compute.
    "sizes": {"width": 1024, "depth": 3, "features": 1024, "outputs": 16, "micro_batch": 8},
    "batches": 16,
    "steps_per_rep": 1,
    "reps": 24,
    "warmup": 2,
    "micro": {"reps": 9, "iters": 800},
}
QUICK = {
    "ks": [1, 4],
    "sizes": {"width": 64, "depth": 2, "features": 64, "outputs": 4, "micro_batch": 4},
    "batches": 8,
    "steps_per_rep": 2,
    "reps": 2,
    "warmup": 1,
    "micro": {"reps": 3, "iters": 200},
}
FORMULA = (
    "expected naive/gradsync = (k*c + r_naive*s + o) / (k*c + r_gradsync*s + o); c = compute "
    "per micro-step (median off-boundary micro-step under gradsync), s = the cost of one "
    "gradient sync as measured inside the step (median boundary micro-step - c - o under "
    "gradsync), o = one local optimizer step + zero_grad, r = gradient bytes reduced per "
    "optimizer step / gradient bytes of the model. expected_floor uses, for s, the raw time "
    "of one all-reduce of the gradient bytes on the same group instead (the floor: no overlap "
    "with backward, no bucket copies)"
)


# -- statistics -------------------------------------------------------------------
def _summary_ms(values_s: list[float]) -> dict[str, float]:
    ms = sorted(v * 1e3 for v in values_s)
    if not ms:
        return {}
    q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
    return {
        "median": statistics.median(ms),
        "q1": q[0],
        "q3": q[2],
        "min": ms[0],
        "max": ms[-1],
        "n": len(ms),
    }


def _expected(k: int, c: float, o: float, r_naive: float, r_gradsync: float, s: float) -> float:
    """naive/gradsync step time predicted from compute c, optimizer o and one sync s (FORMULA)."""
    return (k * c + r_naive * s + o) / (k * c + r_gradsync * s + o)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# -- the wrapper micro-benchmark (one process) ----------------------------------------
def micro_benchmark(reps: int, iters: int, k: int = 4) -> dict[str, Any]:
    """Per-micro-step cost of accumulate() + backward() + the gated optimizer calls."""
    import torch
    import torch.nn.functional as F

    from gradsync import Accelerator

    torch.set_num_threads(1)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)

    def model_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        return model, torch.optim.SGD(model.parameters(), lr=1e-3)

    x, y = torch.randn(4, 8), torch.randn(4, 1)

    bare_model, bare_opt = model_opt()

    def bare(n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            loss = F.mse_loss(bare_model(x), y) / k
            loss.backward()
            if (i + 1) % k == 0:
                bare_opt.step()
                bare_opt.zero_grad()
        return time.perf_counter() - t0

    accel = Accelerator(backend="single", gradient_accumulation_steps=k)
    gs_model, gs_opt = accel.prepare(*model_opt())

    def wrapped(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            with accel.accumulate(gs_model):
                loss = F.mse_loss(gs_model(x), y)
                accel.backward(loss)
                gs_opt.step()
                gs_opt.zero_grad()
        return time.perf_counter() - t0

    bare(iters // 4)
    wrapped(iters // 4)  # warm-up, a multiple of k
    bare_us, gs_us = [], []
    for r in range(reps):
        pair = [(bare, bare_us), (wrapped, gs_us)]
        for fn, sink in pair if r % 2 == 0 else reversed(pair):
            sink.append(fn(iters) / iters * 1e6)
    diffs = [g - b for g, b in zip(gs_us, bare_us)]
    return {
        "k": k,
        "model": "Linear(8, 1), micro-batch 4, SGD, backend 'single'",
        "micro_steps_per_rep": iters,
        "bare_us": statistics.median(bare_us),
        "gradsync_us": statistics.median(gs_us),
        "overhead_us": statistics.median(diffs),
        "overhead_us_min": min(diffs),
        "overhead_us_max": max(diffs),
        "target_us": 50.0,
    }


# -- the worker group ---------------------------------------------------------------
def _process_setups(backends: list[str]) -> None:
    """What each rank does first for its backends (DeepSpeed's imports), done once before the
    ranks are forked."""
    from bench_cells import CELLS

    for label in backends:
        cells = CELLS.get(label)
        if cells is not None and cells.process_setup is not None and cells.missing() is None:
            cells.process_setup()


def run_workers(
    spec: dict[str, Any], out: Path, nproc: int, timeout: float
) -> list[dict[str, Any]]:
    from small_bench import launch_ranks

    work = Path(tempfile.mkdtemp(prefix="gradsync-bench-"))
    (work / "spec.json").write_text(json.dumps(spec))
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.get("threads", 1)))
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    log_path = out / "worker.log"
    failed = launch_ranks(
        WORKER,
        "run",
        [str(work / "spec.json"), str(work)],
        nproc,
        work / "logs",
        timeout=timeout,
        quiet=False,
        before=lambda: _process_setups(spec["backends"]),
    )
    log_path.write_text(
        "".join(p.read_text(errors="replace") for p in sorted((work / "logs").rglob("*.log")))
        + failed
    )
    code: int | str = 1 if failed else 0
    results = []
    for rank in range(nproc):
        path = work / f"rank{rank}.json"
        if path.exists():
            results.append(json.loads(path.read_text()))
    if len(results) < nproc or code not in (0, "0"):
        tail = log_path.read_text()[-3000:]
        if len(results) < nproc:
            raise RuntimeError(
                f"the benchmark workers wrote no results (exit {code}); {log_path}:\n{tail}"
            )
        # A rank may abort at exit after writing everything (seen with DeepSpeed): the files decide.
        print(
            f"[bench] note: worker group exited with {code} after writing results; see {log_path}",
            flush=True,
        )
    return results


# -- turning raw timings into cells, ratios and checks -------------------------------------
def _memory(rank0: dict[str, Any] | None, ranks: list[dict[str, Any] | None]) -> dict[str, Any]:
    """A cell's memory fields: every rank's peak above the window start, the adapter's
    prediction and its reason (None where the step under the probe failed)."""
    if rank0 is None or any(r is None for r in ranks):
        return {"peak_mib_per_rank": None, "predicted_extra_mib": None, "policy_reason": None}
    predicted = rank0["predicted_extra_bytes"]
    return {
        "peak_mib_per_rank": [r["peak_bytes"] / 2**20 for r in ranks if r is not None],
        "predicted_extra_mib": predicted / 2**20 if predicted is not None else None,
        "policy_reason": rank0["reason"],
    }


def analyse(
    ranks: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    rank0 = ranks[0]
    cells, ratios = [], []
    notes = list(dict.fromkeys(n for r in ranks for n in r["notes"]))
    compute_ms: dict[str, float] = {}
    for group in rank0["groups"]:
        gs = group["modes"].get("gradsync")
        if gs and gs["off_s"]:
            compute_ms[group["backend"]] = statistics.median(gs["off_s"]) * 1e3
    for gi, group in enumerate(rank0["groups"]):
        label, k, grad_bytes = group["backend"], group["k"], group["grad_bytes"]
        a = statistics.median(group["allreduce_ms"])
        o = statistics.median(group["optimizer_ms"])
        med: dict[str, float] = {}
        reps: dict[str, list[float]] = {}
        red: dict[str, float] = {}
        for mode, m in group["modes"].items():
            stats = _summary_ms(m["step_s"])
            peaks = [r["groups"][gi]["modes"][mode] for r in ranks if gi < len(r["groups"])]
            med[mode] = stats["median"]
            reps[mode] = m["rep_median_s"]
            diff = m.get("param_diff_rel")
            if diff is not None and diff > 1e-3:
                notes.append(
                    f"{label} k={k} {mode}: final parameters differ from gradsync's by "
                    f"{diff:.2e} of the update: this mode did not train the same way"
                )
            red[mode] = m["audit"]["reduction_bytes"]
            cells.append(
                {
                    "backend": label,
                    "k": k,
                    "mode": mode,
                    "policy": m["policy"],
                    "step_ms": stats,
                    "micro_step_ms": {
                        "off_boundary": _summary_ms(m["off_s"]).get("median"),
                        "boundary": _summary_ms(m["on_s"]).get("median"),
                    },
                    "reductions_per_step": m["audit"]["reductions"],
                    "reduction_bytes_per_step": m["audit"]["reduction_bytes"],
                    "allgathers_per_step": m["audit"]["allgathers"],
                    "collective_bytes_per_step": m["audit"]["bytes"],
                    "reductions_per_micro_step": m["audit"]["reductions_per_micro_step"],
                    "param_diff_vs_gradsync": m.get("param_diff_rel"),
                    **_memory(m["memory"], [p["memory"] for p in peaks]),
                }
            )
        c = compute_ms.get(label)
        gs_modes = group["modes"].get("gradsync")
        boundary = (
            statistics.median(gs_modes["on_s"]) * 1e3 if gs_modes and gs_modes["on_s"] else None
        )
        sync_ms = max(0.0, boundary - (c or 0.0) - o) if boundary is not None else None
        row: dict[str, Any] = {
            "backend": label,
            "k": k,
            "allreduce_ms": a,
            "optimizer_ms": o,
            "compute_ms": c,
            "sync_in_step_ms": sync_ms,
            "grad_bytes": grad_bytes,
        }
        if "naive" in med and "gradsync" in med:
            r_n, r_g = red["naive"] / grad_bytes, red["gradsync"] / grad_bytes
            cc = c if c is not None else 0.0
            expected = _expected(k, cc, o, r_n, r_g, sync_ms if sync_ms is not None else a)
            measured = med["naive"] / med["gradsync"]
            row.update(
                {
                    "speedup": measured,
                    "speedup_expected": expected,
                    "speedup_vs_expected": measured / expected,
                    "speedup_expected_floor": _expected(k, cc, o, r_n, r_g, a),
                    "speedup_vs_expected_floor": measured / _expected(k, cc, o, r_n, r_g, a),
                    "bytes_gradsync_over_naive": _ratio(red["gradsync"], red["naive"]),
                    "bytes_target": 1 / k,
                }
            )
        if "naive" in med and "default" in med:
            row["speedup_default"] = med["naive"] / med["default"]
            if "speedup" in row:
                row["default_over_best_speedup"] = row["speedup_default"] / row["speedup"]
        for other in ("manual", "accelerate"):
            if "gradsync" in med and other in med:
                # Each repetition ran both modes back to back: the median of the paired ratios
                # cancels the drift of a shared machine better than a ratio of pooled medians.
                per_rep = [g / m for g, m in zip(reps["gradsync"], reps[other])]
                row[f"gradsync_over_{other}"] = statistics.median(per_rep)
                row[f"gradsync_over_{other}_pooled"] = med["gradsync"] / med[other]
                row[f"gradsync_over_{other}_rep_min"] = min(per_rep)
                row[f"gradsync_over_{other}_rep_max"] = max(per_rep)
        ratios.append(row)
    return cells, ratios, notes


def _gathers(cells: list[dict[str, Any]], label: str, k: int, mode: str) -> float | None:
    return next(
        (
            c["allgathers_per_step"]
            for c in cells
            if c["backend"] == label and c["k"] == k and c["mode"] == mode
        ),
        None,
    )


def checks(
    ratios: list[dict[str, Any]], micro: dict[str, Any], cells: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The acceptance targets (docs/benchmark.md), evaluated on this run."""
    out = []

    def add(name: str, value: float | None, target: str, ok: bool | None) -> None:
        out.append({"check": name, "value": value, "target": target, "pass": ok})

    for row in ratios:
        label, k = row["backend"], row["k"]
        if label in ("ddp", "fsdp", "fairscale") and k == 8 and "speedup" in row:
            b = row["bytes_gradsync_over_naive"]
            add(
                f"{label} k=8 bytes gradsync/naive",
                b,
                "1/k +-5%",
                b is not None and abs(b * k - 1) <= 0.05,
            )
            v = row["speedup_vs_expected"]
            if _gathers(cells, label, k, "naive") == _gathers(cells, label, k, "gradsync"):
                add(f"{label} k=8 speed-up / expected", v, "within 20%", abs(v - 1) <= 0.20)
            else:  # the formula counts gradient reductions only, not the all-gathers saved too
                add(
                    f"{label} k=8 speed-up / expected (the best mode also saves all-gathers)",
                    v,
                    ">= 0.80",
                    v >= 0.80,
                )
        if label == "ddp" and k in (4, 8):
            if "gradsync_over_manual" in row:
                v = row["gradsync_over_manual"]
                add(f"ddp k={k} gradsync/manual", v, "<= 1.02", v <= 1.02)
            if "gradsync_over_accelerate" in row:
                v = row["gradsync_over_accelerate"]
                add(f"ddp k={k} gradsync/accelerate", v, "<= 1.00", v <= 1.00)
    for row in ratios:
        if row["k"] == 8 and "default_over_best_speedup" in row:
            v = row["default_over_best_speedup"]
            add(f"{row['backend']} k=8 default speed-up / best", v, ">= 0.90", v >= 0.90)
    add(
        "wrapper overhead us per micro-step",
        micro["overhead_us"],
        "< 50",
        micro["overhead_us"] < 50,
    )
    return out


# -- output ------------------------------------------------------------------------------
def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _steps_range(result: dict[str, Any]) -> str:
    counts = sorted({c["step_ms"]["n"] for c in result["cells"] if "n" in c["step_ms"]})
    if not counts:
        return str(result["meta"]["timed_steps_per_mode"])
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"## gradsync sync-overhead benchmark ({result['meta']['device']}, {result['meta']['world_size']} ranks)",
        "",
        f"Model: {result['meta']['model']}. Times per optimizer step on rank 0, median [IQR] over "
        f"{_steps_range(result)} steps per cell; bytes and counts from gradsync.audit; "
        "'params vs gradsync' = |checksum(mode) - checksum(gradsync)| / |update of gradsync| after "
        "the same batches (~1e-6 is float rounding).",
        "",
        "| backend | k | mode | policy | ms/step median [IQR] | reductions/step | MiB reduced/step | all-gathers/step "
        "| peak MiB above the window start (minus naive's) | predicted extra MiB | params vs gradsync |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    naive = {
        (c["backend"], c["k"]): max(c["peak_mib_per_rank"])
        for c in result["cells"]
        if c["mode"] == "naive" and c["peak_mib_per_rank"]
    }
    for c in result["cells"]:
        s = c["step_ms"]
        peak = max(c["peak_mib_per_rank"]) if c["peak_mib_per_rank"] else None
        base = naive.get((c["backend"], c["k"]))
        memory = (
            "-"
            if peak is None
            else f"{peak:.1f}" + (f" ({peak - base:+.1f})" if base is not None else "")
        )
        lines.append(
            f"| {c['backend']} | {c['k']} | {c['mode']} | {c['policy']} | {s['median']:.1f} [{s['q1']:.1f}-{s['q3']:.1f}] "
            f"| {c['reductions_per_step']:.1f} | {c['reduction_bytes_per_step'] / 2**20:.1f} "
            f"| {c['allgathers_per_step']:.1f} | {memory} | {_f(c['predicted_extra_mib'], '{:.1f}')} "
            f"| {_f(c['param_diff_vs_gradsync'], '{:.1e}')} |"
        )
    lines += [
        "",
        "| backend | k | all-reduce ms (raw / in step) | compute ms/micro | naive/gradsync | naive/default (of best) | expected (floor) | bytes gradsync/naive (1/k) | gradsync/manual [rep range] | gradsync/accelerate [rep range] |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def rng(r: dict[str, Any], name: str) -> str:
        if name not in r:
            return "-"
        return f"{r[name]:.3f} [{r[name + '_rep_min']:.3f}-{r[name + '_rep_max']:.3f}]"

    for r in result["ratios"]:
        lines.append(
            f"| {r['backend']} | {r['k']} | {r['allreduce_ms']:.1f} / {_f(r.get('sync_in_step_ms'), '{:.1f}')} "
            f"| {_f(r['compute_ms'], '{:.1f}')} "
            f"| {_f(r.get('speedup'))} | {_f(r.get('speedup_default'))} ({_f(r.get('default_over_best_speedup'))}) "
            f"| {_f(r.get('speedup_expected'))} ({_f(r.get('speedup_expected_floor'))}) "
            f"| {_f(r.get('bytes_gradsync_over_naive'), '{:.3f}')} ({1 / r['k']:.3f}) "
            f"| {rng(r, 'gradsync_over_manual')} | {rng(r, 'gradsync_over_accelerate')} |"
        )
    m = result["micro"]
    lines += [
        "",
        f"Wrapper micro-benchmark ({m['model']}, k={m['k']}): bare loop {m['bare_us']:.1f} us, gradsync "
        f"{m['gradsync_us']:.1f} us per micro-step; overhead {m['overhead_us']:.1f} us "
        f"(reps {m['overhead_us_min']:.1f} to {m['overhead_us_max']:.1f}; target < 50 us).",
        "",
        f"Formula: {FORMULA}.",
        "",
        "Checks: "
        + "; ".join(
            f"{c['check']} = {_f(c['value'], '{:.3f}')} ({c['target']}: {'ok' if c['pass'] else 'MISSED'})"
            for c in result["checks"]
        ),
    ]
    if result["notes"]:
        lines += ["", "Notes:"] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def chart(result: dict[str, Any], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart: skipped, matplotlib is not installed (pip install 'gradsync[bench]')"
    labels = list(dict.fromkeys(c["backend"] for c in result["cells"]))
    if not labels:
        return "chart: skipped, no cell was measured"
    # One row per backend (time, bytes): about 920 px wide, legible in a documentation column.
    fig, axes = plt.subplots(len(labels), 2, figsize=(8.4, 0.6 + 2.6 * len(labels)), squeeze=False)
    for row, label in enumerate(labels):
        cells = [c for c in result["cells"] if c["backend"] == label]
        ks = sorted({c["k"] for c in cells})
        modes = [m for m in MODES if any(c["mode"] == m for c in cells)]
        width = 0.8 / max(1, len(modes))
        for j, mode in enumerate(modes):
            xs, ts, lo, hi, mib = [], [], [], [], []
            for i, k in enumerate(ks):
                cell = next((c for c in cells if c["k"] == k and c["mode"] == mode), None)
                if cell is None:
                    continue
                s = cell["step_ms"]
                xs.append(i + (j - (len(modes) - 1) / 2) * width)
                ts.append(s["median"])
                lo.append(s["median"] - s["q1"])
                hi.append(s["q3"] - s["median"])
                mib.append(cell["reduction_bytes_per_step"] / 2**20)
            color = f"C{MODES.index(mode)}"  # one color per mode in every panel
            axes[row][0].bar(xs, ts, width, yerr=[lo, hi], label=mode, capsize=2, color=color)
            axes[row][1].bar(xs, mib, width, label=mode, color=color)
        for col, what in ((0, "ms per optimizer step"), (1, "MiB reduced per step")):
            ax = axes[row][col]
            ax.set_xticks(range(len(ks)), [f"k={k}" for k in ks])
            ax.set_title(f"{label}: {what}", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i in range(len(MODES))]
    fig.legend(
        handles, list(MODES), loc="upper center", bbox_to_anchor=(0.5, 0.96), ncol=len(MODES)
    )
    fig.suptitle(
        f"gradsync sync overhead ({result['meta']['device']}, {result['meta']['world_size']} ranks)",
        y=0.995,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# -- main -------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sync_overhead", description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="tiny model, few steps, k in {1, 4} (< 1 min)"
    )
    p.add_argument(
        "--out", default="benchmark-results", help="output folder (default: ./benchmark-results)"
    )
    p.add_argument(
        "--backends", default=",".join(BACKENDS), help=f"comma list of {', '.join(BACKENDS)}"
    )
    p.add_argument("--ks", default=None, help="comma list of accumulation steps (default 1,4,8)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--reps", type=int, default=None, help="interleaved repetitions per cell")
    p.add_argument(
        "--steps-per-rep", type=int, default=None, help="optimizer steps per mode per repetition"
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument(
        "--device",
        choices=("auto", "cpu"),
        default="auto",
        help="cpu forces gloo where CUDA exists",
    )
    p.add_argument(
        "--timeout", type=float, default=None, help="seconds before the worker group is stopped"
    )
    p.add_argument(
        "--compression",
        action="store_true",
        help="the comm_hook axis instead: ddp defer/every_step x no/fp16/bf16/power_sgd rank 1 "
        "and 4, fsdp defer x no/fp16/bf16 (compression.{json,md,png})",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    t_start = time.perf_counter()
    if args.compression:
        sys.path.insert(0, str(HERE))
        import compression_bench

        words = argv if argv is not None else sys.argv[1:]
        command = shlex.join(["python", "benchmarks/sync_overhead.py", *words])
        return compression_bench.main(args.quick, Path(args.out), command, args.device)
    preset = dict(QUICK if args.quick else FULL)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad_modes = [m for m in modes if m not in MODES]
    if unknown or bad_modes:
        print(
            f"sync_overhead: error: --backends {unknown} / --modes {bad_modes} unknown; use "
            f"{', '.join(BACKENDS)} / {', '.join(MODES)}",
            file=sys.stderr,
        )
        return 2
    ks = [int(k) for k in args.ks.split(",")] if args.ks else preset["ks"]
    if any(k < 1 for k in ks):
        print(
            f"sync_overhead: error: --ks={args.ks} must be positive integers, e.g. 1,4,8",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    use_cuda = torch.cuda.is_available() and args.device != "cpu"
    spec = {
        "backends": backends,
        "ks": ks,
        "modes": modes,
        "sizes": preset["sizes"],
        "batches": preset["batches"],
        "warmup": preset["warmup"],
        "steps_per_rep": args.steps_per_rep or preset["steps_per_rep"],
        "reps": args.reps or preset["reps"],
        "device": "cuda" if use_cuda else "cpu",
        "threads": 1,
    }
    device = f"{'cuda/nccl' if use_cuda else 'cpu/gloo'}"
    print("[bench] wrapper micro-benchmark (one process, backend 'single') ...", flush=True)
    micro = micro_benchmark(**preset["micro"])
    print(
        f"[bench] wrapper: bare {micro['bare_us']:.1f} us, gradsync {micro['gradsync_us']:.1f} us per "
        f"micro-step, overhead {micro['overhead_us']:.1f} us",
        flush=True,
    )
    print(
        f"[bench] starting {args.nproc} ranks ({device}); backends {', '.join(backends)}; k {ks}",
        flush=True,
    )
    timeout = args.timeout or (300.0 if args.quick else 1500.0)
    ranks = run_workers(spec, out, args.nproc, timeout)
    cells, ratios, notes = analyse(ranks)
    measured = {c["backend"] for c in cells}
    for b in backends:
        if b not in measured and not any(n.startswith(b + ":") for n in notes):
            notes.append(f"{b}: no cell measured (see {out / 'worker.log'})")
    if "fsdp" in measured or "deepspeed-2" in measured:
        notes.append(
            "on gloo a reduce-scatter is carried out as a full all-reduce: sharded backends "
            "save no bytes on the wire here; on CPU the ratios, not the times, carry over to GPUs"
        )
    sizes = spec["sizes"]
    numel = ranks[0]["groups"][0]["grad_numel"] if ranks[0]["groups"] else None
    result: dict[str, Any] = {
        "meta": {
            "command": shlex.join(
                [
                    "python",
                    "benchmarks/sync_overhead.py",
                    *(argv if argv is not None else sys.argv[1:]),
                ]
            ),
            "quick": args.quick,
            "device": device,
            "world_size": args.nproc,
            "threads_per_rank": 1,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "model": (
                f"MLP {sizes['features']}->{sizes['width']} x{sizes['depth']} blocks ->{sizes['outputs']}, "
                f"{numel} parameters, micro-batch {sizes['micro_batch']}, SGD momentum, fp32"
            ),
            "backends": backends,
            "ks": ks,
            "modes": modes,
            "warmup_steps": spec["warmup"],
            "reps": spec["reps"],
            "steps_per_rep": spec["steps_per_rep"],
            "timed_steps_per_mode": spec["reps"] * spec["steps_per_rep"],
            "memory": (
                "per rank, one untimed optimizer step per mode after the warm-up: the peak above "
                "the window's start of "
                + (
                    "torch.cuda.max_memory_allocated"
                    if use_cuda
                    else "the live heap (glibc mallinfo2 uordblks + hblkhd) sampled after every op by a "
                    "TorchDispatchMode (benchmarks/peak_memory.py)"
                )
                + "; predicted: the adapter's "
                "deferral_extra_bytes for the policy it ran (what auto weighs against its budget)"
            ),
            "formula": FORMULA,
            "seconds": None,
        },
        "micro": micro,
        "cells": cells,
        "ratios": ratios,
        "notes": notes,
    }
    result["checks"] = checks(ratios, micro, cells)
    try:
        import accelerate

        result["meta"]["accelerate"] = accelerate.__version__
    except ImportError:
        result["meta"]["accelerate"] = None
    note = chart(result, out / "sync_overhead.png")
    if note:
        result["notes"].append(note)
    result["meta"]["seconds"] = round(time.perf_counter() - t_start, 1)
    table = markdown(result)
    (out / "sync_overhead.json").write_text(json.dumps(result, indent=1))
    (out / "sync_overhead.md").write_text(table)
    print()
    print(table)
    print(
        f"[bench] wrote {out / 'sync_overhead.json'}, {out / 'sync_overhead.md'}, {out / 'sync_overhead.png'} "
        f"in {result['meta']['seconds']} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
