"""A training script written as an Accelerate user writes it; the only line that differs between
Accelerate and gradsync is the import, chosen by ``PARITY_LIBRARY`` (accelerate | gradsync).

    accelerate_style.py OUT [--merged]

Two models (an encoder and a head) trained by one AdamW over both, a constant-LR scheduler,
accumulation 4, TensorBoard logging, an evaluation pass with ``gather_for_metrics`` (tensors
and strings) and ``reduce``. ``--merged`` trains one ``nn.Sequential(encoder, head)`` instead
(DeepSpeed holds one model per engine); the arithmetic is the same.

The main process writes ``OUT/result.pt``: the final parameters (``get_state_dict``), the
gathered evaluation outputs, the reduced values, the logged losses and the scheduler's count.
"""

import os

if os.environ.get("PARITY_LIBRARY", "accelerate") == "gradsync":
    from gradsync import Accelerator, set_seed
else:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

MICRO_BATCH = 4
ACCUMULATION = 4
TRAIN_SAMPLES = 96  # 3 full windows of 4 micro-batches x 4 samples x 2 processes
EVAL_SAMPLES = 11  # not a multiple of 2 processes x 2: the last batch is padded, then dropped
EPOCHS = 2


class Points(Dataset):
    """Points in 8 dimensions, labelled by which of 3 fixed directions they lie closest to."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x @ torch.randn(8, 3, generator=g)).argmax(-1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "idx": i}


def main() -> None:
    out = Path(sys.argv[1])
    merged = "--merged" in sys.argv[2:]
    eval_batch = (
        int(sys.argv[sys.argv.index("--eval-batch-size") + 1])
        if "--eval-batch-size" in sys.argv
        else 2
    )

    set_seed(0)
    accelerator = Accelerator(
        gradient_accumulation_steps=ACCUMULATION,
        log_with="tensorboard",
        project_dir=str(out / "logs"),
    )
    accelerator.init_trackers("parity")

    encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
    head = nn.Linear(16, 3)
    params = list(encoder.parameters()) + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    train_loader = DataLoader(Points(TRAIN_SAMPLES, 1), batch_size=MICRO_BATCH, shuffle=False)
    eval_loader = DataLoader(Points(EVAL_SAMPLES, 2), batch_size=eval_batch, shuffle=False)

    if merged:
        model = nn.Sequential(encoder, head)
        model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
            model, optimizer, train_loader, eval_loader, scheduler
        )
        models = {"model": model}
    else:
        encoder, head, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
            encoder, head, optimizer, train_loader, eval_loader, scheduler
        )
        models = {"encoder": encoder, "head": head}

    def forward(x: torch.Tensor) -> torch.Tensor:
        return model(x) if merged else head(encoder(x))

    logged = []
    step = 0
    for _ in range(EPOCHS):
        for m in models.values():
            m.train()
        for batch in train_loader:
            with accelerator.accumulate(*models.values()):
                loss = F.cross_entropy(forward(batch["x"]), batch["y"])
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                # the last micro-batch's loss, averaged over the processes
                mean_loss = accelerator.reduce(loss.detach(), reduction="mean")
                accelerator.log({"train_loss": mean_loss.item()}, step=step)
                logged.append(mean_loss.item())

    for m in models.values():
        m.eval()
    logits, preds, names = [], [], []
    sums = torch.zeros(2)  # this process's summed loss and number of samples
    for batch in eval_loader:
        with torch.no_grad():
            out_logits = forward(batch["x"])
        batch_preds = out_logits.argmax(-1)
        sums += torch.stack(
            [
                F.cross_entropy(out_logits, batch["y"], reduction="sum"),
                torch.tensor(float(len(batch["y"]))),
            ]
        )
        logits.append(accelerator.gather_for_metrics(out_logits))
        preds.append(accelerator.gather_for_metrics(batch_preds))
        labels = [f"sample{int(i)}:class{int(p)}" for i, p in zip(batch["idx"], batch_preds)]
        names.extend(accelerator.gather_for_metrics(labels, use_gather_object=True))
    reduced = accelerator.reduce(sums, reduction="mean")
    rank_mean = accelerator.reduce(
        torch.tensor([float(accelerator.process_index)]), reduction="mean"
    )

    state = {name: accelerator.get_state_dict(m) for name, m in models.items()}

    @accelerator.on_main_process
    def write_results() -> None:
        torch.save(
            {
                "params": {
                    f"{name}.{key}": value.detach().cpu().clone()
                    for name, sd in state.items()
                    for key, value in sd.items()
                },
                "logits": torch.cat(logits).cpu(),
                "preds": torch.cat(preds).cpu(),
                "names": names,
                "reduced": reduced.cpu(),
                "rank_mean": rank_mean.cpu(),
                "logged": logged,
                "optimizer_steps": step,
                "scheduler_last_epoch": scheduler.state_dict()["last_epoch"],
                "num_processes": accelerator.num_processes,
                "wrapped": {name: type(m).__name__ for name, m in models.items()},
            },
            out / "result.pt",
        )

    write_results()
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
