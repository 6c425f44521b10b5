"""fp16, activation checkpointing and torch.compile under gradsync, against the same loops by hand.

    python benchmarks/amp_compile.py [--quick] [--out DIR]

Starts a 2-rank DDP group (gloo on CPU, nccl on GPUs) through ``torch.distributed.run
--standalone`` and measures, in the same run:

* fp16      gradsync (``mixed_precision="fp16"``, k micro-steps per window) vs the loop by
            hand: autocast, ``no_sync()`` on k-1 micro-steps, ``torch.amp.GradScaler``.
* compile   gradsync with ``compile=True`` vs ``torch.compile(DDP(model))`` driven by hand
            with ``no_sync()``.
* memory    one micro-step of the benchmark model with and without
            ``activation_checkpointing``: the bytes autograd keeps for backward (counted
            by a saved-tensors hook, each storage once), and on GPUs the peak allocated.

Each time row gives the median optimizer-step time of each loop over interleaved
repetitions (the two take turns, so drift on a shared machine hits both) and the median
over repetitions of gradsync / by hand within the repetition, with its range. Writes
``amp_compile.json`` and ``amp_compile.md`` to the output folder and prints the table. On a
busy machine run it under the shared lock: ``flock /tmp/gradsync-mp.lock python ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FULL = {
    "width": 512,
    "depth": 4,
    "features": 512,
    "micro_batch": 32,
    "k": 4,
    "steps_per_rep": 2,
    "reps": 15,
    "warmup": 3,
}
QUICK = {
    "width": 64,
    "depth": 2,
    "features": 64,
    "micro_batch": 8,
    "k": 4,
    "steps_per_rep": 1,
    "reps": 3,
    "warmup": 2,
}
TARGET = 1.02  # gradsync / by hand, time


# -- the worker (one rank) ------------------------------------------------------------
def _model(spec: dict[str, Any]) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.up = nn.Linear(width, 2 * width)
            self.down = nn.Linear(2 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(spec["features"], spec["width"])
            self.blocks = nn.ModuleList([Block(spec["width"]) for _ in range(spec["depth"])])
            self.head = nn.Linear(spec["width"], 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    return Net()


def _batches(spec: dict[str, Any], device: Any) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(spec["micro_batch"], spec["features"], generator=g).to(device),
            torch.randn(spec["micro_batch"], 8, generator=g).to(device),
        )
        for _ in range(8)
    ]


class _Gradsync:
    """The user's loop under gradsync: accumulate, backward, step (gated)."""

    def __init__(self, spec: dict[str, Any], **settings: Any) -> None:
        import torch

        from gradsync import Accelerator

        self.accel = Accelerator(backend="ddp", gradient_accumulation_steps=spec["k"], **settings)
        model = _model(spec)
        self.model, self.opt = self.accel.prepare(
            model, torch.optim.SGD(model.parameters(), lr=1e-4)
        )

    def micro(self, x: Any, y: Any, sync: bool) -> None:
        import torch.nn.functional as F

        with self.accel.accumulate(self.model):
            self.accel.backward(F.mse_loss(self.model(x), y))
            self.opt.step()
            self.opt.zero_grad()


class _ByHand:
    """The same loop written by hand: ``no_sync()`` off the boundary, optional fp16 autocast
    with a GradScaler, optional ``torch.compile`` of the DDP model."""

    def __init__(
        self, spec: dict[str, Any], device: Any, *, fp16: bool = False, compiled: bool = False
    ) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.k = spec["k"]
        model = _model(spec).to(device)
        self.ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.model = torch.compile(self.ddp) if compiled else self.ddp
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        self.scaler = torch.amp.GradScaler(device.type) if fp16 else None
        self.cast = (
            (lambda: torch.autocast(device.type, dtype=torch.float16))
            if fp16
            else contextlib.nullcontext
        )

    def micro(self, x: Any, y: Any, sync: bool) -> None:
        import torch.nn.functional as F

        with contextlib.nullcontext() if sync else self.ddp.no_sync(), self.cast():
            loss = F.mse_loss(self.model(x), y) / self.k
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        if sync:
            if self.scaler is None:
                self.opt.step()
            else:
                self.scaler.step(self.opt)
                self.scaler.update()
            self.opt.zero_grad()


def _time_pair(
    runners: dict[str, Any], batches: list[Any], spec: dict[str, Any]
) -> dict[str, list[float]]:
    """Per-optimizer-step times of each runner, interleaved repetitions, rotating order."""
    import torch
    import torch.distributed as dist

    def steps(runner: Any, n: int) -> list[float]:
        out = []
        for s in range(n):
            t0 = time.perf_counter()
            for i in range(spec["k"]):
                x, y = batches[(s * spec["k"] + i) % len(batches)]
                runner.micro(x, y, i == spec["k"] - 1)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return out

    for runner in runners.values():
        steps(runner, spec["warmup"])  # compiles, DDP's bucket rebuild
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for rep in range(spec["reps"]):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            dist.barrier()
            times[name].extend(steps(runners[name], spec["steps_per_rep"]))
    return times


def _saved_bytes(spec: dict[str, Any], device: Any, checkpointing: Any) -> dict[str, int]:
    """One micro-step of the model in one process: bytes kept for backward, and the peak."""
    import torch
    import torch.nn.functional as F

    from gradsync import Accelerator

    model = Accelerator(backend="single", activation_checkpointing=checkpointing).prepare(
        _model(spec)
    )
    x, y = _batches(spec, device)[0]
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.mse_loss(model(x), y)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out = {"saved_bytes": sum(b for ptr, b in seen.items() if ptr not in params)}
    loss.backward()
    if device.type == "cuda":
        out["peak_bytes"] = int(torch.cuda.max_memory_allocated(device) - base)
    return out


