"""What each policy sends in each process group of an FSDP2 mesh, and the memory it holds.

    python benchmarks/hsdp_bytes.py --out bench-out          # a few minutes on 2 cores

Four ranks on gloo, the sync-overhead benchmark's MLP (4.2 M parameters, fully_shard per
block, then the root), on a (2, 2) mesh (2 replicas x 2 shards: ``Accelerator(backend="fsdp",
fsdp_mesh=(2, 2))``, hybrid sharding) and on the 1-D mesh of the same 4 ranks (``(1, 4)``).
For k = 4 and 8 and each policy (``every_step``, ``defer_replicate`` on the 2-D mesh,
``defer``, ``defer`` with ``fsdp_keep_params_in_window=True``, and ``auto``), a few optimizer
steps run under the audit, and each step's collectives are summed per group from
``accel.audit.records[i].to_dict()["groups"]``: reduce-scatters and all-gathers in the shard
group, all-reduces in the replicate group (and how many of those ran off the boundary), with
their payload bytes (the size of the tensor handed to the collective, what the audit records).
Next to them: the communication estimate's bytes sent across nodes per rank for the same model
and mesh (``gradsync._plan.estimate.estimate_hybrid``; for a ring all-reduce on R = 2 replicas,
2(R-1)/R x payload = the payload).

Then one more optimizer step per cell runs under ``peak_memory.PeakMemory``: the peak tensor
memory above the window's start on each rank (on the CPU the live glibc heap sampled after
every op; on a GPU ``max_memory_allocated``), beside what the FSDP adapter predicted for the
policy it ran (``deferral_extra_bytes``, the number ``auto`` compares with its budget) and
the estimate's (``gradsync._plan.estimate.estimate_mesh``).

The bytes and the memory are the claim. The step times are printed but are no claim: 4
processes on 2 CPU cores over gloo time the scheduler more than the network.

And on the tensor-parallel mesh of the same ranks, (dp_shard 2, tp 2) (``Accelerator(backend=
"fsdp", parallelism={"dp_shard": 2, "tp": 2}, tp_plan=...)``): the MLP's Linears split in
colwise / rowwise pairs (``inp`` colwise, ``blocks.0.0`` rowwise, ...; a last unpaired Linear
stays replicated), applied over the ``tp`` dim before FSDP2 shards over ``dp_shard``. Every
policy that applies (``every_step``, ``defer``, ``defer + params``, ``auto``) is measured
the same way, and the TP traffic, which the audit labels ``tp``, is on its own line: it is
the computation and runs on every micro-step under every policy. Beside it the estimate
(``estimate_mesh``) with the plan's ``tp_share`` (the share of the model's bytes split over
tp: a colwise Linear's weight and bias, a rowwise Linear's weight) and the measured TP bytes
per micro-step.

Writes hsdp_bytes.json, hsdp_bytes.md and hsdp_memory.png (the memory column as a chart) to --out.
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

#: The policies measured: name in the output -> (sync_policy, extra Accelerator options).
POLICIES: dict[str, tuple[str, dict[str, Any]]] = {
    "every_step": ("every_step", {}),
    "defer_replicate": ("defer_replicate", {}),
    "defer": ("defer", {}),
    "defer + params": ("defer", {"fsdp_keep_params_in_window": True}),
    "auto": ("auto", {}),
}
#: The meshes of the 4 ranks, as ``--meshes`` takes them: (replicas, shards) of hybrid sharding,
#: the 1-D mesh, and the tensor-parallel mesh as ``parallelism`` text.
MESHES = ("2,2", "1,4", "dp_shard=2,tp=2")
WORLD = 4


def mesh_dims(cell: dict[str, Any]) -> tuple[int, int, int]:
    """(R, S, T) of a cell; ``cell["mesh"]`` is [R, S], with T appended where T > 1."""
    r, s, *rest = cell["mesh"]
    return r, s, rest[0] if rest else 1


def tp_plan(model: Any) -> dict[str, str]:
    """The MLP's Linears (``inp``, the blocks', ``head``) in colwise / rowwise pairs: the
    colwise one's output stays split through the elementwise tanh into the rowwise one, which
    all-reduces its output over tp. A last unpaired Linear stays replicated."""
    from torch import nn

    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return {
        name: ("colwise", "rowwise")[i % 2] for i, name in enumerate(names[: len(names) // 2 * 2])
    }


def tp_share(model: Any, plan: dict[str, str]) -> float:
    """The share of the model's parameter bytes the plan splits over tp: a colwise Linear's
    weight and bias (Shard(0)), a rowwise Linear's weight (Shard(1); its bias is replicated)."""
    modules = dict(model.named_modules())
    split = 0
    for name, style in plan.items():
        m = modules[name]
        split += m.weight.numel() + (
            m.bias.numel() if style == "colwise" and m.bias is not None else 0
        )
    return split / sum(p.numel() for p in model.parameters())


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
    shard_off = sum(
        rec.count("reduce_scatter", group=label)
        for rec in records
        if not rec.boundary
        for label in ("shard", "world")
    )
    return {
        "groups": out,
        "replicate_allreduces_off_boundary": off,
        "shard_reduce_scatters_off_boundary": shard_off,
    }


