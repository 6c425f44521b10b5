"""Classification the way Accelerate's complete_nlp_example.py does it: accuracy from
gather_for_metrics over an evaluation set that does not divide evenly over the processes,
checkpoints named by ProjectConfiguration(automatic_checkpoint_naming=True) at every
epoch's end with total_limit, and a resume from the newest of them."""

import argparse
import json
import os

import torch
from accelerate import Accelerator, DistributedType
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--stop_after_epoch", type=int, default=None)
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()

project = ProjectConfiguration(
    project_dir=args.out, automatic_checkpoint_naming=True, total_limit=2
)
accelerator = Accelerator(gradient_accumulation_steps=3, project_config=project)
if accelerator.distributed_type == DistributedType.NO:
    accelerator.print("one process")
set_seed(3)
g = torch.Generator().manual_seed(5)
x = torch.randn(70, 6, generator=g)
y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
train = TensorDataset(x[:50], y[:50])
evals = TensorDataset(x[50:], y[50:])  # 20 samples: not a multiple of 2 ranks x 3
model = torch.nn.Sequential(
    torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 2)
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
train_dl = DataLoader(train, batch_size=4, shuffle=True)
eval_dl = DataLoader(evals, batch_size=3)
model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
    model, optimizer, train_dl, eval_dl, scheduler
)

start = 0
if args.resume:
    accelerator.load_state()  # the newest checkpoint_N under project_dir/checkpoints
    start = accelerator.save_iteration

accuracies = []
for epoch in range(start, args.epochs):
    model.train()
    for inputs, targets in train_dl:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.cross_entropy(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    model.eval()
    correct, seen = 0, 0
    for inputs, targets in eval_dl:
        with torch.no_grad():
            predictions = model(inputs).argmax(dim=-1)
        predictions, references = accelerator.gather_for_metrics((predictions, targets))
        correct += int((predictions == references).sum())
        seen += len(references)
    accuracies.append([correct, seen])
    accelerator.print(f"epoch {epoch}: accuracy {correct}/{seen}")
    accelerator.save_state()
    if args.stop_after_epoch is not None and epoch >= args.stop_after_epoch:
        break

state = {k: v.detach().cpu().clone() for k, v in accelerator.get_state_dict(model).items()}
if accelerator.is_main_process:
    torch.save(state, os.path.join(args.out, "final.pt"))
    kept = sorted(os.listdir(os.path.join(args.out, "checkpoints")))
    with open(os.path.join(args.out, "final.json"), "w") as f:
        json.dump(
            {"accuracies": accuracies, "checkpoints": kept, "lr": scheduler.get_last_lr()[0]}, f
        )
