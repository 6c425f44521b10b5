"""The pipeline row: pp 2 (2 ranks; ``--dp-shard 2``: pp 2 x dp_shard 2 on 4 ranks) under
``defer`` and ``every_step``, with GPipe and 1F1B, and what the estimate says of it.

    python benchmarks/pp_bench.py --out bench-out     # ~15 s on 2 cores (--dp-shard 2: ~35 s)

The sync-overhead benchmark's MLP as an ``nn.Sequential`` (Linear-Tanh blocks), cut in two at
``SPLIT`` (stage 0: the input layer and the first block, stage 1: the rest and the head), run by
``Accelerator(backend="fsdp", parallelism={"pp": 2, ...}, pp_schedule=..., pp_microbatches=M)``
with ``accel.pipeline_step`` on each micro-step, k micro-steps per optimizer step, under the
audit. Per cell (schedule x policy), from the timed optimizer steps:

* data-parallel bytes per optimizer step: the payload of the gradient reductions in the groups
  other than ``pp`` (deferral's 1/k), and of the rest there (FSDP2's parameter all-gathers,
  every schedule step under both policies), on rank 0 (none without a data-parallel dim);
* pp bytes per optimizer step: what the audit records on the ``pp`` group (the activations
  sent forward and their gradients back, sends and receives) on rank 0;
* ms per micro-step on rank 0 (median over the timed steps; the cells run in rounds, one
  optimizer step of each per round in a rotating order; the ratio of the two policies is the
  claim, the times are this machine's).

Then one more optimizer step counts, on every rank, the bytes of the tensors autograd saved for
backward (``torch.autograd.graph.saved_tensors_hooks``; each tensor once, by its own bytes, so
a part that is a view of the micro-batch counts its own rows; parameters and views of them left
out, as they are held anyway), and their peak: the activations a stage holds in
flight. Beside it, the estimate (``gradsync._plan.estimate._pipeline.Schedule``): the parts
the schedule holds at the peak on that stage x the saved bytes of one part, measured the same
way on one rank's stage alone (a copy of its modules, one part's forward and loss, no process
group): what ``gradsync plan --estimate --pp-saved-activation-bytes`` asks for.

Writes pp_bench.json and pp_bench.md to --out.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from small_bench import QUICK_SIZES, SIZES, parser, run_workers, write  # noqa: E402

SCHEDULES = ("GPipe", "1F1B")
POLICIES = ("every_step", "defer")
#: Where stage 1 begins in ``model()`` (depth 3: Linear-Tanh | 3 blocks | head): after the
#: input layer and the first block.
SPLIT = ["4"]


def model(sizes: dict[str, int], seed: int = 0) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    w = sizes["width"]
    layers: list[nn.Module] = [nn.Linear(sizes["features"], w), nn.Tanh()]
    for _ in range(sizes["depth"]):
        layers += [nn.Linear(w, w), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(w, sizes["outputs"]))


class SavedBytes:
    """The bytes of the tensors autograd keeps for backward, while they are kept: each storage
    counted once, from the forward that saved it until the last graph node holding it is
    freed (after its backward). Parameters, and views of them, are left out."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self.refs: dict[tuple[int, int], list[int]] = {}

    def hooks(self) -> Any:
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: Any) -> Any:
        from torch import nn

        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        # A tensor's own bytes (a part of a micro-batch is a view of it), each tensor once (a
        # Linear saves the Tanh's output that the Tanh saved too).
        nbytes = t.numel() * t.element_size()
        key = (t.data_ptr(), nbytes)
        if key in self.refs:
            self.refs[key][0] += 1
        else:
            self.refs[key] = [1, nbytes]
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        return _Held(self, key, t)

    @staticmethod
    def _unpack(held: Any) -> Any:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: tuple[int, int]) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.refs[key]


class _Held:
    def __init__(self, owner: SavedBytes, key: tuple[int, int], tensor: Any) -> None:
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self) -> None:
        self.owner.release(self.key)


