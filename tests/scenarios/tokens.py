"""Token-weighted accumulation, metrics across ranks and frozen models, in one 2-rank group
(audited gloo, as DeepSpeed adopts it): GPT-2 from a tiny config on variable-length data."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import gradsync
from gradsync import Accelerator

from scenarios.common import DEEPSPEED_PRELOAD as PRELOAD  # noqa: F401  (mp_worker.py)
from scenarios.common import to_lists
from scenarios.deepspeed import ds_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import causal_lm  # noqa: E402
import preference  # noqa: E402

SAMPLES = 44  # 22 per rank, 11 micro-batches of 2: windows of 4, 4 and 3 per epoch
LR = 0.05


def _accel(backend: str, steps: int, **options: Any) -> Accelerator:
    if backend == "deepspeed":
        options["deepspeed_config"] = ds_config(options.pop("stage", 2))
    return Accelerator(
        backend=backend, gradient_accumulation_steps=steps, seed=0, audit=True, **options
    )


def lm(
    *,
    backend: str,
    reduction: str,
    steps: int = 4,
    epochs: int = 2,
    change_steps_at: tuple[int, int] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The fine-tuning loop of examples/causal_lm.py with each reduction; returns what the
    parent compares with one process: the sample ids per micro-step, the window item counts,
    the logged global token mean, the final weights and the audit."""
    counting = reduction != "mean"
    accel = _accel(
        backend, steps, count_items=gradsync.count_label_tokens if counting else None, **options
    )
    model = causal_lm.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loader = DataLoader(
        causal_lm.Sequences(SAMPLES), batch_size=2, shuffle=True, collate_fn=causal_lm.collate
    )
    model, opt, loader = accel.prepare(model, opt, loader)
    windows, current, items, logged = [], [], [], []
    window_sum = torch.zeros(())
    assert accel.audit is not None
    start = len(accel.audit.records)
    for _ in range(epochs):
        for batch in loader:
            if change_steps_at is not None and len(windows) == change_steps_at[0]:
                accel.gradient_accumulation_steps = change_steps_at[1]
            with accel.accumulate(model):
                if reduction == "sum":
                    loss = causal_lm.summed_loss(model, batch)
                    window_sum += loss.detach()
                elif reduction == "normalized":
                    loss = model(
                        input_ids=batch["input_ids"],
                        labels=batch["labels"],
                        num_items_in_batch=accel.window_items,
                    ).loss
                    window_sum += loss.detach() * accel.window_items
                else:
                    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                accel.backward(loss, reduction=reduction)
                opt.step()
                opt.zero_grad()
            current.append(batch["id"].tolist())
            if accel.sync_gradients:
                windows.append(current)
                current = []
                if counting:
                    items.append(accel.window_items)
                    logged.append(float(accel.reduce(window_sum, "sum")) / accel.window_items)
                window_sum = torch.zeros(())
    records = [r.to_dict() for r in accel.audit.records[start:]]
    return {
        "windows": windows,
        "items": items,
        "logged": logged,
        "audit": records,
        "state": to_lists(accel.get_state_dict(model)),
        "optimizer_steps": accel.optimizer_steps,
    }


def metrics() -> dict[str, Any]:
    """gather_for_metrics over an evaluation pass of 45 samples; gather / reduce / pad on a
    nested structure whose rows differ in number between ranks."""
    accel = Accelerator(backend="ddp", seed=0)
    rank = accel.rank
    loader = accel.prepare(DataLoader(list(range(45)), batch_size=4))
    seen, plain = [], []
    for batch in loader:
        seen += accel.gather_for_metrics(batch).tolist()
        plain += accel.gather(batch).tolist()
    nested = {
        "a": torch.arange(rank + 1, dtype=torch.float32) + 10 * rank,
        "b": [torch.tensor(float(rank + 1)), torch.ones(2, 3) * rank],
    }
    padded = accel.pad_across_processes(torch.ones(rank + 2, 2) * (rank + 1), dim=0, pad_index=-1)
    with accel.main_process_first():
        order = accel.rank
    return {
        "for_metrics": seen,
        "plain": plain,
        "gather": {
            k: (v.tolist() if isinstance(v, torch.Tensor) else [x.tolist() for x in v])
            for k, v in accel.gather(nested).items()
        },
        "sum": {
            "a_total": float(accel.reduce(nested["a"].sum(), "sum")),
            "b0": float(accel.reduce(nested["b"][0], "sum")),
            "b0_mean": float(accel.reduce(nested["b"][0], "mean")),
        },
        "padded": padded.tolist(),
        "local_main": accel.is_local_main_process,
        "order": order,
    }


def dpo(*, backend: str, steps: int = 4) -> dict[str, Any]:
    """examples/preference.py's loop: a trained policy and a frozen reference model."""
    accel = _accel(backend, steps)
    out = preference.train(accel, pairs=SAMPLES, micro_batch=2)
    out["policy"] = to_lists(out["policy"])
    out["wrapped"] = type(
        accel._prepared.models[-1]
    ).__name__  # how the reference model was prepared
    out["optimizer_steps"] = accel.optimizer_steps
    return out


def misuse() -> dict[str, str]:
    """Token-weighting errors on 2 ranks: each gives its message, and no rank hangs."""
    messages: dict[str, str] = {}
    accel = _accel(
        "ddp", 2, count_items=lambda b: -1 if int(os.environ.get("RANK", "0")) == 1 else 3
    )
    model = accel.prepare(causal_lm.make_model())
    loader = accel.prepare(
        DataLoader(causal_lm.Sequences(8), batch_size=2, collate_fn=causal_lm.collate)
    )
    try:
        for _batch in loader:
            with accel.accumulate(model):
                pass
    except (ValueError, RuntimeError) as err:
        messages["negative_on_one_rank"] = f"{type(err).__name__}: {err}"
    ds = _accel("deepspeed", 2, micro_batch_size=2)
    first = causal_lm.make_model()
    ds.prepare(first, torch.optim.SGD(first.parameters(), lr=0.1))
    second = causal_lm.make_model(1)
    try:
        ds.prepare(second, torch.optim.SGD(second.parameters(), lr=0.1))
    except ValueError as err:
        messages["second_trained"] = f"{type(err).__name__}: {err}"
    return messages
