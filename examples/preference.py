"""Preference tuning (DPO) under gradient accumulation, with a frozen reference model.

    pip install 'gradsync[hf]'
    gradsync launch --nproc-per-node 2 --gradient-accumulation-steps 4 examples/preference.py

Each sample is a pair (prompt, chosen, rejected); the collate function puts both answers of a
pair into the same micro-batch, so a pair is never split across micro-batches or ranks. The
reference model has no trainable parameters: gradsync never wraps it in DDP (on FSDP2 it is
sharded for its forward only; on DeepSpeed it stays whole on every rank), and
`accel.accumulate(policy, reference)` names both models of the micro-step.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from gradsync import Accelerator

VOCAB = 32


class PreferencePairs(Dataset[dict[str, Any]]):
    """A prompt continues with a fixed-step pattern; the chosen answer follows the pattern,
    the rejected one is random tokens."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            start, step = int(torch.randint(0, VOCAB, (1,), generator=g)), 1 + i % 3
            p_len = int(torch.randint(3, 7, (1,), generator=g))
            a_len = int(torch.randint(2, 6, (1,), generator=g))
            seq = (start + step * torch.arange(p_len + a_len)) % VOCAB
            rejected = torch.randint(0, VOCAB, (a_len,), generator=g)
            self.items.append(
                {"prompt": seq[:p_len], "chosen": seq[p_len:], "rejected": rejected, "id": i}
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def collate_pairs(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Rows 2j and 2j+1 are pair j's prompt+chosen and prompt+rejected; ``labels`` mark the
    answer tokens (-100 on the prompt and the padding)."""
    seqs, answers = [], []
    for r in rows:
        for answer in (r["chosen"], r["rejected"]):
            seqs.append(torch.cat([r["prompt"], answer]))
            answers.append(len(answer))
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    labels = torch.full((len(seqs), longest), -100, dtype=torch.long)
    for j, (s, a) in enumerate(zip(seqs, answers)):
        ids[j, : len(s)] = s
        labels[j, len(s) - a : len(s)] = s[len(s) - a :]
    pair = torch.tensor([r["id"] for r in rows]).repeat_interleave(2)
    role = torch.tensor([0, 1]).repeat(len(rows))  # 0 chosen, 1 rejected
    return {"input_ids": ids, "labels": labels, "pair": pair, "role": role}


def make_model(seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def answer_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per sequence: the summed log-probability of its answer tokens."""
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    picked = torch.gather(
        F.log_softmax(logits, dim=-1), 2, labels.clamp(min=0).unsqueeze(-1)
    ).squeeze(-1)
    return (picked * mask).sum(dim=1)


def dpo_loss(
    policy: torch.nn.Module,
    reference: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    beta: float = 0.5,
) -> torch.Tensor:
    """The DPO loss, mean over the micro-batch's pairs."""
    with torch.no_grad():
        ref = answer_logprobs(reference, batch)
    pol = answer_logprobs(policy, batch)
    margin = (pol[0::2] - ref[0::2]) - (pol[1::2] - ref[1::2])
    return -F.logsigmoid(beta * margin).mean()


def train(
    accel: Accelerator,
    *,
    pairs: int = 44,
    micro_batch: int = 2,
    epochs: int = 1,
    lr: float = 0.05,
    log: bool = False,
) -> dict[str, Any]:
    """Train the policy; returns the pairs each micro-step saw, per window."""
    policy = make_model()
    reference = copy.deepcopy(policy).requires_grad_(False).eval()
    optimizer = torch.optim.SGD(policy.parameters(), lr=lr)
    loader = DataLoader(
        PreferencePairs(pairs), batch_size=micro_batch, shuffle=True, collate_fn=collate_pairs
    )
    policy, optimizer, loader = accel.prepare(policy, optimizer, loader)
    reference = accel.prepare(reference)
    windows: list[list[list[list[int]]]] = []
    current: list[list[list[int]]] = []
    losses: list[float] = []
    for _ in range(epochs):
        for batch in loader:
            with accel.accumulate(policy, reference):
                loss = dpo_loss(policy, reference, batch)
                accel.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            current.append(torch.stack([batch["pair"], batch["role"]], 1).tolist())
            if accel.sync_gradients:
                windows.append(current)
                current = []
                losses.append(float(accel.reduce(loss.detach(), "mean")))
                if log:
                    accel.print(f"step {len(losses):3d}  DPO loss {losses[-1]:.4f}")
    return {"windows": windows, "losses": losses, "policy": accel.get_state_dict(policy)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    accel = Accelerator(seed=0)
    out = train(
        accel, pairs=args.pairs, micro_batch=args.micro_batch_size, epochs=args.epochs, log=True
    )
    accel.print(f"DPO loss: first step {out['losses'][0]:.4f} -> last step {out['losses'][-1]:.4f}")


if __name__ == "__main__":
    main()
