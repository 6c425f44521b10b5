"""A training job that survives preemption, as docs/clusters.md shows it (run by the SLURM
tests under ``gradsync launch``):

    python preempt_train.py OUT [--requeue] [--slow SECONDS]

Resumes from ``gradsync.latest_checkpoint(OUT/ckpt)`` when there is one; trains 2 epochs
(k=2); with ``save_on_signal=OUT/ckpt`` a SIGUSR1 (``scancel --signal=USR1``) saves at the
next window and exits 0, and with ``--requeue`` the job is requeued. Writes
``OUT/started-<run>`` once training is under way (the test signals then), and at the end
rank 0 writes the final parameters to ``OUT/final.pt`` and the resumes it saw to
``OUT/runs.txt``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from gradsync import Accelerator


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("out")
    p.add_argument("--requeue", action="store_true")
    p.add_argument("--slow", type=float, default=0.0, help="seconds to sleep per micro-step")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "ckpt"
    accel = Accelerator(
        gradient_accumulation_steps=2, seed=0, save_on_signal=ckpt, requeue=args.requeue
    )
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, opt, loader = accel.prepare(model, opt, DataLoader(data, batch_size=2, shuffle=True))
    resumed = gradsync.latest_checkpoint(ckpt)
    if resumed is not None:
        accel.load_state(resumed)
    run = os.environ.get("SLURM_RESTART_COUNT", "0")
    micro = 0
    for _epoch in range(loader.epoch, 2):
        for x, y in loader:
            with accel.accumulate(model):
                accel.backward(F.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
            micro += 1
            if micro == 3 and accel.is_main_process:
                (out / f"started-{run}").write_text(str(accel.optimizer_steps))
            time.sleep(args.slow)
    if accel.is_main_process:
        state = {k: v.detach().clone() for k, v in accel.unwrap_model(model).state_dict().items()}
        torch.save(state, out / "final.pt")
        with open(out / "runs.txt", "a") as f:
            f.write(f"run {run} resumed from {resumed}\n")
    accel.end()


if __name__ == "__main__":
    main()
