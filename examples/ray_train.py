"""gradsync inside Ray Train: the training loop of examples/train.py under ``TorchTrainer``.

    pip install 'ray[train]'
    python examples/ray_train.py                 # 2 CPU workers, 4 micro-batches per step

Ray starts the workers and their process group (gloo on the CPU) and sets each worker's
rank; ``Accelerator()`` joins that group, and the loop is the one gradsync runs under
``gradsync launch``. Each worker reports what it saw; the driver prints it and checks that
every rank ends with the same parameters.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_data(samples: int, features: int, seed: int = 0) -> TensorDataset:
    """A noisy linear target."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    w = torch.randn(features, 1, generator=g) / features**0.5
    return TensorDataset(x, x @ w + 0.05 * torch.randn(samples, 1, generator=g))


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: gradsync's loop, then a report of what this rank saw."""
    from ray import train

    import gradsync
    from gradsync import Accelerator

    ray_group = torch.distributed.is_initialized()  # Ray formed the process group
    accel = Accelerator(gradient_accumulation_steps=config["k"], seed=0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(make_data(config["samples"], 16), batch_size=8, shuffle=True)
    model, optimizer, loader = accel.prepare(model, optimizer, loader)
    micro_steps = 0
    for _epoch in range(loader.epoch, config["epochs"]):
        for x, y in loader:
            with accel.accumulate(model):
                accel.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            micro_steps += 1
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    metrics = {
        "rank": accel.rank,
        "world": accel.world_size,
        "ray_group": ray_group,
        "backend": accel.backend,
        "sync_policy": accel.sync_policy,
        "micro_steps": micro_steps,
        "optimizer_steps": accel.optimizer_steps,
        # every rank's parameters, gathered to every rank: equal after each step
        "parameters": [t.tolist() for t in gradsync.gather_object(flat)],
    }
    # Ray Train keeps the metrics reported with a checkpoint: rank 0 gives one.
    with tempfile.TemporaryDirectory() as folder:
        if accel.is_main_process:
            torch.save(accel.unwrap_model(model).state_dict(), f"{folder}/model.pt")
        checkpoint = train.Checkpoint.from_directory(folder) if accel.is_main_process else None
        train.report(metrics, checkpoint=checkpoint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--worker-output", action="store_true", help="show the workers' output")
    args = parser.parse_args()

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=args.worker_output)
    with tempfile.TemporaryDirectory(prefix="gradsync-ray-") as storage:
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"k": args.k, "samples": args.samples, "epochs": args.epochs},
            scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
            run_config=RunConfig(storage_path=storage, name="gradsync"),
        )
        result = trainer.fit()
    if result.error is not None:
        raise SystemExit(f"the Ray Train run failed: {result.error}")
    metrics = result.metrics
    parameters = [torch.tensor(p) for p in metrics.pop("parameters")]
    same = all(torch.equal(parameters[0], p) for p in parameters[1:])
    print(
        f"rank {metrics['rank']} of {metrics['world']} (process group from Ray: "
        f"{metrics['ray_group']}): backend={metrics['backend']} "
        f"sync_policy={metrics['sync_policy']} micro-steps {metrics['micro_steps']}, "
        f"optimizer steps {metrics['optimizer_steps']}; parameters identical on "
        f"{len(parameters)} ranks: {same}"
    )
    ray.shutdown()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
