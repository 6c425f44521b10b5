"""What each policy sends in each process group of an FSDP2 hybrid-sharding (HSDP) mesh.

    python benchmarks/hsdp_bytes.py --out bench-out          # a few minutes on 2 cores

Four ranks on gloo, a (2, 2) mesh (2 replicas x 2 shards: ``Accelerator(backend="fsdp",
fsdp_mesh=(2, 2))``), the sync-overhead benchmark's MLP (4.2 M parameters, fully_shard per
block, then the root). For k = 4 and 8 and each policy (``every_step``, ``defer_replicate``,
``defer``), a few optimizer steps run under the audit, and each step's collectives are
summed per group from ``accel.audit.records[i].to_dict()["groups"]``: reduce-scatters and
all-gathers in the shard group, all-reduces in the replicate group (and how many of those ran
off the boundary), with their payload bytes (the size of the tensor handed to the collective,
what the audit records). Next to them: the communication estimate's bytes sent across nodes per
rank for the same model and mesh (``gradsync._estimate.estimate_hybrid``; for a ring all-reduce
on R = 2 replicas, 2(R-1)/R x payload = the payload).

The bytes are the claim. The step times are printed but are no claim: 4 processes on 2 CPU
cores over gloo time the scheduler more than the network.

Writes hsdp_bytes.json and hsdp_bytes.md to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from small_bench import QUICK_SIZES, SIZES, run_workers, write  # noqa: E402

POLICIES = ("every_step", "defer_replicate", "defer")
MESH = (2, 2)  # (replicas, shards)


def _window_groups(records: list[Any]) -> dict[str, Any]:
    """One optimizer step's collectives per group label: op counts, payload bytes, and the
    replicate group's all-reduces off the boundary."""
    out: dict[str, dict[str, Any]] = {}
    for rec in records:
        for label, entry in rec.to_dict()["groups"].items():
            g = out.setdefault(label, {"ops": {}, "bytes": 0, "reduction_bytes": 0})
            for op, n in entry["ops"].items():
                g["ops"][op] = g["ops"].get(op, 0) + n
            g["bytes"] += entry["bytes"]
            g["reduction_bytes"] += entry["reduction_bytes"]
    off = sum(rec.count("allreduce", group="replicate") for rec in records if not rec.boundary)
    return {"groups": out, "replicate_allreduces_off_boundary": off}


def _labels(mesh: Any) -> str:
    """Who labelled the mesh's groups in the audit: gradsync's FSDP adapter does; where it has
    not (an older gradsync), the benchmark labels them itself, so the bytes still split."""
    from gradsync import audit

    replicate, shard = mesh.get_group(0), mesh.get_group(1)
    if replicate.label() == "replicate" and shard.label() == "shard":
        return "gradsync"
    audit.label_group(replicate, "replicate")
    audit.label_group(shard, "shard")
    return "benchmark"


def worker(spec: dict[str, Any], out: Path) -> None:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(HERE))
    from bench_cells import Sizes, sgd

    from gradsync import Accelerator

    torch.set_num_threads(1)
    sizes = Sizes(**spec["sizes"])
    cells: list[dict[str, Any]] = []
    rank = 0
    for k in spec["ks"]:
        for policy in spec["policies"]:
            accel = Accelerator(backend="fsdp", fsdp_mesh=MESH, sync_policy=policy,
                                gradient_accumulation_steps=k, micro_batch_size=sizes.micro_batch,
                                audit=True, seed=0)
            rank = accel.rank
            model = sizes.model()
            model, opt = accel.prepare(model, sgd(model.parameters()))
            labelled = _labels(accel.mesh)
            numel = sum(p.numel() for p in sizes.model().parameters())
            batches = sizes.batches(accel.rank, k, accel.device)
            recorder = accel.audit
            assert recorder is not None
            windows, step_ms, summary = [], [], ""
            for step in range(spec["warmup"] + spec["steps"]):
                start = len(recorder.records)
                t0 = time.perf_counter()
                for x, y in batches:
                    with accel.accumulate(model):
                        accel.backward(F.mse_loss(model(x), y))
                        opt.step()
                        opt.zero_grad()
                if step < spec["warmup"]:
                    continue
                step_ms.append((time.perf_counter() - t0) * 1e3)
                window = recorder.records[start:]
                assert len(window) == k and window[-1].boundary, "one window per step"
                windows.append(_window_groups(window))
                summary = recorder.summary(window)
            cells.append({"k": k, "policy": accel.sync_policy, "asked": policy, "grad_numel": numel,
                          "grad_bytes": numel * 4, "windows": windows, "step_ms": step_ms,
                          "summary": summary, "mesh": list(MESH), "labelled_by": labelled})
            if rank == 0:
                print(f"[hsdp] k={k} {policy:<16} {summary}", flush=True)
            del model, opt, accel
    if rank == 0:
        (out / "result.json").write_text(json.dumps({"cells": cells, "spec": spec}))


