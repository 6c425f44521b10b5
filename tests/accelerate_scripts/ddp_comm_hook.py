"""A DDP communication hook chosen on the command line, the way Accelerate's
by_feature/ddp_comm_hook.py chooses it: ``DistributedDataParallelKwargs(comm_hook=...,
comm_wrapper=..., comm_state_option=...)`` with ``DDPCommunicationHookType`` values, handed
to the Accelerator as a kwargs handler; then gradient accumulation under ``accumulate``, a
scheduler, and an evaluation gathered with gather_for_metrics.

Writes the final parameters (``final.pt``) and the evaluation accuracy per epoch and the last
window's loss (``final.json``) into --out."""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, set_seed
from torch.utils.data import DataLoader

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--ddp_comm_hook", default="no", choices=DDPCommunicationHookType.list())
parser.add_argument("--ddp_comm_wrapper", default="no", choices=["no", "fp16", "bf16"])
parser.add_argument("--comm_state_option", default="{}", help="PowerSGD's options, as JSON")
parser.add_argument("--gradient_accumulation_steps", type=int, default=3)
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

handler = DistributedDataParallelKwargs(
    comm_hook=DDPCommunicationHookType(args.ddp_comm_hook),
    comm_wrapper=DDPCommunicationHookType(args.ddp_comm_wrapper),
    comm_state_option=json.loads(args.comm_state_option),
)
accelerator = Accelerator(
    gradient_accumulation_steps=args.gradient_accumulation_steps, kwargs_handlers=[handler]
)
set_seed(7)

g = torch.Generator().manual_seed(11)
x = torch.randn(72, 10, generator=g)
y = (x[:, 1] + x[:, 4] - x[:, 7] > 0).long()
rows = [{"x": x[i], "labels": y[i]} for i in range(72)]
train_dataloader = DataLoader(rows[:56], shuffle=True, batch_size=4)
eval_dataloader = DataLoader(rows[56:], shuffle=False, batch_size=4)
# Wide enough that PowerSGD compresses the hidden weights (rank 1 of a 24 x 24 matrix).
model = torch.nn.Sequential(
    torch.nn.Linear(10, 24),
    torch.nn.Tanh(),
    torch.nn.Linear(24, 24),
    torch.nn.Tanh(),
    torch.nn.Linear(24, 2),
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
)

accuracies = []
last_loss = None
for _epoch in range(args.epochs):
    model.train()
    for batch in train_dataloader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"])
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        last_loss = loss.item()
    model.eval()
    correct = total = 0
    for batch in eval_dataloader:
        with torch.no_grad():
            predictions = model(batch["x"]).argmax(dim=-1)
        predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
        correct += (predictions == references).sum().item()
        total += len(references)
    accuracies.append(correct / total)

state = {k: v.detach().cpu().clone() for k, v in accelerator.get_state_dict(model).items()}
if accelerator.is_main_process:
    torch.save(state, os.path.join(args.out, "final.pt"))
    with open(os.path.join(args.out, "final.json"), "w") as f:
        json.dump({"accuracies": accuracies, "last_loss": last_loss}, f)
accelerator.wait_for_everyone()