def _labels(mesh: Any) -> str:
    """Who labelled the mesh's groups in the audit: gradsync's FSDP adapter does; where it has
    not (an older gradsync), the benchmark labels them itself, so the bytes still split. On a
    1-D mesh the shard group is the world's copy, labelled "world"."""
    from gradsync import audit

    if "tp" in (mesh.mesh_dim_names or ()):
        return "gradsync"  # the N-D mesh: the adapter labels shard, tp (and replicate)
    if mesh.ndim == 1:
        return "world"
    replicate, shard = mesh.get_group(0), mesh.get_group(1)
    if replicate.label() == "replicate" and shard.label() == "shard":
        return "gradsync"
    audit.label_group(replicate, "replicate")
    audit.label_group(shard, "shard")
    return "benchmark"


def _window(accel: Any, model: Any, opt: Any, batches: list[Any], probe: Any = None) -> list[int]:
    """One optimizer step: a window of ``len(batches)`` micro-steps; with a memory ``probe``,
    the level it reads after each micro-step but the last. The last of those is what the
    window holds before its boundary (after the first micro-step FSDP2 may still hold its
    reduce-scatter buffers, which it frees at the next one)."""
    import torch.nn.functional as F

    held = []
    for i, (x, y) in enumerate(batches):
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        if probe is not None and i < len(batches) - 1:
            held.append(probe.level())
    return held


def _memory_step(accel: Any, model: Any, opt: Any, batches: list[Any]) -> dict[str, Any]:
    """One more optimizer step under the memory probe; every rank's peak above the window's
    start, and what the adapter predicted for the policy it ran."""
    import torch.distributed as dist
    from peak_memory import PeakMemory, no_gradients

    no_gradients(model)
    with PeakMemory(accel.device) as probe:
        held = _window(accel, model, opt, batches, probe)
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, (probe.peak_bytes, probe.baseline, held[-1] if held else 0))
    memory = getattr(accel._backend, "memory", {})
    return {
        "peak_bytes": [p for p, _, _ in peaks],
        "baseline_bytes": [b for _, b, _ in peaks],
        "held_bytes": [h for _, _, h in peaks],
        "predicted_extra_bytes": memory.get("deferral_extra_bytes"),
        "method": probe.method,
    }


