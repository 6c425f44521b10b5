"""find_executable_batch_size the way Accelerate's by_feature/memory.py uses it: the
training function is retried with half the batch size after an out-of-memory error (here
raised by the script itself above 8 samples per batch, as a GPU would)."""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import find_executable_batch_size, set_seed
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

accelerator = Accelerator()
tried = []


@find_executable_batch_size(starting_batch_size=32)
def inner_training_loop(batch_size):
    tried.append(batch_size)
    accelerator.free_memory()
    set_seed(11)
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(48, 5, generator=g), torch.randn(48, 1, generator=g))
    model = torch.nn.Linear(5, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    loader = DataLoader(data, batch_size=batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(2):
        for inputs, targets in loader:
            if batch_size > 8:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return model


model = inner_training_loop()
state = {k: v.detach().cpu().clone() for k, v in accelerator.get_state_dict(model).items()}
if accelerator.is_main_process:
    torch.save(state, os.path.join(args.out, "final.pt"))
    with open(os.path.join(args.out, "final.json"), "w") as f:
        json.dump({"tried": tried}, f)
