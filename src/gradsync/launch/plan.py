"""`gradsync plan`: the batch plan (and accumulation schedule) for one or several world sizes.

Imports no torch: it runs before anything is installed on a cluster node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gradsync import mesh
from gradsync._plan.accumulation_schedule import Constant, RampUp, Schedule, StepKeyed
from gradsync._plan.batch_plan import solve_with_schedule
from gradsync.errors import ConfigError


def phases(schedule: Schedule, micro: int | None, world: int) -> tuple[str, str]:
    """(k, global batch size) as text, through the schedule's phases."""

    def global_of(k: int) -> str:
        return str(micro * k * world) if micro else "?"

    if isinstance(schedule, Constant):
        return str(schedule.k), global_of(schedule.k)
    if isinstance(schedule, StepKeyed):
        ks = " -> ".join(f"{k} (from step {start})" for start, k in schedule.points)
        gs = " -> ".join(global_of(k) for _, k in schedule.points)
        return ks, gs
    if isinstance(schedule, RampUp):
        first, last = (
            schedule.start // schedule.per_micro_step,
            schedule.target // schedule.per_micro_step,
        )
        return (
            f"{first} -> {last} (ramp-up over {schedule.samples} samples)",
            f"{schedule.start} -> {schedule.target}",
        )
    return schedule.describe(), "varies"


def rows(
    settings: Mapping[str, Any], nproc: Sequence[int], nnodes: Sequence[int]
) -> list[dict[str, str]]:
    """One row per (nodes, processes per node); a row that cannot be planned holds its error.
    With ``parallelism`` in ``settings`` (an N-D mesh) the global batch counts the R x S
    data-parallel ranks only: micro x k x (R x S)."""
    out = []
    for nodes in nnodes:
        for per_node in nproc:
            world = nodes * per_node
            row = {"nodes": str(nodes), "per_node": str(per_node), "world": str(world)}
            try:
                data = world
                if settings.get("parallelism") is not None:
                    dims = mesh.parse(settings["parallelism"]).resolve(world)
                    data, row["mesh"] = dims.data_parallel, dims.text()
                plan, schedule = solve_with_schedule(
                    data_parallel_size=data,
                    global_batch_size=settings.get("global_batch_size"),
                    micro_batch_size=settings.get("micro_batch_size"),
                    gradient_accumulation_steps=settings.get("gradient_accumulation_steps"),
                )
            except ConfigError as err:
                row["error"] = str(err)
                out.append(row)
                continue
            micro = plan.micro_batch_size
            row["micro"] = str(micro) if micro else "?"
            row["k"], row["global"] = phases(schedule, micro, data)
            row["data"] = str(data)
            out.append(row)
    return out


def ladder(micro: int, k: int) -> str:
    """The (micro batch x k) steps ``on_oom="split"`` walks from ``micro x k``: the micro
    batch halves and k doubles while the micro batch is even, down to 1 (the global batch
    stays); where it ends on an odd micro batch > 1, the next out-of-memory error is raised."""
    steps = [f"{micro} x {k}"]
    while micro > 1 and micro % 2 == 0:
        micro, k = micro // 2, k * 2
        steps.append(f"{micro} x {k}")
    end = "" if micro == 1 else f" (then raise: {micro} is odd)"
    return " -> ".join(steps) + end


def add_ladders(table: list[dict[str, str]]) -> None:
    """Each plannable row with a known micro batch and a constant k gets its ladder."""
    for row in table:
        if "error" not in row and row.get("micro", "?").isdigit() and row["k"].isdigit():
            row["ladder"] = ladder(int(row["micro"]), int(row["k"]))


def render(table: list[dict[str, str]]) -> str:
    """A Markdown table (errors in their own column)."""
    head = [
        "nodes",
        "processes/node",
        "world",
        "micro batch",
        "accumulation steps k",
        "global batch",
    ]
    ladders = any("ladder" in r for r in table)
    if ladders:
        head.append("on_oom='split': micro x k")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        if "error" in r:
            cells = [r["nodes"], r["per_node"], r["world"], f"error: {r['error']}", "", ""]
        else:
            world = f"{r['world']} ({r['data']} data-parallel)" if "mesh" in r else r["world"]
            cells = [r["nodes"], r["per_node"], world, r["micro"], r["k"], r["global"]]
        if ladders:
            cells.append(r.get("ladder", ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def single(row: dict[str, str]) -> str:
    """The one-world-size form: a few labelled lines."""
    where = f"{row['world']} ({row['nodes']} node(s) x {row['per_node']})"
    if "mesh" in row:  # an N-D mesh: the ranks of a tp group read the same micro-batches
        where = f"{row['data']} of {where}, mesh {row['mesh']}"
    return "\n".join(
        [
            f"data-parallel processes: {where}",
            f"micro batch size:        {row['micro']} per process",
            f"accumulation steps:      {row['k']}",
            f"global batch size:       {row['global'] if row['global'] != '?' else '?'} per optimizer step",
        ]
        + ([f"on_oom='split' walks:    {row['ladder']} (micro x k)"] if "ladder" in row else [])
    )
