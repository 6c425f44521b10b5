"""Pipeline parallelism (``parallelism={"pp": 2, ...}``) composed with accumulation, run by
mp_worker.py in one audited gloo group (2 ranks: pp 2; 4 ranks: pp 2 x dp_shard 2)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from gradsync import Accelerator, ConfigError

from scenarios.common import FEATURES, Indexed, to_lists

#: Where the second stage begins: Linear-Tanh-Linear-Tanh | Linear-Tanh-Linear.
SPLIT = ["4"]
WIDTH = 16


def make_seq(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, 1),
    )


def positive_targets(batch: Any) -> int:
    """The items of a batch: its samples with a positive target (a stand-in for tokens)."""
    return int((batch[1] > 0).sum())


def masked_sse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The summed squared error over the samples with a positive target."""
    return ((out - y).pow(2) * (y > 0)).sum()


def _accel(dims: dict[str, int], steps: int, policy: str, **options: Any) -> Accelerator:
    return Accelerator(
        backend=options.pop("backend", "fsdp"),
        parallelism=dims,
        pp_split=options.pop("split", SPLIT),
        gradient_accumulation_steps=steps,
        sync_policy=policy,
        seed=0,
        audit=True,
        **options,
    )


def train_pp(
    *,
    dims: dict[str, int],
    steps: int,
    policy: str,
    schedule: str,
    microbatches: int,
    samples: int,
    micro_batch: int,
    clip: float | None = None,
    budget: int | None = None,
    tokens: bool = False,
) -> dict[str, Any]:
    """The loop a user writes: one pipeline_step per micro-step inside accumulate (with
    ``tokens``, a summed loss over the window's counted items)."""
    accel = _accel(
        dims,
        steps,
        policy,
        pp_schedule=schedule,
        pp_microbatches=microbatches,
        sync_memory_budget=budget,
        **({"count_items": positive_targets} if tokens else {}),
    )
    loss_fn, reduction = (masked_sse, "sum") if tokens else (F.mse_loss, "mean")
    model = make_seq()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(Indexed(samples), batch_size=micro_batch)
    model, opt, loader = accel.prepare(model, opt, loader)
    windows: list[list[list[int]]] = []
    current: list[list[int]] = []
    losses: list[float | None] = []
    norms: list[float] = []
    for x, y, idx in loader:
        with accel.accumulate(model):
            loss = accel.pipeline_step(model, x, y, loss_fn, reduction)
            losses.append(None if loss is None else float(loss))
            current.append(idx.tolist())
            if clip is not None and accel.sync_gradients:
                norms.append(float(accel.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            opt.zero_grad()
        if accel.sync_gradients:
            windows.append(current)
            current = []
    backend = accel._backend  # type: ignore[attr-defined]
    mesh = accel.mesh
    assert accel.audit is not None
    return {
        "windows": windows,
        "losses": losses,
        "norms": norms,
        "optimizer_steps": accel.optimizer_steps,
        "state": to_lists(accel.get_state_dict(model)),
        "stage": mesh.get_local_rank("pp"),
        "data_rank": backend.data_parallel.rank,
        "data_size": backend.data_parallel.size,
        "policy": accel.sync_policy,
        "audit": [r.to_dict() for r in accel.audit.records],
        "summaries": [accel.audit.summary(w) for w in accel.audit.windows()],
        "opt_params": sum(len(g["params"]) for g in opt.param_groups),
    }


def misuse() -> dict[str, Any]:
    """A plain forward on a stage, and pipeline_step outside accumulate: one line each."""
    accel = _accel({"pp": 2}, 2, "defer", pp_microbatches=2)
    model = accel.prepare(make_seq())
    out: dict[str, Any] = {}
    try:
        model(torch.zeros(4, FEATURES))
    except Exception as e:
        out["forward"] = f"{type(e).__name__}: {e}"
    try:
        accel.pipeline_step(model, torch.zeros(4, FEATURES), torch.zeros(4, 1), F.mse_loss)
    except Exception as e:
        out["outside"] = f"{type(e).__name__}: {e}"
    with accel.accumulate(model):
        try:
            accel.pipeline_step(model, torch.zeros(3, FEATURES), torch.zeros(3, 1), F.mse_loss)
        except Exception as e:
            out["indivisible"] = f"{type(e).__name__}: {e}"
    return out


def refused(**options: Any) -> dict[str, Any]:
    """What prepare (or the Accelerator) says to a bad pipeline setting: one ConfigError line,
    before any collective."""
    dims = options.pop("dims", {"pp": 2})
    micro_batch = options.pop("micro_batch", 4)
    bare_tail = options.pop("bare_tail", False)
    try:
        accel = _accel(dims, 2, "defer", **options)
        model = nn.Sequential(nn.Linear(FEATURES, 1), nn.Tanh()) if bare_tail else make_seq()
        accel.prepare(model, DataLoader(Indexed(16), batch_size=micro_batch))
    except ConfigError as e:
        return {"error": str(e)}
    return {"error": None}