def worker(spec: dict[str, Any], out: Path) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    from bench_cells import Sizes, sgd

    from gradsync import Accelerator
    from gradsync.backends import _fsdp_policy

    torch.set_num_threads(1)
    sizes = Sizes(**spec["sizes"])
    cells: list[dict[str, Any]] = []
    rank = 0
    for r, s, t in (tuple(m) for m in spec["meshes"]):
        mesh = [r, s] + ([t] if t > 1 else [])
        for k in spec["ks"]:
            for name in spec["policies"]:
                if name == "defer_replicate" and r == 1:
                    continue  # nothing to defer across one replica (gradsync refuses it)
                policy, options = POLICIES[name]
                plan = tp_plan(sizes.model()) if t > 1 else None
                shape: dict[str, Any] = (
                    {"parallelism": {"dp_replicate": r, "dp_shard": s, "tp": t}, "tp_plan": plan}
                    if t > 1
                    else {"fsdp_mesh": (r, s)}
                )
                accel = Accelerator(
                    backend="fsdp",
                    sync_policy=policy,
                    gradient_accumulation_steps=k,
                    micro_batch_size=sizes.micro_batch,
                    audit=True,
                    seed=0,
                    **shape,
                    **options,
                )
                rank = accel.rank
                model = sizes.model()
                share = tp_share(model, plan) if plan else 0.0
                model, opt = accel.prepare(model, sgd(model.parameters()))
                labelled = _labels(accel.mesh)
                numel = sum(p.numel() for p in sizes.model().parameters())
                held_numel = sum(_fsdp_policy.held_numel(p) for p in model.parameters())
                # The ranks of one TP group read the same micro-batches.
                batches = sizes.batches(accel.rank // t, k, accel.device)
                recorder = accel.audit
                assert recorder is not None
                windows, step_ms, summary, micro_tp = [], [], "", {}
                for step in range(spec["warmup"] + spec["steps"]):
                    start = len(recorder.records)
                    t0 = time.perf_counter()
                    _window(accel, model, opt, batches)
                    if step < spec["warmup"]:
                        continue
                    step_ms.append((time.perf_counter() - t0) * 1e3)
                    window = recorder.records[start:]
                    assert len(window) == k and window[-1].boundary, "one window per step"
                    windows.append(_window_groups(window))
                    summary = recorder.summary(window)
                    # TP payload of the window's first micro-step (off the boundary where k > 1)
                    micro_tp = {
                        op: window[0].nbytes(op, group="tp") for op in ("allreduce", "allgather")
                    }
                kept = "parameters kept gathered" in accel.sync_policy_reason
                cells.append(
                    {
                        "k": k,
                        "policy": accel.sync_policy + (" + params" if kept else ""),
                        "asked": name,
                        "reason": accel.sync_policy_reason,
                        "grad_numel": numel,
                        "grad_bytes": numel * 4,
                        "windows": windows,
                        "step_ms": step_ms,
                        "summary": summary,
                        "mesh": mesh,
                        "labelled_by": labelled,
                        "tp_share": share,
                        "held_grad_bytes": held_numel * 4,
                        "micro_tp": micro_tp,
                        "memory": _memory_step(accel, model, opt, batches),
                    }
                )
                if rank == 0:
                    print(f"[hsdp] mesh={tuple(mesh)} k={k} {name:<16} {summary}", flush=True)
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


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def table(result: dict[str, Any]) -> str:
    from gradsync._plan.estimate import HybridCluster, estimate_hybrid

    lines = [
        "| k | policy | shard: reduce-scatters / step | shard: reduce-scatter payload / step (MiB) "
        "| shard: all-gathers / step | replicate: all-reduces / step (off the boundary) "
        "| replicate: all-reduce payload / step (MiB) | estimate: cross-node bytes sent / rank / step (MiB) "
        "| step ms (no claim) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    hybrid = [c for c in result["cells"] if mesh_dims(c)[0] > 1 and mesh_dims(c)[2] == 1]
    for cell in hybrid:
        r, s, _ = mesh_dims(cell)
        est = {
            row.policy: row
            for row in estimate_hybrid(
                HybridCluster(
                    grad_bytes=cell["grad_bytes"],
                    param_bytes=cell["grad_bytes"],
                    replicas=r,
                    shards=s,
                    k=cell["k"],
                    per_node=s,
                )
            )
        }
        off = max(w["replicate_allreduces_off_boundary"] for w in cell["windows"])
        lines.append(
            f"| {cell['k']} | {_shown(cell)} "
            f"| {_per_step(cell, 'shard', '', 'reduce_scatter'):.0f} "
            f"| {_mib(_per_step(cell, 'shard', 'reduction_bytes'))} "
            f"| {_per_step(cell, 'shard', '', 'allgather'):.0f} "
            f"| {_per_step(cell, 'replicate', '', 'allreduce'):.0f} ({off}) "
            f"| {_mib(_per_step(cell, 'replicate', 'reduction_bytes'))} "
            f"| {_mib(est[cell['policy']].cross_bytes)} "
            f"| {statistics.median(cell['step_ms']):.0f} |"
        )
    first = result["cells"][0]
    lines += [
        "",
        f"Model: {first['grad_numel']:,} parameters, {_mib(first['grad_bytes'])} MiB of fp32 gradients; "
        f"meshes {', '.join(str(tuple(m)) for m in result['spec']['meshes'])} (replicas x shards x tp) on 4 gloo "
        f"ranks; {result['spec']['steps']} measured optimizer steps per cell after "
        f"{result['spec']['warmup']} warm-up, then one under the memory probe.",
        "",
        tp_table(result),
        memory_table(result),
        "The audit line of the last step of each cell:",
        "",
    ]
    lines += [
        f"    mesh {tuple(c['mesh'])} k={c['k']} {_shown(c)}: {c['summary']}"
        for c in result["cells"]
    ]
    return "\n".join(lines) + "\n"


def _shown(cell: dict[str, Any]) -> str:
    """The policy as asked, and what it ran as where that differs (auto)."""
    return (
        cell["asked"] if cell["asked"] == cell["policy"] else f"{cell['asked']} -> {cell['policy']}"
    )


def _payload(cell: dict[str, Any], label: str, op: str) -> float:
    """The mean payload bytes per measured step of ``op`` in the group ``label``: a
    reduce-scatter's is its input (the unsharded gradients), an all-gather's its input (the
    shard), an all-reduce's the tensor reduced."""
    if op == "allgather":  # the group's bytes that are not reductions (barriers carry none)
        return _per_step(cell, label, "bytes") - _per_step(cell, label, "reduction_bytes")
    return _per_step(cell, label, "reduction_bytes")


def shard_label(cell: dict[str, Any]) -> str:
    """The audit label of the dp_shard group: "world" on the 1-D mesh, else "shard"."""
    r, _, t = mesh_dims(cell)
    return "shard" if r > 1 or t > 1 else "world"


def sent_per_rank(cell: dict[str, Any]) -> tuple[float, float]:
    """(dp_shard, tp) bytes one rank sends per optimizer step, from the measured payloads, as
    the estimate counts them: a ring reduce-scatter sends (S-1)/S of its input, an all-gather
    (S-1) x its input shard, an all-reduce 2(T-1)/T of its tensor."""
    _, s, t = mesh_dims(cell)
    label = shard_label(cell)
    shard = (s - 1) / s * _payload(cell, label, "reduce_scatter") + (s - 1) * _payload(
        cell, label, "allgather"
    )
    tp = 2 * (t - 1) / t * _payload(cell, "tp", "allreduce") + (t - 1) * _payload(
        cell, "tp", "allgather"
    )
    return shard, tp


def estimate_row(cell: dict[str, Any]) -> Any:
    """``estimate_mesh``'s row for the policy the cell ran, on its mesh, with the plan's
    tp_share and, on a TP mesh, the measured TP bytes per micro-step."""
    from gradsync._plan.estimate import MeshCluster, estimate_mesh

    (r, s, t), g = mesh_dims(cell), cell["grad_bytes"]
    micro = cell.get("micro_tp") or {}
    tp_bytes = (
        2 * (t - 1) / t * micro.get("allreduce", 0) + (t - 1) * micro.get("allgather", 0)
        if t > 1
        else None
    )  # what one rank sends over tp in one micro-step
    rows = {
        row.policy: row
        for row in estimate_mesh(
            MeshCluster(
                g,
                g,
                dp_replicate=r,
                dp_shard=s,
                tp=t,
                k=cell["k"],
                tp_share=cell.get("tp_share") or 1.0,
                tp_bytes=tp_bytes,
            )
        )
    }
    return rows[cell["policy"]]


def estimated_held(cell: dict[str, Any]) -> float:
    """What the estimate says the cell's window holds before its boundary above the window's
    start: the gradients (G_T/S sharded, G_T unsharded, or the partial buffer G_T/S; G_T the
    bytes a rank of a TP group holds), and the gathered parameters where they are kept (the
    shard, P_T/S, is there at the start)."""
    from gradsync._plan.estimate import MeshCluster

    (_, s, t), g = mesh_dims(cell), cell["grad_bytes"]
    p_t = MeshCluster(g, g, tp=t, tp_share=cell.get("tp_share") or 1.0).per_tp_rank(g)
    row = estimate_row(cell)
    return row.grad_memory + row.param_memory - p_t / s


def tp_table(result: dict[str, Any]) -> str:
    """On the tensor-parallel meshes: per k and policy, the dp_shard collectives and the TP
    traffic per optimizer step, measured beside the estimate."""
    cells = [c for c in result["cells"] if mesh_dims(c)[2] > 1]
    if not cells:
        return ""
    lines = [
        "| mesh (R, S, T) | k | policy | dp_shard: reduce-scatters / step (off the boundary) "
        "| dp_shard: all-gathers / step | dp_shard: sent / rank / step, MiB | estimate: dp_shard, MiB "
        "| tp: all-reduces / step | tp: sent / rank / step, MiB | estimate: tp, MiB | step ms (no claim) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        row = estimate_row(cell)
        shard, tp = sent_per_rank(cell)
        off = max(w.get("shard_reduce_scatters_off_boundary", 0) for w in cell["windows"])
        lines.append(
            f"| {tuple(cell['mesh'])} | {cell['k']} | {_shown(cell)} "
            f"| {_per_step(cell, 'shard', '', 'reduce_scatter'):.0f} ({off}) "
            f"| {_per_step(cell, 'shard', '', 'allgather'):.0f} | {_mib(shard)} | {_mib(row.shard_bytes)} "
            f"| {_per_step(cell, 'tp', '', 'allreduce'):.0f} | {_mib(tp)} "
            f"| {_mib(row.tp_bytes) if row.tp_bytes is not None else '-'} "
            f"| {statistics.median(cell['step_ms']):.0f} |"
        )
    first = cells[0]
    g_t = first["held_grad_bytes"]
    lines += [
        "",
        f"TP plan: {', '.join(f'{n} {st}' for n, st in tp_plan_of(result).items())}; "
        f"tp_share {first['tp_share']:.4f} of the model's bytes split over tp, so a rank of a TP group "
        f"holds G_T = {_mib(g_t)} MiB of the {_mib(first['grad_bytes'])} MiB (the adapter's count); "
        "sent / rank: (S-1)/S x the reduce-scatters' input + (S-1) x the all-gathers' input shard, "
        "2(T-1)/T x the all-reduced tensors; the estimate's tp column is k x the TP bytes of the "
        "window's first micro-step (the input it takes, `--tp-bytes`), against all k measured.",
        "",
    ]
    return "\n".join(lines)


def tp_plan_of(result: dict[str, Any]) -> dict[str, str]:
    """The plan the TP cells ran (the model rebuilt from the spec's sizes)."""
    sys.path.insert(0, str(HERE))
    from bench_cells import Sizes

    return tp_plan(Sizes(**result["spec"]["sizes"]).model())


def memory_table(result: dict[str, Any]) -> str:
    """Per mesh, k and policy: bytes per mesh dimension, the measured peak above the window's
    start and the level held before the boundary, beside the estimate's held bytes and the
    adapter's number (what auto weighs)."""
    lines = [
        "| mesh (R, S[, T]) | k | policy | dp_shard: MiB / step | dp_replicate: MiB / step | tp: MiB / step "
        "| held before the boundary, MiB | estimate: held, MiB | peak above the window start, MiB "
        "| adapter: deferral_extra_bytes, MiB (what auto weighs) | step ms (no claim) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cells = result["cells"]
    for cell in cells:
        k, mem = cell["k"], cell["memory"]
        predicted = mem["predicted_extra_bytes"]
        lines.append(
            f"| {tuple(cell['mesh'])} | {k} | {_shown(cell)} "
            f"| {_mib(_per_step(cell, shard_label(cell), 'bytes'))} "
            f"| {_mib(_per_step(cell, 'replicate', 'bytes'))} | {_mib(_per_step(cell, 'tp', 'bytes'))} "
            f"| {_mib(max(mem['held_bytes']))} | {_mib(estimated_held(cell))} | {_mib(max(mem['peak_bytes']))} "
            f"| {_mib(predicted) if predicted is not None else '-'} "
            f"| {statistics.median(cell['step_ms']):.0f} |"
        )
    method = cells[0]["memory"]["method"] if cells else ""
    reasons = {f"{tuple(c['mesh'])}": c["reason"] for c in cells if c["asked"] == "auto"}
    lines += [
        "",
        f"Memory, the largest of the 4 ranks: {method}; held: the level after micro-step k - 1, "
        "before the boundary's. Auto's reason: "
        + "; ".join(f"mesh {m}: {why}" for m, why in reasons.items())
        + ".",
        "",
    ]
    return "\n".join(lines)


def memory_chart(result: dict[str, Any], path: Path) -> str | None:
    """Per mesh and k, one group of bars per policy: held before the boundary (measured), the
    estimate's held bytes, and the peak; None, or why no chart was drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart: skipped, matplotlib is not installed (pip install 'gradsync[bench]')"
    groups = list(dict.fromkeys((tuple(c["mesh"]), c["k"]) for c in result["cells"]))
    # Two panels a row: about 920 px wide, legible in a documentation column.
    rows = (len(groups) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(8.4, 3.6 * rows), squeeze=False, sharey=True)
    for ax in axes.flat[len(groups) :]:
        ax.set_visible(False)
    for ax, (mesh, k) in zip(axes.flat, groups):
        cells = [c for c in result["cells"] if (tuple(c["mesh"]), c["k"]) == (mesh, k)]
        xs = range(len(cells))
        series = [
            ("held before the boundary", [max(c["memory"]["held_bytes"]) for c in cells], "C0"),
            ("estimate: held", [estimated_held(c) for c in cells], "C1"),
            ("peak", [max(c["memory"]["peak_bytes"]) for c in cells], "C7"),
        ]
        for j, (name, values, color) in enumerate(series):
            ax.bar(
                [x + (j - 1) * 0.27 for x in xs],
                [v / 2**20 for v in values],
                0.27,
                label=name,
                color=color,
            )
        ax.set_xticks(list(xs), [c["asked"] for c in cells], rotation=30, ha="right", fontsize=8)
        ax.set_title(f"mesh {mesh}, k={k}", fontsize=9)
    for row in axes:
        row[0].set_ylabel("MiB above the window start\n(largest rank)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _mesh(text: str) -> list[int]:
    """A ``--meshes`` entry as [R, S, T]: ``R,S`` (replicas, shards), or ``parallelism`` text
    such as ``dp_shard=2,tp=2``."""
    from gradsync import ConfigError
    from gradsync import mesh as nd_mesh

    if "=" in text or ":" in text or text.strip().startswith("{"):
        try:
            dims = nd_mesh.from_text(text, "--meshes").resolve(WORLD, "--meshes")
        except ConfigError as exc:
            raise SystemExit(f"hsdp_bytes: {exc}") from None
        if dims.cp != 1:
            raise SystemExit(
                f"hsdp_bytes: --meshes entry {text!r}: cp={dims.cp} needs a GPU; drop cp"
            )
        return list(dims.shape)
    r, s = (int(n) for n in text.split(","))
    if r * s != WORLD:
        raise SystemExit(
            f"hsdp_bytes: --meshes entry {text!r}: replicas x shards must be the {WORLD} ranks"
        )
    return [r, s, 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a tiny model, k=4, one step: a smoke run"
    )
    parser.add_argument("--out", default="bench-out", help="folder for hsdp_bytes.json and .md")
    parser.add_argument("--ks", default="4,8", help="accumulation steps, comma-separated")
    parser.add_argument("--steps", type=int, default=3, help="measured optimizer steps per cell")
    parser.add_argument(
        "--meshes",
        default=";".join(MESHES),
        help="the meshes of the 4 ranks, ';'-separated: 'R,S' (replicas, shards) or "
        "parallelism text; default '2,2;1,4;dp_shard=2,tp=2'",
    )
    args = parser.parse_args(argv)
    spec = {
        "meshes": [_mesh(text) for text in args.meshes.split(";") if text.strip()],
        "sizes": QUICK_SIZES if args.quick else SIZES,
        "ks": [4] if args.quick else [int(k) for k in args.ks.split(",")],
        "policies": list(POLICIES),
        "steps": 1 if args.quick else args.steps,
        "warmup": 1,
    }
    result = run_workers(
        __file__, spec, f"hsdp_bytes: {WORLD} ranks, meshes {args.meshes}", nproc=WORLD
    )
    if result is None:
        return 1
    write(args.out, "hsdp_bytes", result, table(result))
    note = memory_chart(result, Path(args.out, "hsdp_memory.png"))
    if note:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
