"""A checkpointed run the way Accelerate's by_feature/checkpointing.py writes one: folders
named ``step_{N}`` after N batches, resumed through load_state and skip_first_batches with
the script's own arithmetic; a shuffled loader, dropout (the RNG matters), a linear LR
schedule, gradient accumulation and a registered object. ``--save_at`` takes batch counts
that end a window (mid-epoch); ``--resume_from_checkpoint`` may name a folder the other
library wrote.

On FSDP2 (gradsync's; Accelerate trains FSDP only on accelerators): ``--state_dict_type
FULL_STATE_DICT`` asks gradsync.accelerate for Accelerate's full layout, and
``--full_state_copy DIR`` writes, at every save, the model and optimizer files of that
layout into ``DIR/step_N`` as Accelerate's ``save_fsdp_model`` / ``save_fsdp_optimizer``
write them for FSDP2 (full state dicts gathered to rank 0's CPU, ``torch.save`` by rank 0)."""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--save_at", type=int, nargs="*", default=[])
parser.add_argument("--resume_from_checkpoint", default=None)
parser.add_argument(
    "--skip_by",
    choices=("skip_first_batches", "continue"),
    default="skip_first_batches",
    help="how the resumed epoch skips the batches consumed before the save",
)
parser.add_argument("--state_dict_type", default=None)
parser.add_argument("--full_state_copy", default=None)
args = parser.parse_args()


def save_full_state(folder: str) -> None:
    """Accelerate's FULL_STATE_DICT files of FSDP2, written by its own recipe."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    many = accelerator.num_processes > 1
    options = StateDictOptions(full_state_dict=True, cpu_offload=many, broadcast_from_rank0=many)
    module = accelerator.unwrap_model(model)
    weights = get_model_state_dict(module, options=options)
    inner = getattr(optimizer, "optimizer", optimizer)
    optim = get_optimizer_state_dict(module, inner, options=options)
    if accelerator.is_main_process:
        os.makedirs(folder, exist_ok=True)
        torch.save(weights, os.path.join(folder, "pytorch_model_fsdp.bin"))
        torch.save(optim, os.path.join(folder, "optimizer.bin"))
    accelerator.wait_for_everyone()


class Seen:
    """A registered object: the samples this run and its predecessors trained on."""

    def __init__(self) -> None:
        self.samples = 0
        self.total = torch.zeros(())

    def state_dict(self) -> dict:
        return {"samples": self.samples, "total": self.total.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.samples = int(state["samples"])
        self.total = state["total"].clone()


layout = {"fsdp_state_dict_type": args.state_dict_type} if args.state_dict_type else {}
accelerator = Accelerator(gradient_accumulation_steps=2, **layout)
set_seed(11)
g = torch.Generator().manual_seed(3)
x = torch.randn(40, 6, generator=g)
y = (x.sum(1, keepdim=True) > 0).float()
data = [{"x": a, "y": b} for a, b in zip(x, y)]
model = torch.nn.Sequential(
    torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
)
loader = DataLoader(data, batch_size=4, shuffle=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = get_linear_schedule_with_warmup(optimizer, 2, 40)
seen = Seen()
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
accelerator.register_for_checkpointing(seen)

overall_step = 0
starting_epoch = 0
resume_step = None
if args.resume_from_checkpoint:
    accelerator.load_state(args.resume_from_checkpoint)
    name = os.path.basename(args.resume_from_checkpoint.rstrip("/"))
    resume_step = int(name.replace("step_", ""))
    starting_epoch = resume_step // len(loader)
    overall_step = resume_step
    resume_step -= starting_epoch * len(loader)

trained = 0
losses = []
for epoch in range(starting_epoch, args.epochs):
    model.train()
    skipping = bool(args.resume_from_checkpoint and epoch == starting_epoch and resume_step)
    if skipping and args.skip_by == "skip_first_batches":
        active = accelerator.skip_first_batches(loader, resume_step)
    else:
        active = loader
    for step, batch in enumerate(active):
        if skipping and args.skip_by == "continue" and step < resume_step:
            continue  # the idiom of older scripts: skip inside the loop
        with accelerator.accumulate(model):
            out = model(batch["x"])
            loss = torch.nn.functional.binary_cross_entropy_with_logits(out, batch["y"])
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        seen.samples += len(batch["x"])
        seen.total += batch["x"].sum().detach()
        losses.append(loss.item())
        trained += 1
        overall_step += 1
        if overall_step in args.save_at:
            accelerator.save_state(os.path.join(args.out, f"step_{overall_step}"))
            if args.full_state_copy:
                save_full_state(os.path.join(args.full_state_copy, f"step_{overall_step}"))

accelerator.wait_for_everyone()
state = {k: v.detach().cpu().clone() for k, v in accelerator.get_state_dict(model).items()}
if accelerator.is_main_process:
    torch.save(state, os.path.join(args.out, "final.pt"))
with open(os.path.join(args.out, f"final_{accelerator.process_index}.json"), "w") as f:
    json.dump(
        {
            "trained": trained,
            "lr": scheduler.get_last_lr()[0],
            "seen": seen.samples,
            "total": seen.total.item(),
            "losses": losses,
        },
        f,
    )
accelerator.end_training()
