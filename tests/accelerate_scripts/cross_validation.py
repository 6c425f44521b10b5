"""Cross-validation the way Accelerate's by_feature/cross_validation.py does it: one model
per fold, trained on the fold's training loader and evaluated on its validation loader
(both prepared), then predictions over a test loader that is never prepared (every process
runs the whole test set) gathered with gather_for_metrics, and the folds' test logits
averaged at the end. --train_samples 47 makes folds of 16, 16 and 15 samples (their
validation loaders end in different remainders); 45 makes three folds of 15."""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--train_samples", type=int, default=47)
parser.add_argument("--test_samples", type=int, default=13)
parser.add_argument("--num_folds", type=int, default=3)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
args = parser.parse_args()

accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
set_seed(42)

g = torch.Generator().manual_seed(0)
n = args.train_samples + args.test_samples
x = torch.randn(n, 6, generator=g)
y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
samples = [{"x": x[i], "labels": y[i], "idx": torch.tensor(i)} for i in range(n)]
train_set, test_set = samples[: args.train_samples], samples[args.train_samples :]

# contiguous folds, the first ones one sample larger (as KFold splits)
sizes = [
    args.train_samples // args.num_folds + (i < args.train_samples % args.num_folds)
    for i in range(args.num_folds)
]
bounds = [sum(sizes[:i]) for i in range(args.num_folds + 1)]

folds = []
test_predictions = []
for fold in range(args.num_folds):
    valid_idxs = list(range(bounds[fold], bounds[fold + 1]))
    train_idxs = [i for i in range(args.train_samples) if i not in valid_idxs]
    train_dataloader = DataLoader([train_set[i] for i in train_idxs], shuffle=True, batch_size=4)
    eval_dataloader = DataLoader([train_set[i] for i in valid_idxs], shuffle=False, batch_size=4)
    test_dataloader = DataLoader(test_set, shuffle=False, batch_size=4)

    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )
    for _epoch in range(args.epochs):
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"])
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        model.eval()
        eval_ids = []
        for batch in eval_dataloader:
            with torch.no_grad():
                predictions = model(batch["x"]).argmax(dim=-1)
            predictions, ids = accelerator.gather_for_metrics((predictions, batch["idx"]))
            eval_ids += ids.tolist()

    fold_predictions, fold_ids = [], []
    for batch in test_dataloader:  # never prepared: every process predicts every sample
        with torch.no_grad():
            logits = model(batch["x"])
        logits, ids = accelerator.gather_for_metrics((logits, batch["idx"]))
        fold_predictions.append(logits.cpu())
        fold_ids += ids.tolist()
    test_predictions.append(torch.cat(fold_predictions, dim=0))
    folds.append(
        {
            "eval_ids": eval_ids,
            "test_ids": fold_ids,
            "params": {
                k: v.detach().cpu().clone() for k, v in accelerator.get_state_dict(model).items()
            },
        }
    )
    accelerator.free_memory()

# the folds' average, as the example computes it (all folds' rows must line up)
averaged = torch.stack(test_predictions, dim=0).sum(dim=0).div(args.num_folds)
labels = y[torch.tensor(folds[-1]["test_ids"], dtype=torch.long)]
accuracy = (averaged.argmax(dim=-1) == labels).float().mean().item()
if accelerator.is_main_process:
    torch.save({"folds": folds, "averaged": averaged}, os.path.join(args.out, "final.pt"))
    with open(os.path.join(args.out, "final.json"), "w") as f:
        json.dump(
            {
                "eval_ids": [fold["eval_ids"] for fold in folds],
                "test_ids": [fold["test_ids"] for fold in folds],
                "accuracy": accuracy,
            },
            f,
        )
accelerator.wait_for_everyone()
