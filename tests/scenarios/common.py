"""Worker side: model, data and the user's training loop (``train``, one for every backend), and
the scenarios every backend shares (a mid-window save, an export). The one-process references
and the assertions on what the ranks recorded are the parent's: ``harness.checks``."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

FEATURES = 8


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Synthetic regression data that also yields each sample's id."""

    def __init__(self, n: int, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    """Input layer, two blocks, head: small, with child blocks for FSDP to shard."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


#: What a scenario module that trains DeepSpeed imports on first use (``PRELOAD`` of its
#: module: mp_worker.py's agent imports it once, before it forks the ranks).
DEEPSPEED_PRELOAD = ("deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer")


def audited_gloo_group() -> None:
    """The process group of a scenario run unless its module defines ``setup_process_group``:
    gloo under gradsync's audit wrapper, which DeepSpeed adopts too (no C++ op builds on the
    CPU, its INFO lines off), so every backend's scenarios can share one group."""
    import os

    import torch.distributed as dist

    from gradsync import audit

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    audit.register()
    dist.init_process_group(audit.AUDIT_BACKEND["cpu"], timeout=timedelta(seconds=180))
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def make_optimizer(params: Any, kind: str, lr: float) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(kind)


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def to_lists(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {k: v.detach().cpu().float().tolist() for k, v in state.items()}


def micro_step(
    accel: Any, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    """One micro-step of the plain loop: forward, backward, step and zero_grad in the block."""
    with accel.accumulate(model):
        accel.backward(F.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()


class Dropped(Exception):
    """Raised inside the accumulate block by a test loop: the window must be dropped."""


@dataclass(frozen=True)
class Loop:
    """What the shared loop (``train``) does; the parameters a scenario passes on to it.

    ``calls``: where the optimizer, scheduler and zero_grad calls sit: "in_block" (after
    backward, inside the accumulate block), "zero_grad_first" (zero_grad first in the
    block, step and scheduler after backward) or "after_block" (clip, step, scheduler and
    zero_grad follow the block; both loop shapes must train alike).
    ``change_steps_at=(window, k)``: set ``gradient_accumulation_steps`` to k once that many
    windows ended.
    ``raise_at=(window, micro)``: the block raises after that micro-step's backward (every
    rank alike); the loop catches it and goes on. ``break_at=(epoch, batch)``: the loop
    breaks out of that epoch before that batch. Either way the open window is dropped, and
    its micro-batches are left out of ``windows``: one process never saw them."""

    samples: int
    micro_batch: int
    epochs: int = 2
    optimizer: str = "sgd"
    lr: float = 0.05
    clip: float | None = None
    clip_value: float | None = None
    calls: Literal["in_block", "zero_grad_first", "after_block"] = "in_block"
    change_steps_at: tuple[int, int] | None = None
    shuffle: bool = True
    raise_at: tuple[int, int] | None = None
    break_at: tuple[int, int] | None = None


#: Ways a window gets dropped (``Loop`` fields): the block raises in the 2nd micro-step of
#: the 2nd window on every rank, or the loop breaks out of the first epoch in the middle of
#: its 2nd window (the next epoch's pass then drops it).
DROPS: dict[str, dict[str, Any]] = {"raise": {"raise_at": (1, 1)}, "break": {"break_at": (0, 6)}}


class Probe:
    """What a scenario watches or changes in the shared loop beyond what ``train`` records:
    each method is called at its point of every micro-step and does nothing here."""

    def before_block(self, accel: Any, model: nn.Module) -> None:
        """Before ``with accel.accumulate(model):``."""

    def forward(self, out: torch.Tensor) -> None:
        """The model's output, inside the block."""

    def loss(self, loss: torch.Tensor, accel: Any, window: int, micro: int) -> torch.Tensor:
        """The loss ``accel.backward`` gets (micro-step ``micro`` of window ``window``)."""
        return loss

    def after_backward(self, accel: Any, model: nn.Module, window: int) -> None:
        """Inside the block, after backward, before clipping and the optimizer calls."""

    def after_block(self, accel: Any, model: nn.Module) -> None:
        """Right after the block (before any call that follows it)."""

    def window_end(self, accel: Any) -> None:
        """After the block of a window's last micro-step."""

    def finish(self, accel: Any, model: nn.Module, scheduler: Any) -> dict[str, Any]:
        """After the last epoch: what the probe adds to the result."""
        return {}


@dataclass
class _Run:
    """One ``train`` call: the prepared objects its loop drives and what it records as it goes
    (the windows, the clip norms and learning rates at their ends, the dropped windows).
    ``raise_at``: the ``Loop``'s, until the block has raised there once."""

    accel: Any
    loop: Loop
    model: nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    probe: Probe
    raise_at: tuple[int, int] | None
    windows: list[list[list[int]]] = field(default_factory=list)
    current: list[list[int]] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    dropped: list[list[list[int]]] = field(default_factory=list)
    sched_calls: int = 0

    def clip(self) -> None:
        """The ``Loop``'s clipping, if any (a norm is recorded at the boundary only)."""
        accel, loop, model = self.accel, self.loop, self.model
        if loop.clip is not None:
            norm = accel.clip_grad_norm_(model.parameters(), loop.clip)
            if accel.sync_gradients:
                self.norms.append(float(norm))
            else:
                assert norm is None, "clip_grad_norm_ off the boundary must return None"
        if loop.clip_value is not None:
            accel.clip_grad_value_(model.parameters(), loop.clip_value)

    def optimizer_calls(self, zero_grad: bool) -> None:
        """Clip, ``step``, the scheduler's ``step`` and (if ``zero_grad``) ``zero_grad``."""
        self.clip()
        self.opt.step()
        self.sched.step()
        self.sched_calls += 1
        if zero_grad:
            self.opt.zero_grad()

    def block(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> None:
        """One micro-step's ``with accel.accumulate(model):`` block; raises ``Dropped`` where
        the ``Loop`` says."""
        accel, model, opt, probe = self.accel, self.model, self.opt, self.probe
        zero_grad_first = self.loop.calls == "zero_grad_first"
        with accel.accumulate(model):
            if zero_grad_first:
                opt.zero_grad()
            out = model(x)
            probe.forward(out)
            loss = probe.loss(F.mse_loss(out, y), accel, len(self.windows), len(self.current))
            accel.backward(loss)
            self.current.append([int(i) for i in idx])
            if self.raise_at == (len(self.windows), len(self.current) - 1):
                self.raise_at = None
                raise Dropped
            probe.after_backward(accel, model, len(self.windows))
            if self.loop.calls != "after_block":
                self.optimizer_calls(zero_grad=not zero_grad_first)

    def drop(self) -> None:
        """The open window is dropped: its micro-batches go to ``dropped``."""
        self.dropped.append(self.current)
        self.current = []

    def end_window(self) -> None:
        """The micro-step just done ended a window: record it."""
        self.sizes.append(len(self.current))
        self.windows.append(self.current)
        self.current = []
        self.lrs.append(float(self.sched.get_last_lr()[0]))
        self.probe.window_end(self.accel)


def train(
    accel: Any,
    loop: Loop,
    *,
    model: nn.Module | None = None,
    after_prepare: Callable[[nn.Module], nn.Module] | None = None,
    probe: Probe | None = None,
) -> dict[str, Any]:
    """The user's loop, written once for every backend; returns what the parent checks.

    ``model``: the model to train (a fresh ``make_model()`` by default).
    ``after_prepare(model)`` replaces the prepared model (e.g. compiles it). ``probe``
    watches the loop for what a scenario checks beyond it (amp's overflows, DeepSpeed's
    boundary flag)."""
    probe = probe if probe is not None else Probe()
    model = model if model is not None else make_model()
    opt = make_optimizer(model.parameters(), loop.optimizer, loop.lr)
    sched = make_scheduler(opt)
    loader = DataLoader(Indexed(loop.samples), batch_size=loop.micro_batch, shuffle=loop.shuffle)
    model, opt, loader, sched = accel.prepare(model, opt, loader, sched)
    if after_prepare is not None:  # e.g. `model = torch.compile(model)` on the prepared model
        model = after_prepare(model)
    run = _Run(accel, loop, model, opt, sched, probe, loop.raise_at)
    audit_start = len(accel.audit.records) if accel.audit is not None else 0

    for epoch in range(loop.epochs):
        for batch, (x, y, idx) in enumerate(loader):
            if loop.change_steps_at is not None and len(run.windows) == loop.change_steps_at[0]:
                accel.gradient_accumulation_steps = loop.change_steps_at[1]
            if loop.break_at == (epoch, batch):
                run.drop()
                break
            probe.before_block(accel, model)
            try:
                run.block(x, y, idx)
            except Dropped:
                opt.step()  # a stray step after the error must apply nothing
                sched.step()
                run.drop()
                continue
            probe.after_block(accel, model)
            if loop.calls == "after_block":
                run.optimizer_calls(zero_grad=True)
            if accel.sync_gradients:  # after the block: this micro-step's decision
                run.end_window()
    records = []
    if accel.audit is not None:
        records = [r.to_dict() for r in accel.audit.records[audit_start:]]
    return {
        "state": to_lists(accel.get_state_dict(model)),
        "windows": run.windows,
        "sizes": run.sizes,
        "norms": run.norms,
        "lrs": run.lrs,
        "optimizer_steps": accel.optimizer_steps,
        "scheduler_calls": run.sched_calls,
        "scheduler_last_epoch": int(sched.last_epoch),
        "audit": records,
        "policy": accel.sync_policy,
        "dropped": run.dropped,
        **probe.finish(accel, model, sched),
    }


def mid_window_save_refused(accel: Any) -> dict[str, Any]:
    """For a backend that cannot save an open window: a save two micro-steps into a window
    of 4 (default and background=True) must raise the same one-line error on every rank and
    leave no folder behind; at the boundary both kinds of save then work and load back."""
    import tempfile
    from pathlib import Path

    import torch.distributed as dist

    box = [tempfile.mkdtemp(prefix="gradsync-scn-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    root = Path(str(box[0]))
    model = make_model()
    opt = make_optimizer(model.parameters(), "sgd", 0.05)
    loader = DataLoader(Indexed(32), batch_size=2)  # 8 batches per rank
    model, opt, loader = accel.prepare(model, opt, loader)
    batches = iter(loader)

    def micro() -> None:
        x, y, _ = next(batches)
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()

    out: dict[str, Any] = {}
    micro(), micro()
    for background in (False, True):
        try:
            accel.save_state(root / f"mid-{background}", background=background)
            out[f"mid_background_{background}"] = "no error"
        except Exception as err:
            out[f"mid_background_{background}"] = f"{type(err).__name__}: {err}"
    dist.barrier()
    out["left_after_refusal"] = sorted(p.name for p in root.iterdir())
    micro(), micro()  # the window closes: a boundary
    out["boundary_saves"] = [
        accel.save_state(root / "b-default"),
        accel.save_state(root / "b-background", background=True),
    ]
    out["committed"] = accel.wait_for_checkpoint()
    out["after"] = sorted(p.name for p in root.iterdir())
    before = {k: v.clone() for k, v in accel.get_state_dict(model).items()}
    micro()
    accel.load_state(root / "b-background")
    out["restored"] = all(torch.equal(v, accel.get_state_dict(model)[k]) for k, v in before.items())
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(root)
    return out


class TiedNet(nn.Module):
    """A head that shares its weight with the input projection (as GPT-2 ties its embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(FEATURES, FEATURES, bias=False)
        self.mid = nn.Linear(FEATURES, FEATURES)
        self.head = nn.Linear(FEATURES, FEATURES, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.embed(x)))).mean(-1, keepdim=True)


def export_model(accel: Any) -> dict[str, Any]:
    """Train one window of a tied model, then ``save_model``: the folder's one safetensors
    file (rank 0's) must hold the gathered full weights (each tied weight once, named in the
    metadata)."""
    import json
    import tempfile
    from pathlib import Path

    import torch.distributed as dist

    box = [tempfile.mkdtemp(prefix="gradsync-scn-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    root = Path(str(box[0]))
    model = TiedNet()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = make_optimizer(model.parameters(), "sgd", 0.05)
    loader = DataLoader(Indexed(16), batch_size=2)
    model, opt, loader = accel.prepare(model, opt, loader)
    for x, y, _ in loader:
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    path = accel.save_model(model, root / "export")
    full = {k: v.detach().cpu().float() for k, v in accel.get_state_dict(model).items()}
    out: dict[str, Any] = {"path_name": Path(path).name}
    if dist.get_rank() == 0:
        from safetensors import safe_open

        out["files"] = sorted(p.name for p in Path(path).iterdir())
        with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
            saved = {k: f.get_tensor(k).float() for k in f.keys()}
            meta = f.metadata()
        out["keys"] = sorted(saved)
        out["tied"] = json.loads(meta["tied"])
        out["equal_to_gathered"] = all(torch.equal(saved[k], full[k]) for k in saved)
        out["trained"] = not torch.equal(saved["mid.weight"], initial["mid.weight"].float())
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(root)
    return out


@contextlib.contextmanager
def captured_log(level: int = logging.INFO) -> Iterator[list[str]]:
    """The messages gradsync logs at ``level`` or above inside the block (the "gradsync"
    logger is let through down to ``level``)."""
    logger = logging.getLogger("gradsync")
    messages: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Capture(level)
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def reference_on(windows: list[list[list[int]]]) -> dict[str, torch.Tensor]:
    """One process on the same global windows (each loss: the mean of micro-batch means)."""
    data = Indexed(44)
    model = make_model()
    opt = make_optimizer(model.parameters(), "sgd", 0.05)
    sched = make_scheduler(opt)
    for window in windows:
        opt.zero_grad()
        loss = sum(F.mse_loss(model(data.x[mb]), data.y[mb]) for mb in window) / len(window)
        loss.backward()
        opt.step()
        sched.step()
    return {f"net.{k}": v for k, v in model.state_dict().items()}
