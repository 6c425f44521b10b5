"""A tiny Transformers ``LlamaForCausalLM`` (built from a config) split by layer names,
``pp_split=["model.layers.2"]``, trained with a token-weighted loss; run by mp_worker.py in the
pooled 2-rank (pp 2) and 4-rank (pp 2 x dp_shard 2) gloo groups. The one-process reference
is plain torch on the same global windows (no Accelerator)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from gradsync import Accelerator, ConfigError

from scenarios.common import to_lists

VOCAB = 64
SEQ = 8
SPLIT = ["model.layers.2"]
#: Four stages, two on each of two ranks (Interleaved1F1B): one decoder layer each.
SPLIT4 = ["model.layers.1", "model.layers.2", "model.layers.3"]


def make_llama(*, tied: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


class Tokens(Dataset[tuple[Any, ...]]):
    """Token ids and next-token labels, about a third of them masked (-100), so that the
    micro-batches hold different numbers of counted tokens. ``padded``: sequences of 3 to
    SEQ tokens, padded on the left (id 0, mask 0, label -100), with their padding mask."""

    def __init__(self, n: int, *, padded: bool = False) -> None:
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
        self.x, labels = ids[:, :-1], ids[:, 1:].clone()
        labels[torch.rand(n, SEQ, generator=g) < 0.35] = -100
        self.mask: torch.Tensor | None = None
        if padded:
            pads = torch.randint(0, SEQ - 2, (n, 1), generator=g)
            self.mask = (torch.arange(SEQ) >= pads).long()
            self.x = self.x * self.mask
            labels[self.mask == 0] = -100
        self.y = labels

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        if self.mask is None:
            return self.x[i], self.y[i], i
        return self.x[i], self.y[i], i, self.mask[i]

    def inputs(self, rows: Any) -> Any:
        """The model's inputs for ``rows``: the ids, or the ids and their padding mask."""
        if self.mask is None:
            return self.x[rows]
        return {"input_ids": self.x[rows], "attention_mask": self.mask[rows]}


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy over the counted (unmasked) tokens."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def counted(batch: Any) -> int:
    return int((batch[1] != -100).sum())


def train(
    *,
    dims: dict[str, int],
    schedule: str,
    samples: int,
    steps: int = 4,
    policy: str = "defer",
    split: list[str] | None = None,
    per_rank: int = 1,
    padded: bool = False,
) -> dict[str, Any]:
    """The loop a user writes, one pipeline_step per micro-step, token-weighted (``padded``:
    the inputs are the ids and their padding mask)."""
    accel = Accelerator(
        backend="fsdp",
        parallelism=dims,
        pp_split=split or SPLIT,
        pp_schedule=schedule,
        pp_microbatches=2,
        pp_stages_per_rank=per_rank,
        gradient_accumulation_steps=steps,
        sync_policy=policy,
        count_items=counted,
        seed=0,
        audit=True,
    )
    raw = make_llama()
    model, opt, loader = accel.prepare(
        raw,
        torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9),
        DataLoader(Tokens(samples, padded=padded), batch_size=4),
    )
    windows: list[list[list[int]]] = []
    current: list[list[int]] = []
    for x, y, idx, *mask in loader:
        inputs = {"input_ids": x, "attention_mask": mask[0]} if mask else x
        with accel.accumulate(model):
            accel.pipeline_step(model, inputs, y, token_loss, "sum")
            current.append(idx.tolist())
            opt.step()
            opt.zero_grad()
        if accel.sync_gradients:
            windows.append(current)
            current = []
    backend = accel._backend  # type: ignore[attr-defined]
    return {
        "windows": windows,
        "state": to_lists(accel.get_state_dict(model)),  # the whole model's, on every rank
        "held": sorted(accel.unwrap_model(model).state_dict()),  # this rank's stage's names
        "stage": accel.mesh.get_local_rank("pp"),
        "data_rank": backend.data_parallel.rank,
        "data_size": backend.data_parallel.size,
        "optimizer_steps": accel.optimizer_steps,
        "policy": accel.sync_policy,
        "padded": padded,
        "audit": [r.to_dict() for r in accel.audit.records] if accel.audit else [],
    }


def reference(rank_results: list[dict[str, Any]], samples: int) -> dict[str, Any]:
    """One process, plain torch, on the same global windows: each window's gradient is the
    summed token loss of every micro-batch of every data-parallel rank over its counted
    tokens."""
    data = Tokens(samples, padded=rank_results[0]["padded"])
    firsts = sorted((r for r in rank_results if r["stage"] == 0), key=lambda r: r["data_rank"])
    model = make_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for w in range(len(firsts[0]["windows"])):
        micro = [mb for r in firsts for mb in r["windows"][w]]
        items = sum(int((data.y[mb] != -100).sum()) for mb in micro)
        opt.zero_grad()
        total = sum(token_loss(_logits(model, data, mb), data.y[mb]) for mb in micro) / items
        total.backward()  # type: ignore[union-attr]
        opt.step()
    return to_lists(model.state_dict())


def _logits(model: nn.Module, data: Tokens, rows: list[int]) -> torch.Tensor:
    inputs = data.inputs(rows)
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return out.logits  # type: ignore[no-any-return]


def bad_mask() -> dict[str, Any]:
    """A padding mask whose shape is not the ids': one UsageError line on every stage."""
    accel = Accelerator(
        backend="fsdp", parallelism={"pp": 2}, pp_split=SPLIT, gradient_accumulation_steps=2
    )
    model = accel.prepare(make_llama())
    x = torch.zeros(4, SEQ, dtype=torch.long)
    with accel.accumulate(model):
        try:
            inputs = {"input_ids": x, "attention_mask": torch.ones(4, SEQ - 1)}
            accel.pipeline_step(model, inputs, x, token_loss)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


def refused_tied() -> dict[str, Any]:
    """A model whose head shares the embedding's weight: one ConfigError line at prepare."""
    accel = Accelerator(
        backend="fsdp", parallelism={"pp": 2}, pp_split=SPLIT, gradient_accumulation_steps=2
    )
    try:
        accel.prepare(make_llama(tied=True))
    except ConfigError as e:
        return {"error": str(e)}
    return {"error": None}
