"""Tensor parallel x FSDP2 x replicas on one N-D mesh (``parallelism``), run by mp_worker.py in
one audited gloo group of 4 ranks (the reshard loads in a 4-rank 1-D group and in one
process; the 3-D case in 8 ranks)."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradsync import Accelerator

from scenarios.common import Loop, make_model, make_optimizer, micro_step, to_lists, train

#: Imported on first use by a scenario here (mp_worker.py's agent imports it once).
PRELOAD = ("transformers.models.llama.modeling_llama",)

#: The test network (scenarios.common.Net) split over tp: inp colwise, block 0 rowwise,
#: block 1 colwise, head rowwise (every Linear is split; the tanh between runs on shards).
NET_PLAN = {
    "inp": "colwise",
    "blocks.0.lin": "rowwise",
    "blocks.1.lin": "colwise",
    "head": "rowwise",
}
#: Only the first pair split: block 1 and the head stay whole (FSDP2 shards them on dp_shard
#: alone), so the gradients live on two meshes.
PARTIAL_PLAN = {"inp": "colwise", "blocks.0.lin": "rowwise"}


def _accel(dims: dict[str, int], steps: int | str, policy: str, **options: Any) -> Accelerator:
    options = {k: v for k, v in options.items() if v is not None}
    options.setdefault("tp_plan", NET_PLAN if dims.get("tp", 1) != 1 else None)
    if options["tp_plan"] is None:
        del options["tp_plan"]
    return Accelerator(
        backend="fsdp",
        parallelism=dims,
        gradient_accumulation_steps=steps,
        sync_policy=policy,
        seed=0,
        audit=True,
        **options,
    )


def _where(accel: Accelerator) -> dict[str, Any]:
    mesh = accel.mesh
    backend = accel._backend  # type: ignore[attr-defined]
    data = backend.data_parallel
    return {
        "coords": [mesh.get_local_rank(d) for d in ("dp_replicate", "dp_shard", "tp")],
        "mesh_shape": list(mesh.shape),
        "mesh_names": list(mesh.mesh_dim_names),
        "data_rank": data.rank,
        "data_size": data.size,
        "memory": backend.memory,
        "reason": accel.sync_policy_reason,
    }


class Warnings(logging.Handler):
    """gradsync's warnings during a run (the self-check's among them)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def train_tp(
    *,
    dims: dict[str, int],
    steps: int | str,
    loop: Loop,
    policy: str = "auto",
    mixed_precision: str | None = None,
    sync_budget: int | None = None,
    partial: bool = False,
) -> dict[str, Any]:
    accel = _accel(
        dims,
        steps,
        policy,
        mixed_precision=mixed_precision,
        sync_memory_budget=sync_budget,
        tp_plan=PARTIAL_PLAN if partial else None,
    )
    warnings = Warnings()
    logging.getLogger("gradsync").addHandler(warnings)
    try:
        out = train(accel, loop, model=make_model())
    finally:
        logging.getLogger("gradsync").removeHandler(warnings)
    out["warnings"] = warnings.lines
    out.update(_where(accel))
    out["summaries"] = (
        [accel.audit.summary(w) for w in accel.audit.windows()] if accel.audit else []
    )
    return out


def auto_choice(*, dims: dict[str, int], budget: int) -> dict[str, Any]:
    """What auto picks on the mesh for a budget (the model holds 705 fp32 parameters)."""
    accel = _accel(dims, 2, "auto", sync_memory_budget=budget)
    accel.prepare(make_model())
    return {"policy": accel.sync_policy, **_where(accel)}


def metrics_over_data_ranks(*, dims: dict[str, int]) -> dict[str, Any]:
    """gather_for_metrics and reduce run over the data-parallel ranks: each sample once."""
    from torch.utils.data import DataLoader

    from scenarios.common import Indexed

    accel = _accel(dims, 1, "defer")
    model = accel.prepare(make_model())
    loader = accel.prepare(DataLoader(Indexed(20), batch_size=2))
    seen: list[int] = []
    for _, _, idx in loader:
        seen += accel.gather_for_metrics(idx).tolist()
    one = torch.ones(1)
    return {
        "seen": seen,
        "sum": float(accel.reduce(one, "sum")),
        "mean": float(accel.reduce(one, "mean")),
        "trained": sum(p.numel() for p in model.parameters()) > 0,
    }


# -- a Transformers model through its own plan --------------------------------------------
VOCAB, SEQ = 64, 8


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Token sequences with a few positions masked out of the loss (-100), uneven per sample."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.labels = self.ids.clone()
        for i in range(n):
            self.labels[i, : i % 4] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i], "index": torch.tensor(i)}


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


def token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The summed next-token loss over the batch's counted tokens."""
    logits = model(input_ids=batch["input_ids"]).logits
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB).float(),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )


