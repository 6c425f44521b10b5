"""A training job that checkpoints, dies and resumes: the checkpoint tests run it.

    resume_train.py OUT --backend B [--mode run|reference] [--dropout P] [--workers N]
                    [--save-every M] [--boundary-only] [--kill RANK:MICRO] [--stop MICRO]
                    [--epochs E] [--reshard-at MICRO] [--on-oom split --oom-in-sync R:M]

k=4, SGD with momentum, an LR schedule, dropout, shuffled data whose shards end in partial
windows. ``--mode reference`` (or first, with ``--with-reference``) trains without any checkpoint and writes ``reference.pt``.
``--mode run`` resumes from ``OUT/ckpt``'s latest checkpoint if there is one (three lines,
as in the docs), saves every ``--save-every`` micro-steps (only at boundaries with
``--boundary-only``; every other save with ``background=True``, committed while training
goes on, and waited for just before a planned kill so that the checkpoint to resume from
is known), and on the first attempt (TORCHELASTIC_RESTART_COUNT=0) rank RANK
SIGKILLs itself after micro-step MICRO (``--kill``; a list: one kill per attempt;
``save:MICRO`` makes rank 0 SIGKILL itself in the middle of the save at MICRO, after the
backend has written the models and optimizers), or
every rank exits after saving at MICRO (``--stop``), or sends itself SIGTERM at MICRO
(``--sigterm-at``, with ``save_on_sigterm``). The finished run writes ``final.pt`` (rank 0) and ``run_rank{r}.json``.
``--reshard-at`` saves one boundary checkpoint in ``OUT/reshard`` and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import gradsync
from gradsync import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scenarios.common import Indexed, Net, make_optimizer, make_scheduler

SAMPLES = 44  # 22 per rank on 2 ranks: 11 batches of 2 -> windows of 4, 4, 3


class DropNet(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net()
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.drop(x))


class Noisy(Dataset[Any]):
    """Indexed data plus noise drawn where the batch is loaded (a worker's own RNG)."""

    def __init__(self) -> None:
        self.data = Indexed(SAMPLES)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        x, y, idx = self.data[i]
        return x + 0.01 * torch.randn(x.shape), y, idx


class Recorder:
    """What the run saw (micro-steps, windows); registered, so it survives restarts."""

    def __init__(self, die_in_save_at: int = -1) -> None:
        self.die_in_save_at = die_in_save_at  # SIGKILL this process when saved at that micro-step
        self.micro = 0
        self.windows: list[list[list[int]]] = []
        self.current: list[list[int]] = []

    def state_dict(self) -> dict[str, Any]:
        if self.micro == self.die_in_save_at:  # save_state calls this on rank 0 mid-save
            os.kill(os.getpid(), signal.SIGKILL)
        return {"micro": self.micro, "windows": self.windows, "current": self.current}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro, self.windows, self.current = state["micro"], state["windows"], state["current"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--backend", default="ddp")
    ap.add_argument("--mode", default="run")
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--boundary-only", action="store_true")
    ap.add_argument("--kill", default=None, help="RANK:MICRO[,save:MICRO,...], one per attempt")
    ap.add_argument("--policy", default="auto")
    ap.add_argument("--sigterm-at", type=int, default=None)
    ap.add_argument("--sigterm-rank", type=int, default=None, help="only this rank gets SIGTERM")
    ap.add_argument("--resume-from", default=None)
    ap.add_argument("--stop", type=int, default=None)
    ap.add_argument("--reshard-at", type=int, default=None)
    ap.add_argument(
        "--kill-node",
        default=None,
        help="RANK:MICRO: on the first attempt that rank kills its agent and itself (a lost node)",
    )
    ap.add_argument(
        "--log-windows",
        action="store_true",
        help="append each applied window to OUT/windows_rank{r}.jsonl (attempt, world, step)",
    )
    ap.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="keep this global batch (micro-batch 2; k follows the world) instead of k = 4",
    )
    ap.add_argument("--on-oom", default="raise")
    ap.add_argument(
        "--oom-in-sync",
        default=None,
        help="RANK:MICRO: on the first attempt that rank runs out of memory (a raised "
        "torch.OutOfMemoryError) inside the synchronising backward of micro-step MICRO",
    )
    ap.add_argument(
        "--with-reference",
        action="store_true",
        help="first train the reference in the same processes (first attempt only)",
    )
    args = ap.parse_args()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if args.with_reference and first_attempt:
        train(args, "reference")
    train(args, args.mode)


def make_accelerator(args: argparse.Namespace, mode: str, out: Path) -> Accelerator:
    """The Accelerator of ``mode``: k=4 (or ``--global-batch-size``'s sizes), ZeRO-2 for
    DeepSpeed, and ``save_on_sigterm`` into ``OUT/ckpt`` when a run is to get SIGTERM."""
    options: dict[str, Any] = {}
    if args.backend == "deepspeed":
        options["deepspeed_config"] = {"zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
    if (args.sigterm_at is not None or args.sigterm_rank is not None) and mode == "run":
        options["save_on_sigterm"] = str(out / "ckpt")
    sizes: dict[str, int] = {"gradient_accumulation_steps": 4}
    if args.global_batch_size == 0:  # the batch sizes come from the launcher
        sizes = {}
    elif args.global_batch_size is not None:
        sizes = {"global_batch_size": args.global_batch_size, "micro_batch_size": 2}
    return Accelerator(
        backend=args.backend,
        **sizes,
        seed=0,
        sync_policy=args.policy,
        on_oom=args.on_oom if mode == "run" else "raise",
        **options,
    )


def planned_kill(kill: str | None, attempt: int, rec: Recorder) -> tuple[int, int]:
    """This attempt's entry of ``--kill``: (rank, micro-step) of a SIGKILL after a micro-step,
    or (-1, -1) with ``rec`` set to die in the save (``save:MICRO``) or when there is none."""
    kills = [k.split(":") for k in kill.split(",")] if kill else []
    kill_rank, kill_at = (-1, -1)
    if attempt < len(kills):
        who, at = kills[attempt]
        if who == "save":
            rec.die_in_save_at = int(at)
        else:
            kill_rank, kill_at = int(who), int(at)
    return kill_rank, kill_at


def log_window(out: Path, accel: Accelerator, attempt: int, window: list[list[int]]) -> None:
    """Append the window just applied to ``OUT/windows_rank{r}.jsonl`` (``--log-windows``)."""
    line = {
        "attempt": attempt,
        "world": accel.world_size,
        "step": accel.optimizer_steps,
        "window": window,
    }
    with open(out / f"windows_rank{accel.rank}.jsonl", "a") as log:
        log.write(json.dumps(line) + "\n")


def reshard_done(args: argparse.Namespace, accel: Accelerator, rec: Recorder, out: Path) -> bool:
    """At ``--reshard-at``: save the boundary checkpoint in ``OUT/reshard`` and end (True)."""
    if args.reshard_at is None or rec.micro != args.reshard_at:
        return False
    assert accel.sync_gradients, "--reshard-at must be a boundary"
    accel.save_state(out / "reshard")
    (out / f"reshard_rank{accel.rank}.json").write_text(json.dumps(rec.state_dict()))
    accel.end()
    return True


def save_if_due(args: argparse.Namespace, accel: Accelerator, rec: Recorder, root: Path) -> None:
    """Every ``--save-every`` micro-steps (boundaries only with ``--boundary-only``) a save
    into ``root``, every other one in the background."""
    at_boundary = accel.sync_gradients
    if rec.micro % args.save_every == 0 and (at_boundary or not args.boundary_only):
        background = (rec.micro // args.save_every) % 2 == 1
        accel.save_state(root / f"micro-{rec.micro:04d}", keep_last=2, background=background)


def oom_due(args: argparse.Namespace, accel: Accelerator, micro: int, first_attempt: bool) -> bool:
    """``--oom-in-sync``: this rank's backward of micro-step ``micro`` runs out of memory."""
    if args.oom_in_sync is None or not first_attempt:
        return False
    rank, at = (int(v) for v in args.oom_in_sync.split(":"))
    return accel.rank == rank and micro == at


def out_of_memory(grad: torch.Tensor) -> torch.Tensor:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def kill_if_planned(
    args: argparse.Namespace,
    accel: Accelerator,
    rec: Recorder,
    first_attempt: bool,
    kill_rank: int,
    kill_at: int,
) -> None:
    """``--kill-node`` (first attempt) and ``--kill``'s SIGKILL, each once every rank waited
    for the checkpoint in flight; ``--sigterm-at``'s SIGTERM (first attempt)."""
    if args.kill_node and first_attempt:
        node_rank, node_at = (int(v) for v in args.kill_node.split(":"))
        if rec.micro == node_at:
            accel.wait_for_checkpoint()  # on every rank (collective)
            if accel.rank == node_rank:  # the agent first: nothing restarts this node
                os.kill(os.getppid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
    if rec.micro == kill_at:
        accel.wait_for_checkpoint()  # on every rank (collective)
        if accel.rank == kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
    if (
        first_attempt
        and args.sigterm_at is not None
        and rec.micro == args.sigterm_at
        and args.sigterm_rank in (None, accel.rank)
    ):
        os.kill(os.getpid(), signal.SIGTERM)  # saved and stopped at the next window


def train(args: argparse.Namespace, mode: str) -> None:
    out = Path(args.out)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    accel = make_accelerator(args, mode, out)
    model = DropNet(args.dropout)
    opt = make_optimizer(model.parameters(), "sgd", 0.05)
    sched = make_scheduler(opt)
    data = Noisy() if args.workers else Indexed(SAMPLES)
    loader = DataLoader(data, batch_size=2, shuffle=True, num_workers=args.workers)
    model, opt, loader, sched = accel.prepare(model, opt, loader, sched)
    rec = Recorder()
    accel.register_for_checkpointing(rec)
    root = out / "ckpt"

    ckpt = None
    if mode == "run":
        # Resume from the newest complete checkpoint, if any (the three lines of the docs).
        ckpt = args.resume_from or gradsync.latest_checkpoint(root)
        if ckpt is not None:
            accel.load_state(ckpt)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_rank, kill_at = planned_kill(args.kill, attempt, rec)
    for _epoch in range(loader.epoch, args.epochs):
        for x, y, idx in loader:
            k = accel.gradient_accumulation_steps
            with accel.accumulate(model):
                loss = F.mse_loss(model(x), y)
                if oom_due(args, accel, rec.micro + 1, first_attempt):
                    loss.register_hook(out_of_memory)
                accel.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            rec.micro += 1
            if accel.gradient_accumulation_steps != k:  # on_oom="split": the window again
                rec.current = []
                continue
            rec.current.append([int(i) for i in idx])
            if accel.sync_gradients:
                rec.windows.append(rec.current)
                if args.log_windows and mode == "run":
                    log_window(out, accel, attempt, rec.current)
                rec.current = []
            if mode != "run":
                continue
            if reshard_done(args, accel, rec, out):
                return
            save_if_due(args, accel, rec, root)
            kill_if_planned(args, accel, rec, first_attempt, kill_rank, kill_at)
            if first_attempt and args.stop is not None and rec.micro == args.stop:
                accel.end()
                return
    state = {k: v.clone() for k, v in accel.get_state_dict(model).items()}
    name = "reference" if mode == "reference" else "final"
    if accel.rank == 0:
        torch.save(state, out / f"{name}.pt")
    result = {
        "windows": rec.windows,
        "optimizer_steps": accel.optimizer_steps,
        "lr": float(sched.get_last_lr()[0]),
        "micro": rec.micro,
        "restarts": attempt,
        "resumed_from": ckpt,
        "policy": accel.sync_policy,
        "world_size": accel.world_size,
        "share_store": os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE"),
    }
    (out / f"{name}_rank{accel.rank}.json").write_text(json.dumps(result))
    if mode == args.mode:
        accel.end()


if __name__ == "__main__":
    main()
