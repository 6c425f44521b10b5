"""`gradsync plan`: the batch plan (and accumulation schedule) for one or several world sizes.

Imports no torch: it runs before anything is installed on a cluster node.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gradsync._accumulation_schedule import Constant, RampUp, Schedule, StepKeyed
from gradsync._batch_plan import solve_with_schedule
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
        first, last = schedule.start // schedule.per_micro_step, schedule.target // schedule.per_micro_step
        return (f"{first} -> {last} (ramp-up over {schedule.samples} samples)",
                f"{schedule.start} -> {schedule.target}")
    return schedule.describe(), "varies"


def rows(settings: Mapping[str, Any], nproc: Sequence[int], nnodes: Sequence[int],
         data_parallel: Callable[[int], int] | None = None) -> list[dict[str, str]]:
    """One row per (nodes, processes per node); a row that cannot be planned holds its error.
    ``data_parallel``: the data-parallel ranks of a world (a mesh with tensor parallelism
    has fewer than the world; None: all of them)."""
    out = []
    for nodes in nnodes:
        for per_node in nproc:
            world = nodes * per_node
            row = {"nodes": str(nodes), "per_node": str(per_node), "world": str(world), "dp": str(world)}
            try:
                dp = data_parallel(world) if data_parallel is not None else world
                row["dp"] = str(dp)
                plan, schedule = solve_with_schedule(
                    data_parallel_size=dp,
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
            row["k"], row["global"] = phases(schedule, micro, dp)
            out.append(row)
    return out


def render(table: list[dict[str, str]]) -> str:
    """A Markdown table (errors in their own column)."""
    mesh = any(r.get("dp", r["world"]) != r["world"] for r in table)  # a data-parallel column
    head = ["nodes", "processes/node", "world", *(["data-parallel"] if mesh else []), "micro batch",
            "accumulation steps k", "global batch"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        first = [r["nodes"], r["per_node"], r["world"], *([r.get("dp", r["world"])] if mesh else [])]
        if "error" in r:
            cells = [*first, f"error: {r['error']}", "", ""]
        else:
            cells = [*first, r["micro"], r["k"], r["global"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def single(row: dict[str, str]) -> str:
    """The one-world-size form: a few labelled lines."""
    return "\n".join([
        f"data-parallel processes: {row.get('dp', row['world'])} ({row['nodes']} node(s) x {row['per_node']}"
        + (f" = {row['world']} processes in tensor-parallel groups of {int(row['world']) // int(row['dp'])})"
           if row.get("dp", row["world"]) != row["world"] else ")"),
        f"micro batch size:        {row['micro']} per process",
        f"accumulation steps:      {row['k']}",
        f"global batch size:       {row['global'] if row['global'] != '?' else '?'} per optimizer step",
    ])
