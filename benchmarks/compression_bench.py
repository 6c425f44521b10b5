"""The compression axis of the sync-overhead benchmark: what ``comm_hook`` saves on top of
deferral, and what it costs in step time, memory and loss.

    python benchmarks/sync_overhead.py --compression [--quick] [--out DIR]
    gradsync bench --compression                     (the same, from a checkout)

On 2 ranks (gloo on CPU, nccl on GPUs) every cell trains the sync-overhead benchmark's MLP
(4.2 M parameters) for the same N optimizer steps of k micro-batches on the same data, from
the same initial parameters, with SGD (momentum 0.9, lr 0.5: the loss falls by about a
fifth in the run) on a learnable target (a
fixed random linear teacher plus noise). Cells: ddp under ``defer`` and ``every_step`` with
comm_hook no, fp16, bf16, power_sgd rank 1 and rank 4 (``start_powerSGD_iter`` 2: plain
all-reduces for the first two optimizer steps), fsdp under ``defer`` with no, fp16, bf16.
DDP keeps its default buckets (more than one here: torch's PowerSGD hook alone hangs or aborts on gloo
with two or more; gradsync ends each bucket's reduction before the next bucket's hook there).

Per cell: the gradient bytes handed to the process group per optimizer step (gradsync's
audit; the median over the steps after the first two), the step time (median over the same
steps, rank 0), the peak memory above the window start (one more, untimed step under
benchmarks/peak_memory.py's probe, the highest rank), and the loss on a fixed evaluation set
after the N steps, beside the uncompressed cell of the same backend and policy. A hook a
backend cannot run here is its one-line refusal. Writes compression.{json,md,png} to --out.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from small_bench import QUICK_SIZES, SIZES, run_workers  # noqa: E402

LR = 0.5
POWER = {"start_powerSGD_iter": 2}
#: label -> the Accelerator's compression settings
HOOKS: dict[str, dict[str, Any]] = {
    "no": {},
    "fp16": {"comm_hook": "fp16"},
    "bf16": {"comm_hook": "bf16"},
    "power_sgd r1": {
        "comm_hook": "power_sgd",
        "comm_state_option": {**POWER, "matrix_approximation_rank": 1},
    },
    "power_sgd r4": {
        "comm_hook": "power_sgd",
        "comm_state_option": {**POWER, "matrix_approximation_rank": 4},
    },
}
GRID = [
    *(("ddp", "defer", hook) for hook in HOOKS),
    *(("ddp", "every_step", hook) for hook in HOOKS),
    *(("fsdp", "defer", hook) for hook in ("no", "fp16", "bf16")),
]
FULL = {"sizes": SIZES, "k": 8, "steps": 12, "eval_batches": 4}
QUICK = {"sizes": QUICK_SIZES, "k": 4, "steps": 5, "eval_batches": 2}
#: the goals at k = 8, against the uncompressed deferred run of the same backend
BYTES_GOAL = {"fp16": 0.55, "bf16": 0.55, "power_sgd r1": 0.10, "power_sgd r4": 0.10}
LOSS_GOAL = {"fp16": 0.01, "bf16": 0.01}


# -- one rank ------------------------------------------------------------------------------
def _data(sizes: Any, rank: int, count: int, device: Any) -> list[tuple[Any, Any]]:
    """``count`` micro-batches of (x, teacher(x) + noise); rank -1: the evaluation set."""
    import torch

    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(sizes.features, sizes.outputs, generator=teacher) / sizes.features**0.5
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(count):
        x = torch.randn(sizes.micro_batch, sizes.features, generator=g)
        y = torch.tanh(x @ w) + 0.05 * torch.randn(sizes.micro_batch, sizes.outputs, generator=g)
        out.append((x.to(device), y.to(device)))
    return out


def _cell(
    backend: str, policy: str, hook: str, spec: dict[str, Any], device: Any, rank: int
) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from bench_cells import Sizes
    from peak_memory import PeakMemory, no_gradients

    from gradsync import Accelerator, ConfigError

    sizes = Sizes(**spec["sizes"])
    k, steps = spec["k"], spec["steps"]
    out: dict[str, Any] = {"backend": backend, "policy": policy, "hook": hook}
    try:
        accel = Accelerator(
            backend=backend,
            gradient_accumulation_steps=k,
            sync_policy=policy,
            audit=True,
            **HOOKS[hook],
        )
    except ConfigError as err:
        return {**out, "refused": str(err)}
    model = sizes.model(seed=0)
    model, opt = accel.prepare(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    batches = _data(sizes, rank, k * (steps + 1), device)
    evaluation = _data(sizes, -1, spec["eval_batches"], device)
    rec = accel.audit
    assert rec is not None
    rec.clear()
    times = []
    for s in range(steps + 1):
        probe = PeakMemory(device) if s == steps else None  # the last step: untimed, probed
        if probe is not None:
            no_gradients(model)  # every cell's probed window starts without gradients
            probe.__enter__()
        t0 = time.perf_counter()
        for x, y in batches[s * k : (s + 1) * k]:
            with accel.accumulate(model):
                accel.backward(F.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
        if probe is not None:
            probe.__exit__(None, None, None)
            out["peak_bytes"] = probe.peak_bytes
        else:
            times.append(time.perf_counter() - t0)
    per_step = [sum(r.reduction_bytes for r in window) for window in rec.windows()]
    with torch.no_grad():
        loss = sum(float(F.mse_loss(model(x), y)) for x, y in evaluation) / len(evaluation)
        first = sizes.model(seed=0).to(device)
        initial = sum(float(F.mse_loss(first(x), y)) for x, y in evaluation) / len(evaluation)
    return {
        **out,
        "step_ms": statistics.median(times[2:]) * 1e3,
        "bytes_per_step": statistics.median(per_step[2:steps]),
        "bytes_first_steps": per_step[:2],
        "reductions_per_step": statistics.median(
            sum(r.reductions for r in window) for window in list(rec.windows())[2:steps]
        ),
        "off_boundary_bytes": sum(r.reduction_bytes for r in rec.records if not r.boundary),
        "eval_loss": loss,
        "initial_loss": initial,
    }


def worker(spec: dict[str, Any], work: Path) -> None:
    import torch
    import torch.distributed as dist

    from gradsync import audit

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available() and spec["device"] != "cpu"
    audit.register()
    dist.init_process_group(
        audit.AUDIT_BACKEND["cuda" if cuda else "cpu"], timeout=timedelta(seconds=300)
    )
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cells = []
    for backend, policy, hook in GRID:
        cell = _cell(backend, policy, hook, spec, device, rank)
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, cell.get("peak_bytes"))
        cell["peak_bytes"] = None if None in peaks else max(peaks)  # type: ignore[type-var]
        cells.append(cell)
        if rank == 0:
            what = cell.get("refused") or f"{cell['bytes_per_step']:.0f} B/step"
            print(f"[bench] {backend} {policy} {hook}: {what}", flush=True)
    if rank == 0:
        (work / "result.json").write_text(json.dumps({"cells": cells, "device": str(device)}))
    dist.barrier()
    dist.destroy_process_group()


# -- the result -----------------------------------------------------------------------------
def analyse(cells: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """Each cell beside its uncompressed one (same backend and policy) and ddp defer's; the
    goals at k = 8 checked on the cells they name."""
    base = {(c["backend"], c["policy"]): c for c in cells if c["hook"] == "no"}
    checks = []
    for c in cells:
        if "refused" in c:
            continue
        plain, deferred = base[(c["backend"], c["policy"])], base[(c["backend"], "defer")]
        c["bytes_vs_plain"] = c["bytes_per_step"] / plain["bytes_per_step"]
        c["bytes_vs_deferred"] = c["bytes_per_step"] / deferred["bytes_per_step"]
        c["step_vs_plain"] = c["step_ms"] / plain["step_ms"]
        c["loss_vs_plain"] = (c["eval_loss"] - plain["eval_loss"]) / plain["eval_loss"]
        goal = BYTES_GOAL.get(c["hook"])
        name = f"{c['backend']} {c['policy']} {c['hook']}"
        if goal is not None and c["policy"] == "defer" and k == 8:
            ok = c["bytes_vs_deferred"] <= goal
            checks.append({"check": f"{name}: bytes / uncompressed deferred", "target": f"<= {goal}",
                           "value": c["bytes_vs_deferred"], "pass": ok})  # fmt: skip
        loss_goal = LOSS_GOAL.get(c["hook"])
        if loss_goal is not None and k == 8:
            ok = abs(c["loss_vs_plain"]) <= loss_goal
            checks.append({"check": f"{name}: final loss vs uncompressed", "target": "within 1 %",
                           "value": c["loss_vs_plain"], "pass": ok})  # fmt: skip
    return checks


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        f"## comm_hook composed with deferral ({meta['device']}, 2 ranks, k={meta['k']}, "
        f"{meta['steps']} optimizer steps)",
        "",
        f"Model: {meta['model']}. Command: `{meta['command']}`.",
        "",
        "| backend | policy | comm_hook | KiB reduced/step | vs uncompressed | vs uncompressed "
        "deferred | ms/step | step vs uncompressed | peak MiB | eval loss | loss vs uncompressed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["cells"]:
        head = f"| {c['backend']} | {c['policy']} | {c['hook']} |"
        if "refused" in c:
            lines.append(f"{head} refused: {c['refused']} |||||||")
            continue
        peak = c["peak_bytes"] / 2**20 if c["peak_bytes"] is not None else None
        lines.append(
            f"{head} {c['bytes_per_step'] / 1024:.1f} | {c['bytes_vs_plain']:.3f}x | "
            f"{c['bytes_vs_deferred']:.3f}x | {c['step_ms']:.1f} | {c['step_vs_plain']:.2f}x | "
            f"{_f(peak, '{:.1f}')} | {c['eval_loss']:.5f} | {c['loss_vs_plain']:+.2%} |"
        )
    lines += ["", "| check | value | target | pass |", "|---|---|---|---|"]
    for ch in result["checks"]:
        lines.append(f"| {ch['check']} | {ch['value']:.4g} | {ch['target']} | {ch['pass']} |")
    lines += ["", *result["notes"]]
    return "\n".join(lines) + "\n"


def chart(result: dict[str, Any], path: Path) -> None:
    """Bytes per optimizer step against the uncompressed deferred run (log scale), and the
    final loss against the uncompressed run of the same policy, per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in result["cells"] if "refused" not in c]
    labels = [f"{c['backend']} {c['policy']}\n{c['hook']}" for c in cells]
    colors = {"no": "0.6", "fp16": "tab:blue", "bf16": "tab:cyan"}
    color = [colors.get(c["hook"], "tab:orange") for c in cells]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8.4, 7.4), sharex=True)
    top.bar(range(len(cells)), [c["bytes_vs_deferred"] for c in cells], color=color)
    top.set_yscale("log")
    top.set_ylabel("bytes / optimizer step\n(x uncompressed deferred)")
    for goal, style in ((0.55, "--"), (0.1, ":")):
        top.axhline(goal, color="k", linestyle=style, linewidth=0.8)
    bottom.bar(range(len(cells)), [100 * c["loss_vs_plain"] for c in cells], color=color)
    bottom.axhline(0, color="k", linewidth=0.8)
    bottom.set_ylabel("final eval loss\nvs uncompressed (%)")
    bottom.set_xticks(range(len(cells)), labels, rotation=60, ha="right", fontsize=8)
    fig.suptitle(f"comm_hook with deferral, k={result['meta']['k']}: {result['meta']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(quick: bool, out: Path, command: str, device: str = "auto") -> int:
    import torch

    preset = QUICK if quick else FULL
    cuda = torch.cuda.is_available() and device != "cpu"
    spec = {**preset, "device": "cuda" if cuda else "cpu"}
    t0 = time.perf_counter()
    raw = run_workers(__file__, spec, "[bench] compression axis: 2 ranks")
    if raw is None:
        return 1
    sizes = preset["sizes"]
    numel = sizes["features"] * sizes["width"] + sizes["width"]
    numel += sizes["depth"] * (sizes["width"] ** 2 + sizes["width"])
    numel += sizes["width"] * sizes["outputs"] + sizes["outputs"]
    cells = raw["cells"]
    result: dict[str, Any] = {
        "meta": {
            "command": command,
            "device": "cuda/nccl" if cuda else "cpu/gloo",
            "k": preset["k"],
            "steps": preset["steps"],
            "model": f"MLP {sizes['features']}->{sizes['width']} x{sizes['depth']} blocks "
            f"->{sizes['outputs']}, {numel} parameters, micro-batch {sizes['micro_batch']}, "
            f"SGD lr {LR} momentum 0.9, fp32",
            "torch": torch.__version__,
        },
        "cells": cells,
        "notes": [
            "PowerSGD sends the plain gradients for its first 2 optimizer steps "
            "(start_powerSGD_iter=2); bytes and times are the medians of the steps after.",
            "On gloo FSDP2's reduce-scatter is carried out as an all-reduce: the bytes are its "
            "payload.",
        ],
    }
    first = next(c for c in cells if "initial_loss" in c)
    result["notes"].append(
        f"Eval loss of the initial parameters: {first['initial_loss']:.5f} (every cell starts there)."
    )
    result["checks"] = analyse(cells, preset["k"])
    out.mkdir(parents=True, exist_ok=True)
    chart(result, out / "compression.png")
    result["meta"]["seconds"] = round(time.perf_counter() - t0, 1)
    table = markdown(result)
    (out / "compression.json").write_text(json.dumps(result, indent=1))
    (out / "compression.md").write_text(table)
    print(table)
    return 0 if all(c["pass"] for c in result["checks"]) else 1