def worker(spec_path: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    batches = _batches(spec, device)
    result: dict[str, Any] = {"spec": spec, "device": str(device), "torch": torch.__version__}
    result["fp16"] = _time_pair(
        {
            "gradsync": _Gradsync(spec, mixed_precision="fp16"),
            "by_hand": _ByHand(spec, device, fp16=True),
        },
        batches,
        spec,
    )
    result["compile"] = _time_pair(
        {
            "gradsync": _Gradsync(spec, compile=True),
            "by_hand": _ByHand(spec, device, compiled=True),
        },
        batches,
        spec,
    )
    if rank == 0:
        result["memory"] = {
            "plain": _saved_bytes(spec, device, None),
            "checkpointed": _saved_bytes(spec, device, ["Block"]),
        }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# -- the parent ---------------------------------------------------------------------------
def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def report(ranks: list[dict[str, Any]], command: str) -> tuple[dict[str, Any], str]:
    spec = ranks[0]["spec"]
    rows: dict[str, Any] = {}
    n = spec["steps_per_rep"]
    for what in ("fp16", "compile"):
        # a step ends when the slower rank ends it: take each step's max over ranks
        per_step = {
            name: [max(ts) for ts in zip(*(r[what][name] for r in ranks))]
            for name in ("gradsync", "by_hand")
        }
        g, h = _median_ms(per_step["gradsync"]), _median_ms(per_step["by_hand"])
        # the ratio within each repetition (the two ran back to back), then its median:
        # the drift of a shared machine cancels within a repetition
        reps = [
            statistics.fmean(per_step["gradsync"][i : i + n])
            / statistics.fmean(per_step["by_hand"][i : i + n])
            for i in range(0, len(per_step["gradsync"]), n)
        ]
        ratio = statistics.median(reps)
        rows[what] = {
            "gradsync_ms": g,
            "by_hand_ms": h,
            "ratio": ratio,
            "ratio_range": [min(reps), max(reps)],
            "ratio_of_medians": g / h,
            "target": TARGET,
            "met": ratio <= TARGET,
            "steps": len(per_step["gradsync"]),
            "reps": len(reps),
        }
    memory = ranks[0]["memory"]
    rows["memory"] = memory
    summary = {
        "command": command,
        "spec": spec,
        "device": ranks[0]["device"],
        "torch": ranks[0]["torch"],
        "world_size": len(ranks),
        "rows": rows,
    }
    lines = [
        f"2-rank DDP on {ranks[0]['device']} (torch {ranks[0]['torch']}), k={spec['k']}, model: "
        f"{spec['depth']} residual blocks of width {spec['width']}, micro-batch {spec['micro_batch']}",
        "",
        "| row | gradsync (median step) | by hand (median step) | gradsync / by hand: median over repetitions [range] | target |",
        "|---|---|---|---|---|",
    ]
    labels = {
        "fp16": "fp16 step (autocast + scaler, no_sync)",
        "compile": "compiled model step (no_sync)",
    }
    for what, label in labels.items():
        r = rows[what]
        lo, hi = r["ratio_range"]
        lines.append(
            f"| {label} | {r['gradsync_ms']:.2f} ms | {r['by_hand_ms']:.2f} ms | "
            f"{r['ratio']:.3f} [{lo:.2f}-{hi:.2f}] | <= {TARGET} ({'met' if r['met'] else 'missed'}) |"
        )
    plain, ckpt = memory["plain"], memory["checkpointed"]
    lines += [
        "",
        "| one micro-step | no checkpointing | activation_checkpointing=['Block'] | ratio |",
        "|---|---|---|---|",
        f"| bytes saved for backward | {plain['saved_bytes']} | {ckpt['saved_bytes']} | "
        f"{ckpt['saved_bytes'] / plain['saved_bytes']:.3f} |",
    ]
    if "peak_bytes" in plain:
        lines.append(
            f"| peak allocated (GPU) | {plain['peak_bytes']} | {ckpt['peak_bytes']} | "
            f"{ckpt['peak_bytes'] / plain['peak_bytes']:.3f} |"
        )
    return summary, "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="a small model and few repetitions (smoke run)"
    )
    p.add_argument(
        "--out", default="benchmark-results", help="output folder (default: ./benchmark-results)"
    )
    p.add_argument("--reps", type=int, default=None, help="interleaved repetitions")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    spec = dict(QUICK if args.quick else FULL)
    if args.reps:
        spec["reps"] = args.reps
    tmp = Path(tempfile.mkdtemp(prefix="gradsync-amp-bench-"))
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(Path(__file__).resolve()),
        "--worker",
        str(tmp / "spec.json"),
        str(tmp),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    files = [tmp / f"rank{r}.json" for r in range(2)]
    if not all(f.exists() for f in files):
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        return 1
    command = (
        "python benchmarks/amp_compile.py"
        + (" --quick" if args.quick else "")
        + (f" --reps {args.reps}" if args.reps else "")
    )
    summary, table = report([json.loads(f.read_text()) for f in files], command)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "amp_compile.json").write_text(json.dumps(summary, indent=1))
    (out / "amp_compile.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