def part_saved_bytes(sizes: dict[str, int], stage: int, part_rows: int) -> int:
    """One part's saved bytes on ``stage`` alone: a copy of its modules, one forward (and on
    the last stage the loss), no process group: what a user measures for the estimate."""
    import torch
    import torch.nn.functional as F

    seq = model(sizes)
    cut = int(SPLIT[0])
    part = seq[:cut] if stage == 0 else seq[cut:]
    width = sizes["features"] if stage == 0 else sizes["width"]
    x = torch.randn(part_rows, width, requires_grad=stage > 0)
    counter = SavedBytes()
    with counter.hooks():
        out = part(x)
        if stage == 1:
            out = F.mse_loss(out, torch.randn(part_rows, sizes["outputs"]))
    peak = counter.peak
    del out
    return peak


def _window(accel: Any, net: Any, opt: Any, batches: list[Any]) -> None:
    """One optimizer step: a window of ``len(batches)`` pipeline steps."""
    import torch.nn.functional as F

    for x, y in batches:
        with accel.accumulate(net):
            accel.pipeline_step(net, x, y, F.mse_loss)
            opt.step()
            opt.zero_grad()


def _groups(records: list[Any]) -> tuple[int, int, int]:
    """A window's (data-parallel reduction, other data-parallel, pp) bytes from the audit."""
    groups: dict[str, list[int]] = {}
    for rec in records:
        for label, entry in rec.to_dict()["groups"].items():
            g = groups.setdefault(label, [0, 0])
            g[0] += entry["bytes"]
            g[1] += entry["reduction_bytes"]
    pp = groups.pop("pp", [0, 0])[0]
    return sum(b[1] for b in groups.values()), sum(b[0] - b[1] for b in groups.values()), pp


class _Runner:
    """One schedule x policy: its Accelerator, stage, optimizer and the k micro-batches of a
    window (the same on every rank of a pipeline, one per data-parallel rank)."""

    def __init__(self, spec: dict[str, Any], schedule: str, policy: str) -> None:
        import torch

        from gradsync import Accelerator

        sizes, k = spec["sizes"], spec["k"]
        dims = {"pp": 2, **({"dp_shard": spec["dp_shard"]} if spec["dp_shard"] > 1 else {})}
        self.schedule, self.k = schedule, k
        self.accel = Accelerator(
            backend="fsdp",
            parallelism=dims,
            pp_split=SPLIT,
            pp_schedule=schedule,
            pp_microbatches=spec["microbatches"],
            sync_policy=policy,
            gradient_accumulation_steps=k,
            micro_batch_size=sizes["micro_batch"],
            audit=True,
            seed=0,
        )
        seq = model(sizes)
        opt = torch.optim.SGD(seq.parameters(), lr=1e-4, momentum=0.9)
        self.net, self.opt = self.accel.prepare(seq, opt)
        g = torch.Generator().manual_seed(1000 + self.accel.rank % spec["dp_shard"])
        self.batches = [
            (
                torch.randn(sizes["micro_batch"], sizes["features"], generator=g),
                torch.randn(sizes["micro_batch"], sizes["outputs"], generator=g),
            )
            for _ in range(k)
        ]
        self.micro_ms: list[float] = []
        self.measured: list[tuple[int, int, int]] = []
        self.summary = ""

    def window(self, timed: bool) -> None:
        """One optimizer step; ``timed``: its time and bytes are kept."""
        recorder = self.accel.audit
        assert recorder is not None
        start = len(recorder.records)
        t0 = time.perf_counter()
        _window(self.accel, self.net, self.opt, self.batches)
        if not timed:
            return
        self.micro_ms.append((time.perf_counter() - t0) * 1e3 / self.k)
        records = recorder.records[start:]
        assert len(records) == self.k and records[-1].boundary, "one window per step"
        self.measured.append(_groups(records))
        self.summary = recorder.summary(records)

    def result(self) -> dict[str, Any]:
        """The cell, with the saved activations' peak of one more window on every rank."""
        import torch.distributed as dist

        counter = SavedBytes()
        with counter.hooks():
            _window(self.accel, self.net, self.opt, self.batches)
        peaks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, (self.accel.mesh.get_local_rank("pp"), counter.peak))
        dp, other, pp = (statistics.mean(col) for col in zip(*self.measured))
        return {
            "schedule": self.schedule,
            "policy": self.accel.sync_policy,
            "micro_ms": statistics.median(self.micro_ms),
            "dp_bytes": dp,
            "gather_bytes": other,
            "pp_bytes": pp,
            "saved_peak": peaks,
            "summary": self.summary,
        }