def _per_step(cell: dict[str, Any], label: str, key: str, op: str | None = None) -> float:
    """The mean over the measured steps of a group's ``key`` (or op count of ``op``)."""
    values = []
    for w in cell["windows"]:
        g = w["groups"].get(label, {"ops": {}, "bytes": 0, "reduction_bytes": 0})
        values.append(g["ops"].get(op, 0) if op is not None else g[key])
    return statistics.mean(values) if values else 0.0


def table(result: dict[str, Any]) -> str:
    from gradsync._estimate import HybridCluster, estimate_hybrid

    def mib(n: float) -> str:
        return f"{n / 2**20:.2f}"

    lines = [
        "| k | policy | shard: reduce-scatters / step | shard: reduce-scatter payload / step (MiB) "
        "| shard: all-gathers / step | replicate: all-reduces / step (off the boundary) "
        "| replicate: all-reduce payload / step (MiB) | estimate: cross-node bytes sent / rank / step (MiB) "
        "| step ms (no claim) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in result["cells"]:
        r, s = cell["mesh"]
        est = {row.policy: row for row in estimate_hybrid(HybridCluster(
            grad_bytes=cell["grad_bytes"], param_bytes=cell["grad_bytes"], replicas=r, shards=s,
            k=cell["k"], per_node=s))}
        off = max(w["replicate_allreduces_off_boundary"] for w in cell["windows"])
        lines.append(
            f"| {cell['k']} | {cell['policy']} "
            f"| {_per_step(cell, 'shard', '', 'reduce_scatter'):.0f} "
            f"| {mib(_per_step(cell, 'shard', 'reduction_bytes'))} "
            f"| {_per_step(cell, 'shard', '', 'allgather'):.0f} "
            f"| {_per_step(cell, 'replicate', '', 'allreduce'):.0f} ({off}) "
            f"| {mib(_per_step(cell, 'replicate', 'reduction_bytes'))} "
            f"| {mib(est[cell['policy']].cross_bytes)} "
            f"| {statistics.median(cell['step_ms']):.0f} |"
        )
    first = result["cells"][0]
    lines += [
        "",
        f"Model: {first['grad_numel']:,} parameters, {mib(first['grad_bytes'])} MiB of fp32 gradients; "
        f"mesh {tuple(first['mesh'])} (replicas x shards) on 4 gloo ranks; "
        f"{result['spec']['steps']} measured optimizer steps per cell after {result['spec']['warmup']} warm-up.",
        "The audit line of the last step of each cell:",
        "",
    ]
    lines += [f"    k={c['k']} {c['policy']}: {c['summary']}" for c in result["cells"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, k=4, one step: a smoke run")
    parser.add_argument("--out", default="bench-out", help="folder for hsdp_bytes.json and .md")
    parser.add_argument("--ks", default="4,8", help="accumulation steps, comma-separated")
    parser.add_argument("--steps", type=int, default=3, help="measured optimizer steps per cell")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(Path(args.worker[0]).read_text()), Path(args.worker[1]))
        return 0
    spec = {
        "sizes": QUICK_SIZES if args.quick else SIZES,
        "ks": [4] if args.quick else [int(k) for k in args.ks.split(",")],
        "policies": list(POLICIES),
        "steps": 1 if args.quick else args.steps,
        "warmup": 1,
    }
    result = run_workers(__file__, spec, "hsdp_bytes: 4 ranks, a (2, 2) mesh", nproc=4)
    if result is None:
        return 1
    write(args.out, "hsdp_bytes", result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
