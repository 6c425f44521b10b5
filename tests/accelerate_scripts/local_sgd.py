"""LocalSGD the way Accelerate's by_feature/local_sgd.py uses it: gradient accumulation
inside a LocalSGD block that keeps the gradients local and averages the parameters every
--local_sgd_steps batches (``local_sgd.step()`` inside ``accumulate``) and when the block
ends; evaluation gathered with gather_for_metrics.

``--local_sgd_from accelerate`` takes Accelerate's own ``accelerate.local_sgd.LocalSGD``
whichever Accelerator the script imports (a module name the import respelling leaves alone).
The script also records whether gradsync's self-check is watching the run."""

import argparse
import importlib
import json
import os

import torch
from accelerate import Accelerator, DistributedType
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
parser.add_argument("--local_sgd_steps", type=int, default=3)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--local_sgd_from", choices=["import", "accelerate"], default="import")
args = parser.parse_args()

if args.local_sgd_from == "accelerate":
    LocalSGD = importlib.import_module("accelerate" + ".local_sgd").LocalSGD
else:
    from accelerate.local_sgd import LocalSGD

accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
if accelerator.distributed_type not in [
    DistributedType.NO,
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
]:
    raise NotImplementedError("LocalSGD is supported only for CPUs and GPUs (no DeepSpeed or FSDP)")
check = getattr(accelerator, "_self_check", None)  # gradsync's only
set_seed(42)

g = torch.Generator().manual_seed(3)
x = torch.randn(60, 6, generator=g)
y = (x[:, 0] - x[:, 2] > 0).long()
samples = [{"x": x[i], "labels": y[i], "idx": torch.tensor(i)} for i in range(60)]
train_dataloader = DataLoader(samples[:48], shuffle=True, batch_size=4)
eval_dataloader = DataLoader(samples[48:], shuffle=False, batch_size=4)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.05 * step))
model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
)

accuracies = []
for _epoch in range(args.epochs):
    model.train()
    with LocalSGD(
        accelerator=accelerator,
        model=model,
        local_sgd_steps=args.local_sgd_steps,
        enabled=args.local_sgd_steps is not None,
    ) as local_sgd:
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                output = model(batch["x"])
                loss = torch.nn.functional.cross_entropy(output, batch["labels"])
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                local_sgd.step()
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
mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
same = accelerator.gather(mine[None]).cpu()  # every rank's parameters: averaged, so equal
if accelerator.is_main_process:
    torch.save(state, os.path.join(args.out, "final.pt"))
    with open(os.path.join(args.out, "final.json"), "w") as f:
        json.dump(
            {
                "accuracies": accuracies,
                "ranks_agree": bool((same == same[0]).all()),
                "self_check": None if check is None else True,
            },
            f,
        )
accelerator.wait_for_everyone()
