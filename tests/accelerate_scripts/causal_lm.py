"""A causal LM trained the way Transformers' run_clm_no_trainer.py trains one: the LR
schedule sized for Accelerate's rule (warmup and total steps times the processes), a
partial last window, checkpoints every N steps named step_{N}, resumed through load_state
and skip_first_batches, a logger on the main process, optionally TensorBoard tracking."""

import argparse
import json
import math
import os

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

logger = get_logger(__name__)

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
parser.add_argument("--checkpointing_steps", default=None)
parser.add_argument("--resume_from_checkpoint", default=None)
parser.add_argument("--stop_after", type=int, default=None)  # the interruption a resume test needs
parser.add_argument("--with_tracking", action="store_true")
# run_clm_no_trainer.py's schedule flags (its own default warmup is 0)
parser.add_argument("--lr_scheduler_type", default="linear")
parser.add_argument("--num_warmup_steps", type=int, default=1)
args = parser.parse_args()

kwargs = {"log_with": "tensorboard", "project_dir": args.out} if args.with_tracking else {}
accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, **kwargs)
logger.info(accelerator.state, main_process_only=False)
set_seed(7)

g = torch.Generator().manual_seed(1)
samples = torch.randint(0, 64, (44, 16), generator=g)
train = [{"input_ids": s, "labels": s} for s in samples[:36]]
evals = [{"input_ids": s, "labels": s} for s in samples[36:]]
config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
model = GPT2LMHeadModel(config)
train_dataloader = DataLoader(train, shuffle=True, batch_size=4)
eval_dataloader = DataLoader(evals, batch_size=4)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

overrode_max_train_steps = True
num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
max_train_steps = args.epochs * num_update_steps_per_epoch
lr_scheduler = get_scheduler(
    name=args.lr_scheduler_type,
    optimizer=optimizer,
    num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
    num_training_steps=max_train_steps,
)

model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
)
num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
max_train_steps = args.epochs * num_update_steps_per_epoch

checkpointing_steps = int(args.checkpointing_steps) if args.checkpointing_steps else None
if args.with_tracking:
    accelerator.init_trackers("clm", {"lr": 3e-3})

completed_steps = 0
starting_epoch = 0
resume_step = None
if args.resume_from_checkpoint:
    accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
    accelerator.load_state(args.resume_from_checkpoint)
    training_difference = os.path.splitext(os.path.basename(args.resume_from_checkpoint))[0]
    if "epoch" in training_difference:
        starting_epoch = int(training_difference.replace("epoch_", "")) + 1
        completed_steps = starting_epoch * num_update_steps_per_epoch
    else:
        resume_step = (
            int(training_difference.replace("step_", "")) * args.gradient_accumulation_steps
        )
        starting_epoch = resume_step // len(train_dataloader)
        completed_steps = resume_step // args.gradient_accumulation_steps
        resume_step -= starting_epoch * len(train_dataloader)

for epoch in range(starting_epoch, args.epochs):
    model.train()
    total_loss = 0
    if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
        active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
    else:
        active_dataloader = train_dataloader
    for step, batch in enumerate(active_dataloader):
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            if args.with_tracking:
                total_loss += loss.detach().float()
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed_steps += 1
            if checkpointing_steps and completed_steps % checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.out, f"step_{completed_steps}"))
            if args.stop_after and completed_steps >= args.stop_after:
                break
        if completed_steps >= max_train_steps:
            break
    if args.stop_after and completed_steps >= args.stop_after:
        break
    model.eval()
    losses = []
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(**batch)
        losses.append(accelerator.gather_for_metrics(outputs.loss.repeat(4)))
    eval_loss = torch.mean(torch.cat(losses))
    perplexity = math.exp(eval_loss)
    logger.info(f"epoch {epoch}: perplexity: {perplexity}")
    if args.with_tracking:
        accelerator.log(
            {
                "perplexity": perplexity,
                "train_loss": total_loss.item() / len(train_dataloader),
                "epoch": epoch,
                "step": completed_steps,
            },
            step=completed_steps,
        )

accelerator.wait_for_everyone()
if args.with_tracking:
    accelerator.end_training()
state = {k: v.detach().cpu().clone() for k, v in accelerator.get_state_dict(model).items()}
if accelerator.is_main_process:
    torch.save(state, os.path.join(args.out, "final.pt"))
    with open(os.path.join(args.out, "final.json"), "w") as f:
        json.dump(
            {
                "completed_steps": completed_steps,
                "lr": lr_scheduler.get_last_lr()[0],
                "perplexity": perplexity if not args.stop_after else None,
            },
            f,
        )
