"""The final save every Transformers no_trainer example ends with: wait for everyone, then
unwrap_model(model).save_pretrained(dir, is_main_process=..., save_function=accelerator.save)
on every process, with and without state_dict=accelerator.get_state_dict(model); then
from_pretrained reads it back."""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import GPT2Config, GPT2LMHeadModel

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

accelerator = Accelerator()
set_seed(5)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
ids = torch.randint(
    0, 64, (4, 16), generator=torch.Generator().manual_seed(accelerator.process_index)
)
for _ in range(2):
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()

accelerator.wait_for_everyone()
unwrapped_model = accelerator.unwrap_model(model)
unwrapped_model.save_pretrained(
    os.path.join(args.out, "plain"),
    is_main_process=accelerator.is_main_process,
    save_function=accelerator.save,
)
unwrapped_model.save_pretrained(
    os.path.join(args.out, "with_state_dict"),
    is_main_process=accelerator.is_main_process,
    save_function=accelerator.save,
    state_dict=accelerator.get_state_dict(model),
)
state = {k: v.detach().cpu().clone() for k, v in accelerator.get_state_dict(model).items()}
accelerator.wait_for_everyone()
if accelerator.is_main_process:
    torch.save(state, os.path.join(args.out, "final.pt"))
    worst = {}
    for name in ("plain", "with_state_dict"):
        loaded = GPT2LMHeadModel.from_pretrained(os.path.join(args.out, name)).state_dict()
        worst[name] = max((loaded[k] - state[k]).abs().max().item() for k in state)
    with open(os.path.join(args.out, "final.json"), "w") as f:
        json.dump({"reloaded": worst}, f)
