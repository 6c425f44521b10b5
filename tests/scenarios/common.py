"""Model, data, the user's training loop, and the single-process reference it must match."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

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


class _Dropped(Exception):
    """Raised inside the accumulate block by a test loop: the window must be dropped."""


def train(
    accel: Any,
    *,
    samples: int,
    micro_batch: int,
    epochs: int = 2,
    optimizer: str = "sgd",
    lr: float = 0.05,
    clip: float | None = None,
    zero_grad_first: bool = False,
    change_steps_at: tuple[int, int] | None = None,
    shuffle: bool = True,
    model: nn.Module | None = None,
    after_block: bool = False,
    raise_at: tuple[int, int] | None = None,
    break_at: tuple[int, int] | None = None,
    after_prepare: Any = None,
) -> dict[str, Any]:
    """The user's loop, written once for every backend; returns what the parent checks.

    ``after_block``: the optimizer, scheduler and zero_grad calls follow the accumulate
    block instead of sitting inside it (both loop shapes must train alike).
    ``raise_at=(window, micro)``: the block raises after that micro-step's backward (every
    rank alike); the loop catches it and goes on. ``break_at=(epoch, batch)``: the loop
    breaks out of that epoch before that batch. Either way the open window is dropped, and
    its micro-batches are left out of ``windows``: one process never saw them.
    ``after_prepare(model)`` replaces the prepared model (e.g. compiles it)."""
    raise_at = tuple(raise_at) if raise_at is not None else None  # JSON gives lists
    break_at = tuple(break_at) if break_at is not None else None
    model = model if model is not None else make_model()
    opt = make_optimizer(model.parameters(), optimizer, lr)
    sched = make_scheduler(opt)
    loader = DataLoader(Indexed(samples), batch_size=micro_batch, shuffle=shuffle)
    model, opt, loader, sched = accel.prepare(model, opt, loader, sched)
    if after_prepare is not None:  # e.g. `model = torch.compile(model)` on the prepared model
        model = after_prepare(model)
    windows: list[list[list[int]]] = []
    current: list[list[int]] = []
    norms: list[float] = []
    lrs: list[float] = []
    sizes: list[int] = []
    sched_calls = 0
    audit_start = len(accel.audit.records) if accel.audit is not None else 0
    dropped: list[list[list[int]]] = []
    for epoch in range(epochs):
        for batch, (x, y, idx) in enumerate(loader):
            if change_steps_at is not None and len(windows) == change_steps_at[0]:
                accel.gradient_accumulation_steps = change_steps_at[1]
            if break_at == (epoch, batch):
                dropped.append(current)
                current = []
                break
            try:
                with accel.accumulate(model):
                    if zero_grad_first:
                        opt.zero_grad()
                    loss = F.mse_loss(model(x), y)
                    accel.backward(loss)
                    current.append([int(i) for i in idx])
                    if raise_at == (len(windows), len(current) - 1):
                        raise_at = None
                        raise _Dropped
                    if clip is not None:
                        norm = accel.clip_grad_norm_(model.parameters(), clip)
                        if accel.sync_gradients:
                            norms.append(float(norm))
                        else:
                            assert norm is None, "clip_grad_norm_ off the boundary must return None"
                    if not after_block:
                        opt.step()
                        sched.step()
                        sched_calls += 1
                        if not zero_grad_first:
                            opt.zero_grad()
            except _Dropped:
                opt.step()  # a stray step after the error must apply nothing
                sched.step()
                dropped.append(current)
                current = []
                continue
            if after_block:
                opt.step()
                sched.step()
                sched_calls += 1
                opt.zero_grad()
            if accel.sync_gradients:  # after the block: this micro-step's decision
                sizes.append(len(current))
                windows.append(current)
                current = []
                lrs.append(float(sched.get_last_lr()[0]))
    records = []
    if accel.audit is not None:
        records = [r.to_dict() for r in accel.audit.records[audit_start:]]
    return {
        "state": to_lists(accel.get_state_dict(model)),
        "windows": windows,
        "sizes": sizes,
        "norms": norms,
        "lrs": lrs,
        "optimizer_steps": accel.optimizer_steps,
        "scheduler_calls": sched_calls,
        "scheduler_last_epoch": int(sched.last_epoch),
        "audit": records,
        "policy": accel.sync_policy,
        "dropped": dropped,
    }


def reference(
    rank_results: list[dict[str, Any]],
    *,
    samples: int,
    optimizer: str = "sgd",
    lr: float = 0.05,
    clip: float | None = None,
    model: nn.Module | None = None,
) -> dict[str, Any]:
    """One process training on the same global windows: each window's loss is the mean, over
    ranks and micro-batches, of the micro-batch mean losses (the global sample mean when all
    micro-batches have equal size)."""
    data = Indexed(samples)
    model = model if model is not None else make_model()
    opt = make_optimizer(model.parameters(), optimizer, lr)
    sched = make_scheduler(opt)
    n_windows = len(rank_results[0]["windows"])
    for r in rank_results:
        assert len(r["windows"]) == n_windows, "ranks took different numbers of optimizer steps"
    norms: list[float] = []
    for w in range(n_windows):
        micro = [mb for r in rank_results for mb in r["windows"][w]]
        opt.zero_grad()
        loss = sum(F.mse_loss(model(data.x[mb]), data.y[mb]) for mb in micro) / len(micro)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        sched.step()
    return {"state": to_lists(model.state_dict()), "norms": norms}


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(
        float((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max()) for k in a
    )


def assert_matches_one_process(rank_results: list[dict[str, Any]], **reference_kwargs: Any) -> dict[str, Any]:
    """Every rank's final parameters equal one process on the same windows (fp32, 1e-5),
    and the ranks agree exactly; returns the reference for further checks."""
    ref = reference(rank_results, **reference_kwargs)
    for r in rank_results:
        assert max_diff(r["state"], ref["state"]) < 1e-5
    assert max_diff(rank_results[0]["state"], rank_results[1]["state"]) == 0.0
    return ref


#: Ways a window gets dropped (scenario keywords of ``train``): the block raises in the 2nd
#: micro-step of the 2nd window on every rank, or the loop breaks out of the first epoch
#: in the middle of its 2nd window (the next epoch's pass then drops it).
DROPS = {"raise": {"raise_at": [1, 1]}, "break": {"break_at": [0, 6]}}


def assert_dropped_window_leaks_nothing(rank_results: list[dict[str, Any]], **reference_kwargs: Any) -> None:
    """A dropped window was really dropped mid-way (it held micro-batches), nothing of it
    reached the parameters: they equal one process that never saw its micro-batches."""
    for r in rank_results:
        assert len(r["dropped"]) == 1 and len(r["dropped"][0]) >= 1, r["dropped"]
        assert r["optimizer_steps"] == len(r["windows"]) == r["scheduler_last_epoch"]
    assert_matches_one_process(rank_results, **reference_kwargs)


def assert_clipping_matches_one_process(rank_results: list[dict[str, Any]], samples: int) -> None:
    """The norms clip_grad_norm_ returned at each boundary, and the final parameters, equal one
    process clipping the same windows (Adam, lr 0.01, max_norm 0.5), and really clipped."""
    ref = reference(rank_results, samples=samples, optimizer="adam", lr=0.01, clip=0.5)
    assert rank_results[0]["norms"] == rank_results[1]["norms"]
    assert any(n > 0.5 for n in ref["norms"]), "the test must actually clip"
    for r in rank_results:
        assert len(r["norms"]) == len(ref["norms"]) == r["optimizer_steps"]
        assert max(abs(a - b) for a, b in zip(r["norms"], ref["norms"])) < 1e-5
        assert max_diff(r["state"], ref["state"]) < 1e-5


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
    out["boundary_saves"] = [accel.save_state(root / "b-default"),
                             accel.save_state(root / "b-background", background=True)]
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
    """Train one window of a tied model, then ``save_model``: rank 0's safetensors file must
    hold the gathered full weights (each tied weight once, named in the metadata)."""
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

        with safe_open(path, framework="pt") as f:
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


def assert_mid_window_save_refused(rank_results: list[dict[str, Any]], backend: str) -> None:
    """What ``mid_window_save_refused`` recorded: both kinds of save (default,
    background=True) two micro-steps into a window are one line that says to save at a
    boundary, on both ranks, with no folder left; at the boundary both save, the background
    one is committed, and it loads back."""
    for rank in rank_results:
        for background in (False, True):
            message = rank[f"mid_background_{background}"]
            assert message.startswith("UsageError: save_state() inside an accumulation window is not "
                                      f"supported with backend='{backend}'"), message
            assert "call it at a boundary" in message and "\n" not in message
        assert rank["left_after_refusal"] == []
        assert [p.rsplit("/", 1)[-1] for p in rank["boundary_saves"]] == ["b-default", "b-background"]
        assert rank["committed"].endswith("b-background")
        assert rank["after"] == ["b-background", "b-default"]
        assert rank["restored"] is True


def assert_export_is_the_gathered_model(rank_results: list[dict[str, Any]]) -> None:
    """What ``export_model`` recorded: rank 0's safetensors file equals the gathered state
    dict, with the tied weight written once and named in the metadata."""
    rank0 = rank_results[0]
    assert rank0["keys"] == ["embed.weight", "mid.bias", "mid.weight"], rank0
    assert rank0["tied"] == {"head.weight": "embed.weight"}
    assert rank0["equal_to_gathered"] is True and rank0["trained"] is True
    assert all(r["path_name"] == "model.safetensors" for r in rank_results)


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
