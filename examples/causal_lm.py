"""A small causal language model fine-tuned on variable-length sequences, token-weighted.

    pip install 'gradsync[hf]'
    gradsync launch --nproc-per-node 2 --gradient-accumulation-steps 4 examples/causal_lm.py

Each optimizer step's update is the mean loss over every token of the global window (all
micro-batches, all ranks), as one process on the whole window would compute it, however
unevenly the tokens fall into micro-batches. The model is a GPT-2 built from a tiny config
(nothing is downloaded); the data are sequences of lengths 4-24 drawn from a fixed pattern,
so the loss visibly falls. It prints the global token-mean loss of every optimizer step.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import gradsync
from gradsync import Accelerator

VOCAB = 32
MAX_LEN = 24


class Sequences(Dataset[dict[str, Any]]):
    """Sequences of lengths 4-24 (token t+1 = token t + a per-sequence step, mod VOCAB), each
    with its id."""

    def __init__(self, n: int, seed: int = 0, min_len: int = 4, max_len: int = MAX_LEN) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
            start = int(torch.randint(0, VOCAB, (1,), generator=g))
            step = int(torch.randint(1, 4, (1,), generator=g))
            ids = (start + step * torch.arange(length)) % VOCAB
            self.items.append({"input_ids": ids, "id": i})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence; padded positions get label -100 (ignored)."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    labels = torch.full((len(rows), longest), -100, dtype=torch.long)
    for j, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[j, :n] = r["input_ids"]
        labels[j, :n] = r["input_ids"]
    return {"input_ids": ids, "labels": labels, "id": torch.tensor([r["id"] for r in rows])}


def make_model(seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=MAX_LEN,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        loss_type="ForCausalLM",
    )
    return GPT2LMHeadModel(config)


def summed_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy summed over the batch's predicted tokens (labels shifted by one)."""
    logits = model(input_ids=batch["input_ids"]).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--log-with",
        default=None,
        help="trackers for the loss, e.g. tensorboard or csv (files in --project-dir)",
    )
    parser.add_argument("--project-dir", default="runs")
    args = parser.parse_args()

    accel = Accelerator(
        seed=0,
        count_items=gradsync.count_label_tokens,
        log_with=args.log_with,
        project_dir=args.project_dir if args.log_with else None,
    )
    accel.init_trackers("causal_lm", config=vars(args))
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(
        Sequences(args.samples), batch_size=args.micro_batch_size, shuffle=True, collate_fn=collate
    )
    model, optimizer, loader = accel.prepare(model, optimizer, loader)
    accel.print(
        f"backend={accel.backend} world={accel.world_size} "
        f"accumulation={accel.gradient_accumulation_steps} batches/rank/epoch={len(loader)}"
    )
    losses: list[float] = []
    for _ in range(args.epochs):
        for batch in loader:
            with accel.accumulate(model):
                loss = summed_loss(model, batch)
                accel.backward(loss, reduction="sum")  # update = mean over the window's tokens
                optimizer.step()
                optimizer.zero_grad()
            if accel.sync_gradients:
                # the global token mean of the window, the same number on every rank: what
                # the update minimised (not the last micro-batch's loss)
                losses.append(accel.window_loss)
                accel.log({"loss": accel.window_loss, "tokens": accel.window_items})
                accel.print(
                    f"step {len(losses):3d}  tokens {accel.window_items:5d}  loss {losses[-1]:.4f}"
                )
    accel.print(
        f"token-mean loss: first step {losses[0]:.4f} -> last step {losses[-1]:.4f} "
        f"over {len(losses)} optimizer steps"
    )
    accel.end_training()


if __name__ == "__main__":
    main()
