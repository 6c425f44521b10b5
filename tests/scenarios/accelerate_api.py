"""Worker side: ``window_loss`` and manual ``no_sync`` / ``trigger_sync_in_backward`` on real
ranks (DDP, FSDP2), each checked against what one process computes from every rank's data."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from gradsync import Accelerator

from scenarios.common import Indexed, make_model


def _gathered(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def window_loss(
    *, backend: str, k: int, samples: int, read_on: str, project_dir: str | None = None
) -> dict[str, Any]:
    """Train; at every boundary compare ``window_loss`` with the mean over every rank's
    micro-batch losses of that window. ``read_on="main"``: only rank 0 ever reads it (the
    others must not hang), and logs it to TensorBoard under ``project_dir``."""
    accel = Accelerator(
        backend=backend,
        gradient_accumulation_steps=k,
        seed=0,
        log_with="tensorboard" if project_dir else None,
        project_dir=project_dir,
    )
    accel.init_trackers("run")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(Indexed(samples), batch_size=2, shuffle=False)
    model, opt, loader = accel.prepare(model, opt, loader)
    mine: list[list[float]] = [[]]
    read: list[float] = []
    for x, y, _ in loader:
        with accel.accumulate(model):
            loss = F.mse_loss(model(x), y)
            mine[-1].append(loss.item())
            accel.backward(loss)
            opt.step()
            opt.zero_grad()
            if accel.sync_gradients:
                if read_on == "all" or accel.is_main_process:
                    read.append(accel.window_loss)
                    accel.log({"loss": accel.window_loss})
                mine.append([])
    everyone = _gathered(mine[:-1])
    expected = [
        sum(sum(r[w]) for r in everyone) / sum(len(r[w]) for r in everyone)
        for w in range(len(mine) - 1)
    ]
    accel.end_training()
    return {"read": read, "expected": expected}


def token_window_loss(*, backend: str) -> dict[str, Any]:
    """reduction="sum" with items: window_loss is the sum of every rank's summed losses over
    the global window's items."""
    accel = Accelerator(
        backend=backend,
        gradient_accumulation_steps=2,
        seed=0,
        count_items=lambda batch: int(batch[2].sum()),
    )
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = Indexed(16)
    weights = [(i % 3) + 1 for i in range(16)]  # each sample counts 1-3 items
    rows = [(data.x[i], data.y[i], torch.tensor(weights[i])) for i in range(16)]
    model, opt, loader = accel.prepare(model, opt, DataLoader(rows, batch_size=2, shuffle=False))
    sums: list[list[float]] = [[]]
    items: list[list[int]] = [[]]
    read = []
    for x, y, n in loader:
        with accel.accumulate(model):
            per_sample = (model(x) - y).pow(2).squeeze(1) * n  # n items, each with that error
            loss = per_sample.sum()
            sums[-1].append(loss.item())
            items[-1].append(int(n.sum()))
            accel.backward(loss, reduction="sum")
            opt.step()
            opt.zero_grad()
            if accel.sync_gradients:
                read.append(accel.window_loss)
                sums.append([])
                items.append([])
    all_sums, all_items = _gathered(sums[:-1]), _gathered(items[:-1])
    expected = [
        sum(sum(r[w]) for r in all_sums) / sum(sum(r[w]) for r in all_items)
        for w in range(len(sums) - 1)
    ]
    accel.end()
    return {"read": read, "expected": expected}


def manual(*, backend: str, style: str) -> dict[str, Any]:
    """Accelerate's manual loops with k=1: ``no_sync`` on three micro-batches, then a synced
    one (``style="trigger"``: the whole micro-step inside ``trigger_sync_in_backward``;
    ``"plain"``: a plain backward outside any block; ``"backward_only"``: the forward under
    ``no_sync``, the backward alone inside ``trigger_sync_in_backward``, as Accelerate's
    docs show). Returns the audit per micro-step and the parameters, with one process's."""
    accel = Accelerator(backend=backend, audit=True, seed=0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Indexed(32), batch_size=2, shuffle=False)
    model, opt, loader = accel.prepare(model, opt, loader)
    batches = []
    for i, (x, y, ids) in enumerate(loader):
        batches.append(ids.tolist())
        if i % 4 != 3:
            with accel.no_sync(model):
                accel.backward(F.mse_loss(model(x), y))
                opt.step()  # off the boundary: nothing
        elif style == "trigger":
            with accel.trigger_sync_in_backward(model):
                accel.backward(F.mse_loss(model(x), y))
        elif style == "plain":
            accel.backward(F.mse_loss(model(x), y))
        else:
            with accel.no_sync(model):
                loss = F.mse_loss(model(x), y)
            with accel.trigger_sync_in_backward(model):
                accel.backward(loss)
        if i % 4 == 3:
            opt.step()
            opt.zero_grad()
    assert accel.audit is not None
    records = [r.to_dict() for r in accel.audit.records]
    state = accel.get_state_dict(model)
    params = torch.cat([v.reshape(-1) for v in state.values()]).tolist()
    # One process: each window of 4 micro-batches per rank, every loss as is (k = 1), the
    # gradients averaged over ranks: the sum over micro-batches of the ranks' mean.
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    data = Indexed(32)
    all_batches = _gathered(batches)
    world = len(all_batches)
    for w in range(len(batches) // 4):
        for j in range(4):
            for r in range(world):
                ids = all_batches[r][w * 4 + j]
                (F.mse_loss(ref(data.x[ids]), data.y[ids]) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    reference = torch.cat([p.detach().reshape(-1) for p in ref.parameters()]).tolist()
    out = {"audit": records, "params": params, "reference": reference, "steps": opt.steps_applied}
    accel.end()
    return out


def gpt2_tokens(*, project_dir: str) -> dict[str, Any]:
    """examples/causal_lm.py's loop on DDP (GPT-2 from a tiny config, variable-length
    sequences, token-weighted): the loss it logs to TensorBoard is the global token mean."""
    import sys
    from pathlib import Path

    import gradsync

    examples = Path(__file__).resolve().parents[2] / "examples"
    if str(examples) not in sys.path:
        sys.path.insert(0, str(examples))
    import causal_lm

    accel = Accelerator(
        backend="ddp",
        gradient_accumulation_steps=3,
        seed=0,
        count_items=gradsync.count_label_tokens,
        log_with="tensorboard",
        project_dir=project_dir,
    )
    accel.init_trackers("gpt2")
    model = causal_lm.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(
        causal_lm.Sequences(24), batch_size=2, shuffle=False, collate_fn=causal_lm.collate
    )
    model, opt, loader = accel.prepare(model, opt, loader)
    sums: list[list[float]] = [[]]
    tokens: list[list[int]] = [[]]
    for batch in loader:
        with accel.accumulate(model):
            loss = causal_lm.summed_loss(model, batch)
            sums[-1].append(loss.item())
            tokens[-1].append(gradsync.count_label_tokens(batch))
            accel.backward(loss, reduction="sum")
            opt.step()
            opt.zero_grad()
        if accel.sync_gradients:
            accel.log({"loss": accel.window_loss})
            sums.append([])
            tokens.append([])
    all_sums, all_tokens = _gathered(sums[:-1]), _gathered(tokens[:-1])
    expected = [
        sum(sum(r[w]) for r in all_sums) / sum(sum(r[w]) for r in all_tokens)
        for w in range(len(sums) - 1)
    ]
    accel.end_training()
    return {"expected": expected}