def worker(spec: dict[str, Any], out: Path) -> None:
    """Every cell's runner, then warm-up and timed steps in rounds, one optimizer step of each
    cell per round in a rotating order (drift on a shared machine hits all cells alike)."""
    import json

    import torch

    torch.set_num_threads(1)
    sizes = spec["sizes"]
    runners = [_Runner(spec, s, p) for s in SCHEDULES for p in POLICIES]
    for step in range(spec["warmup"] + spec["steps"]):
        turn = step % len(runners)
        for runner in runners[turn:] + runners[:turn]:
            runner.window(timed=step >= spec["warmup"])
    cells = [runner.result() for runner in runners]
    rank = runners[0].accel.rank
    if rank == 0:
        for cell in cells:
            print(f"[pp] {cell['schedule']:<5} {cell['policy']:<10} {cell['summary']}", flush=True)
        rows = sizes["micro_batch"] // spec["microbatches"]
        part = [part_saved_bytes(sizes, s, rows) for s in (0, 1)]
        grad_bytes = sum(p.numel() for p in model(sizes).parameters()) * 4
        result = {"cells": cells, "spec": spec, "part_saved_bytes": part, "grad_bytes": grad_bytes}
        (out / "result.json").write_text(json.dumps(result))


def cluster(result: dict[str, Any], schedule: str, saved: float) -> Any:
    """The estimate's inputs for this run: ``gradsync plan --estimate --parallelism pp=2,...
    --pp-schedule S --pp-microbatches M --pp-activation-bytes A --pp-saved-activation-bytes B``
    with A stage 0's output per micro-step (fp32) and B one part's saved bytes."""
    from gradsync._plan.estimate import MeshCluster

    spec = result["spec"]
    sizes = spec["sizes"]
    return MeshCluster(
        result["grad_bytes"],
        result["grad_bytes"],
        pp=2,
        dp_shard=spec["dp_shard"],
        k=spec["k"],
        pp_activation_bytes=sizes["micro_batch"] * sizes["width"] * 4,
        pp_schedule=schedule,
        pp_microbatches=spec["microbatches"],
        pp_saved_activation_bytes=saved,
    ).check()


def ratios(result: dict[str, Any]) -> dict[str, Any]:
    by = {(c["schedule"], c["policy"]): c for c in result["cells"]}
    part = result["part_saved_bytes"]
    out: dict[str, Any] = {"schedules": {}, "acts": []}
    for s in SCHEDULES:
        every, defer = by[(s, "every_step")], by[(s, "defer")]
        out["schedules"][s] = {
            "dp_ratio": defer["dp_bytes"] / every["dp_bytes"] if every["dp_bytes"] else None,
            "pp_ratio": defer["pp_bytes"] / every["pp_bytes"],
            "ms_ratio": defer["micro_ms"] / every["micro_ms"],
            # the audit counts sends and receives; the estimate what rank 0 sends
            "pp_sent_over_estimate": every["pp_bytes"] / 2 / cluster(result, s, 0).pp_step_bytes(),
        }
        for stage, peak in sorted(set(map(tuple, every["saved_peak"]))):
            c = cluster(result, s, part[stage])
            guess = c.activation_bytes(stage)
            out["acts"].append(
                {
                    "schedule": s,
                    "stage": stage,
                    "measured": peak,
                    "parts": c.schedule().parts_held(stage),
                    "estimate": guess,
                    "ratio": peak / guess,
                }
            )
    return out


