"""torch.compile scenarios (ddp and fsdp), run by mp_worker.py in one 2-rank audited gloo group:
a model compiled before prepare, a prepared model compiled after it, and compile=True."""

from __future__ import annotations

from typing import Any

import torch

from gradsync import Accelerator

from scenarios.common import Loop, Net, make_model, train


def train_compiled(*, backend: str, where: str, steps: int, loop: Loop) -> dict[str, Any]:
    """``where``: "before" prepare, "after" it, or "option" (``Accelerator(compile=True)``)."""
    accel = Accelerator(
        backend=backend,
        gradient_accumulation_steps=steps,
        sync_policy="defer",
        seed=0,
        audit=True,
        compile=where == "option",
    )
    model: Any = make_model()
    if where == "before":
        model = torch.compile(model)
    seen: dict[str, Any] = {}

    def after_prepare(prepared: torch.nn.Module) -> torch.nn.Module:
        seen["prepared"] = type(prepared).__name__
        seen["model"] = torch.compile(prepared) if where == "after" else prepared
        return seen["model"]

    torch._dynamo.reset()  # compile afresh: no graph cached by an earlier scenario is reused
    graphs = _compiled_graphs()
    out = train(accel, loop, model=model, after_prepare=after_prepare)
    unwrapped = accel.unwrap_model(seen["model"])
    out["unwrapped_is_net"] = isinstance(unwrapped, Net)
    out["prepared"] = seen["prepared"]
    out["compiled_graphs"] = _compiled_graphs() - graphs
    return out


def _compiled_graphs() -> int:
    """How many graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