def train_llama(
    *, dims: dict[str, int], steps: int, samples: int, clip: float | None = None
) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    accel = Accelerator(
        backend="fsdp",
        parallelism=dims,
        tp_plan="auto",
        gradient_accumulation_steps=steps,
        sync_policy="defer",
        seed=0,
        audit=True,
        count_items="gradsync:count_label_tokens",
    )
    raw = tiny_llama()
    opt = make_optimizer(raw.parameters(), "adam", 0.01)
    model, opt, loader = accel.prepare(
        raw, opt, DataLoader(Tokens(samples), batch_size=2, shuffle=True)
    )
    windows: list[list[list[int]]] = []
    current: list[list[int]] = []
    norms: list[float] = []
    losses: list[float | None] = []
    for batch in loader:
        with accel.accumulate(model):
            accel.backward(token_loss(model, batch), reduction="sum")
            current.append(batch["index"].tolist())
            if clip is not None and accel.sync_gradients:
                norms.append(float(accel.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            opt.zero_grad()
        if accel.sync_gradients:
            windows.append(current)
            current = []
            losses.append(accel.window_loss)
    return {
        "state": to_lists(accel.get_state_dict(model)),
        "windows": windows,
        "optimizer_steps": accel.optimizer_steps,
        "window_losses": losses,
        "norms": norms,
        **_where(accel),
    }


def llama_reference(
    windows: list[list[list[int]]], samples: int, clip: float | None = None
) -> dict[str, Any]:
    """One process on the same global windows: each window's summed token loss over its
    counted tokens (parent side)."""
    data = Tokens(samples)
    model = tiny_llama()
    opt = make_optimizer(model.parameters(), "adam", 0.01)
    norms: list[float] = []
    losses: list[float] = []
    for window in windows:
        ids = [i for mb in window for i in mb]
        batch = {"input_ids": data.ids[ids], "labels": data.labels[ids]}
        items = int((batch["labels"][:, 1:] != -100).sum())
        opt.zero_grad()
        loss = token_loss(model, batch) / items
        loss.backward()
        losses.append(float(loss.detach()))
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return {"state": to_lists(model.state_dict()), "norms": norms, "losses": losses}


# -- checkpoints ---------------------------------------------------------------------------
def _batches(
    n: int, seed: int, dims: dict[str, int] | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's own micro-batches (the same on the ranks of a tp group)."""
    tp = dims.get("tp", 1) if dims else 1
    g = torch.Generator().manual_seed(1000 * seed + dist.get_rank() // tp)
    return [(torch.randn(2, 8, generator=g), torch.randn(2, 1, generator=g)) for _ in range(n)]


def _prepared(
    dims: dict[str, int] | None, policy: str
) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer]:
    if dims is None:
        accel = Accelerator(
            backend="fsdp", gradient_accumulation_steps=4, sync_policy=policy, seed=0
        )
    else:
        accel = _accel(dims, 4, policy)
    raw = make_model()
    model, opt = accel.prepare(raw, make_optimizer(raw.parameters(), "adam", 0.01))
    return accel, model, opt


def resume_mid_window(*, dims: dict[str, int], policy: str, folder: str) -> dict[str, Any]:
    """A window of 4 saved after 2 micro-steps, finished in the same run and in a fresh one
    that loads the checkpoint: both end with the same parameters (bitwise)."""
    data = _batches(8, 7, dims)
    accel, model, opt = _prepared(dims, policy)
    for x, y in data[:6]:
        micro_step(accel, model, opt, x, y)
    accel.save_state(folder)
    for x, y in data[6:]:
        micro_step(accel, model, opt, x, y)
    seen: dict[str, Any] = {
        "went_on": to_lists(accel.get_state_dict(model)),
        "steps": accel.optimizer_steps,
    }
    accel2, model2, opt2 = _prepared(dims, policy)
    accel2.load_state(folder)
    for x, y in data[6:]:
        micro_step(accel2, model2, opt2, x, y)
    seen["resumed"] = to_lists(accel2.get_state_dict(model2))
    seen["resumed_steps"] = accel2.optimizer_steps
    return seen


def save_at_boundary(*, dims: dict[str, int] | None, folder: str) -> dict[str, Any]:
    """Two windows, saved at the boundary: the full state (and Adam's, gathered)."""
    accel, model, opt = _prepared(dims, "defer")
    for x, y in _batches(8, 3, dims):
        micro_step(accel, model, opt, x, y)
    accel.save_state(folder)
    return {
        "state": to_lists(accel.get_state_dict(model)),
        "steps": accel.optimizer_steps,
        "mesh": list(accel.mesh.shape) if accel.mesh is not None else None,
    }


def load_boundary(
    *, dims: dict[str, int] | None, folder: str, then_save: str | None = None
) -> dict[str, Any]:
    """That checkpoint loaded on this group's mesh (``dims``; None: the default 1-D mesh, or
    one process); with ``then_save``, saved again there (for the way back)."""
    accel, model, opt = _prepared(dims, "defer")
    accel.load_state(folder)
    adam = opt.state_dict()["state"]
    steps = sorted({float(s["step"]) for s in adam.values()})
    out = {
        "state": to_lists(accel.get_state_dict(model)),
        "steps": accel.optimizer_steps,
        "adam_steps": steps,
        "world": accel.world_size,
        "mesh": list(accel.mesh.shape) if accel.mesh is not None else None,
    }
    if then_save is not None:
        accel.save_state(then_save)
    return out


def clip_norms_are_global(*, dims: dict[str, int]) -> dict[str, Any]:
    """clip_grad_norm_ over the DTensor gradients of the split and sharded model returns the
    norm of the whole gradient (compared with the gathered gradients' norm)."""
    accel = _accel(dims, 1, "every_step")
    raw = make_model()
    model, _opt = accel.prepare(raw, make_optimizer(raw.parameters(), "sgd", 0.0))
    x, y = _batches(1, 11, dims)[0]
    with accel.accumulate(model):
        accel.backward(F.mse_loss(model(x), y))
        full = [p.grad.full_tensor() for p in model.parameters()]  # type: ignore[union-attr]
        norm = accel.clip_grad_norm_(model.parameters(), 1e9)
    return {"norm": float(norm), "gathered": math.sqrt(sum(float((g * g).sum()) for g in full))}