def checks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The pp row's targets, on this run."""
    r, k = result["ratios"], result["spec"]["k"]
    out = []
    for s, row in r["schedules"].items():
        if row["dp_ratio"] is not None:
            v = row["dp_ratio"]
            out.append(
                (f"{s} dp reduction bytes defer/every_step", v, "1/k +-5%", abs(v * k - 1) <= 0.05)
            )
        v = row["pp_ratio"]
        out.append((f"{s} pp bytes defer/every_step", v, "= 1", v == 1.0))
        v = row["pp_sent_over_estimate"]
        out.append((f"{s} pp bytes sent/estimate", v, "= 1", v == 1.0))
    for a in r["acts"]:
        name = f"{a['schedule']} stage {a['stage']} saved activations measured/estimate"
        out.append((name, a["ratio"], "0.8-1.25", 0.8 <= a["ratio"] <= 1.25))
    return [{"check": c, "value": v, "target": t, "pass": ok} for c, v, t, ok in out]


def table(result: dict[str, Any]) -> str:
    spec, r = result["spec"], result["ratios"]
    mib = 2**20
    lines = [
        f"pp 2{' x dp_shard ' + str(spec['dp_shard']) if spec['dp_shard'] > 1 else ''} "
        f"({2 * spec['dp_shard']} ranks, gloo), k = {spec['k']}, M = {spec['microbatches']} parts "
        f"of {spec['sizes']['micro_batch'] // spec['microbatches']} rows, "
        f"{result['grad_bytes'] / mib:.2f} MiB of fp32 gradients; rank 0 (stage 0), per optimizer step:",
        "",
        "| schedule | policy | dp reduction bytes / step (KiB) | dp other bytes / step (KiB) "
        "| pp bytes / step (KiB) | ms / micro-step |",
        "|---|---|---|---|---|---|",
    ]
    for c in result["cells"]:
        lines.append(
            f"| {c['schedule']} | {c['policy']} | {c['dp_bytes'] / 1024:.1f} | "
            f"{c['gather_bytes'] / 1024:.1f} | "
            f"{c['pp_bytes'] / 1024:.1f} | {c['micro_ms']:.2f} |"
        )
    lines += [
        "",
        "(pp bytes: what the audit records on the pp group, sends and receives.)",
        "",
        "| schedule | dp reduction bytes defer/every_step | pp bytes defer/every_step "
        "| pp bytes sent / estimate | ms / micro-step defer/every_step |",
        "|---|---|---|---|---|",
    ]
    for s, row in r["schedules"].items():
        dp = "no dp dim" if row["dp_ratio"] is None else f"{row['dp_ratio']:.3f}"
        lines.append(
            f"| {s} | {dp} | {row['pp_ratio']:.3f} | {row['pp_sent_over_estimate']:.3f} "
            f"| {row['ms_ratio']:.3f} |"
        )
    part = result["part_saved_bytes"]
    lines += [
        "",
        f"Saved activations (every_step step), one part alone: stage 0 {part[0]} B, stage 1 {part[1]} B.",
        "",
        "| schedule | stage | parts held (estimate) | estimate (B) | measured peak (B) | measured/estimate |",
        "|---|---|---|---|---|---|",
    ]
    for a in r["acts"]:
        lines.append(
            f"| {a['schedule']} | {a['stage']} | {a['parts']:g} | {a['estimate']:.0f} | "
            f"{a['measured']} | {a['ratio']:.3f} |"
        )
    lines += [
        "",
        "Checks: "
        + "; ".join(
            f"{c['check']} = {c['value']:.3f} ({c['target']}: {'ok' if c['pass'] else 'MISSED'})"
            for c in result["checks"]
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0], "the tiny model (a smoke run)")
    p.add_argument("--microbatches", type=int, default=4, help="M, parts per micro-step")
    p.add_argument("--dp-shard", type=int, default=1, help="2: pp 2 x dp_shard 2 on 4 ranks")
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps per cell")
    args = p.parse_args(argv)
    spec = {
        "sizes": dict(QUICK_SIZES if args.quick else SIZES),
        "k": args.k,
        "microbatches": args.microbatches,
        "dp_shard": args.dp_shard,
        "warmup": 1,
        "steps": args.steps,
    }
    result = run_workers(__file__, spec, "[pp] pipeline row", nproc=2 * args.dp_shard)
    if result is None:
        return 1
    result["ratios"] = ratios(result)
    result["checks"] = checks(result)
    write(args.out, "pp_bench", result, table(result))
    return 0 if all(c["pass"] for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
