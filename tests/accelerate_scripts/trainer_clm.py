"""A tiny causal LM trained by Transformers' ``Trainer``, the way a Trainer user writes it: a
GPT-2 built from a config (nothing downloaded), ``gradient_accumulation_steps=4``, a partial
last window in every epoch, a loss and grad norm logged every step, an evaluation every 3
steps and a checkpoint every 3 steps (mid-epoch), optionally resumed from one.

Writes ``final.pt`` (the trained parameters) and ``final.json`` (the logged history: losses,
grad norms, learning rates, evaluation losses) on the main process.
"""

import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--resume_from_checkpoint", default=None)
parser.add_argument("--max_steps", type=int, default=-1)
args = parser.parse_args()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


g = torch.Generator().manual_seed(1)
samples = torch.randint(0, 64, (64, 16), generator=g)
torch.manual_seed(7)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))

training_args = TrainingArguments(
    output_dir=args.out,
    per_device_train_batch_size=2,
    per_device_eval_batch_size=2,
    gradient_accumulation_steps=4,
    num_train_epochs=2,
    max_steps=args.max_steps,
    learning_rate=3e-3,
    warmup_steps=1,
    max_grad_norm=1.0,
    logging_steps=1,
    eval_strategy="steps",
    eval_steps=3,
    save_strategy="steps",
    save_steps=3,
    seed=7,
    report_to="none",
    use_cpu=True,
    dataloader_num_workers=0,
    disable_tqdm=True,
)
trainer = Trainer(
    model=model,
    args=training_args,
    train_dataset=Tokens(samples[:52]),
    eval_dataset=Tokens(samples[52:]),
)
trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
final_eval = trainer.evaluate()
state = trainer.accelerator.get_state_dict(trainer.model)  # every rank: a sharded model gathers
if trainer.is_world_process_zero():
    torch.save(
        {k: v.detach().cpu().clone() for k, v in state.items()}, os.path.join(args.out, "final.pt")
    )
    history = trainer.state.log_history
    with open(os.path.join(args.out, "final.json"), "w") as f:
        json.dump({"history": history, "final_eval": final_eval}, f)
