"""What the sync-overhead benchmark runs: the model, the data, and one cell definition per backend.

A *cell definition* says, for one backend, how to build each mode's runner:

* ``naive``      gradsync with ``sync_policy="every_step"`` (reduce on every micro-step);
* ``default``    gradsync as ``Accelerator()`` gives it: no policy, no budget, no backend option;
* ``gradsync``   gradsync with its best policy for the backend (set explicitly);
* ``manual``     the same loop written by hand against the backend's own API;
* ``accelerate`` Hugging Face Accelerate's ``accumulate`` (where it applies).

A runner has one method, ``micro(x, y, sync)``: one micro-step of the user's loop
(forward, backward and, at the boundary, the optimizer step). ``sync`` is only read by
the hand-written loops; gradsync and Accelerate decide the boundary themselves.

Adding a backend means adding one ``BackendCells`` entry to ``CELLS`` below.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

LR = 1e-4
MOMENTUM = 0.9


# -- model and data -------------------------------------------------------------
class MLP(nn.Module):
    """Input layer, ``depth`` square blocks in a ModuleList (FSDP's units), a small head."""

    def __init__(self, width: int, depth: int, features: int, outputs: int) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]
        )
        self.head = nn.Linear(width, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@dataclass(frozen=True)
class Sizes:
    width: int
    depth: int
    features: int
    outputs: int
    micro_batch: int

    def model(self, seed: int = 0) -> MLP:
        torch.manual_seed(seed)
        return MLP(self.width, self.depth, self.features, self.outputs)

    def batches(
        self, rank: int, count: int, device: torch.device
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(1000 + rank)
        out = []
        for _ in range(count):
            x = torch.randn(self.micro_batch, self.features, generator=g)
            y = torch.randn(self.micro_batch, self.outputs, generator=g)
            out.append((x.to(device), y.to(device)))
        return out


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


class Runner(Protocol):
    policy: str
    model: Any  # the wrapped model (DDP, FSDP2 module, DeepSpeed engine)

    def micro(self, x: torch.Tensor, y: torch.Tensor, sync: bool) -> None: ...


# -- modes shared by every backend ------------------------------------------------
class GradsyncRunner:
    """The user's loop as the README writes it, on gradsync."""

    def __init__(
        self, backend: str, sizes: Sizes, k: int, sync_policy: str | None, options: dict[str, Any]
    ) -> None:
        from gradsync import Accelerator

        self.accel = Accelerator(
            backend=backend,
            gradient_accumulation_steps=k,
            micro_batch_size=sizes.micro_batch,
            sync_policy=sync_policy,
            **options,
        )
        model = sizes.model()
        self.model, self.opt = self.accel.prepare(model, sgd(model.parameters()))
        kept = "parameters kept gathered" in self.accel.sync_policy_reason
        self.policy = self.accel.sync_policy + (" + params" if kept else "")

    def micro(self, x: torch.Tensor, y: torch.Tensor, sync: bool) -> None:
        with self.accel.accumulate(self.model):
            loss = F.mse_loss(self.model(x), y)
            self.accel.backward(loss)
            self.opt.step()
            self.opt.zero_grad()


class AccelerateRunner:
    """The same loop on Hugging Face Accelerate (its DDP path)."""

    def __init__(self, sizes: Sizes, k: int, device: torch.device) -> None:
        from accelerate import Accelerator

        self.acc = Accelerator(cpu=device.type == "cpu", gradient_accumulation_steps=k)
        model = sizes.model()
        self.model, self.opt = self.acc.prepare(model, sgd(model.parameters()))
        self.policy = "accumulate"

    def micro(self, x: torch.Tensor, y: torch.Tensor, sync: bool) -> None:
        with self.acc.accumulate(self.model):
            loss = F.mse_loss(self.model(x), y)
            self.acc.backward(loss)
            self.opt.step()
            self.opt.zero_grad()


# -- hand-written loops, one per backend ----------------------------------------------
class DDPManual:
    def __init__(self, sizes: Sizes, k: int, device: torch.device) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        self.model = DDP(sizes.model().to(device), device_ids=ids)
        self.opt = sgd(self.model.parameters())
        self.k = k
        self.policy = "no_sync"

    def micro(self, x: torch.Tensor, y: torch.Tensor, sync: bool) -> None:
        with contextlib.nullcontext() if sync else self.model.no_sync():
            loss = F.mse_loss(self.model(x), y) / self.k
            loss.backward()
        if sync:
            self.opt.step()
            self.opt.zero_grad()


class FSDPManual:
    def __init__(self, sizes: Sizes, k: int, device: torch.device) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        model = sizes.model().to(device)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # The parameters stay gathered from a window's first forward to its boundary's
        # backward (what gradsync's fsdp_keep_params_in_window=True does).
        model.set_reshard_after_forward(False)
        self.model: Any = model
        self.opt = sgd(model.parameters())
        self.k = k
        self.policy = "set_requires_gradient_sync + kept params"

    def micro(self, x: torch.Tensor, y: torch.Tensor, sync: bool) -> None:
        self.model.set_requires_gradient_sync(sync)
        self.model.set_reshard_after_backward(sync)
        loss = F.mse_loss(self.model(x), y) / self.k
        loss.backward()
        if sync:
            self.opt.step()
            self.opt.zero_grad()


class FairscaleManual:
    """fairscale's ShardedDataParallel + OSS by hand: no_sync() off the boundary, gradients
    zeroed in place (its reduce buckets are views of them)."""

    def __init__(self, sizes: Sizes, k: int, device: torch.device) -> None:
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim import OSS

        model = sizes.model().to(device)
        self.opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=LR, momentum=MOMENTUM)
        self.model = ShardedDataParallel(model, self.opt)
        self.k = k
        self.policy = "no_sync"

    def micro(self, x: torch.Tensor, y: torch.Tensor, sync: bool) -> None:
        with contextlib.nullcontext() if sync else self.model.no_sync():
            loss = F.mse_loss(self.model(x), y) / self.k
            loss.backward()
        if sync:
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)


def deepspeed_config(stage: int, sizes: Sizes, k: int) -> dict[str, Any]:
    import torch.distributed as dist

    return {
        "train_micro_batch_size_per_gpu": sizes.micro_batch,
        "gradient_accumulation_steps": k,
        "train_batch_size": sizes.micro_batch * k * dist.get_world_size(),
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class DeepSpeedManual:
    """DeepSpeed's engine loop by hand: engine(x), engine.backward, engine.step at the boundary.

    The boundary is set explicitly each micro-step; with ``coalesce`` (ZeRO 2/3) the
    micro-steps of a window run inside one ``engine.coalesce_grad_reduction()`` block,
    which is what gradsync's ``sync_policy="defer"`` does.
    """

    def __init__(
        self, stage: int, coalesce: bool, sizes: Sizes, k: int, device: torch.device
    ) -> None:
        import deepspeed

        model = sizes.model()
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=sgd(model.parameters()),
            config=deepspeed_config(stage, sizes, k),
            dist_init_required=False,
        )
        self.engine = self.model = engine
        self.coalesce = coalesce and stage >= 2
        self.policy = "engine" + (" + coalesce" if self.coalesce else "")
        self._window: contextlib.ExitStack | None = None

    def micro(self, x: torch.Tensor, y: torch.Tensor, sync: bool) -> None:
        engine = self.engine
        engine.set_gradient_accumulation_boundary(sync)
        if self.coalesce and self._window is None:
            self._window = contextlib.ExitStack()
            self._window.enter_context(engine.coalesce_grad_reduction())
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)  # DeepSpeed divides by its configured gradient_accumulation_steps
        if sync:
            if self._window is not None:
                self._window.close()  # one reduction of the window's gradients
                self._window = None
                engine.set_gradient_accumulation_boundary(True)  # the block's exit restored False
            engine.step()


def deepspeed_process_setup() -> None:
    """Skip the JIT build of DeepSpeed's shared-memory comm op on CPU (minutes)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


# -- the cell definitions -------------------------------------------------------------
@dataclass(frozen=True)
class BackendCells:
    """How to build each mode on one backend."""

    label: str  # the name in the output ("deepspeed-2")
    backend: str  # gradsync's backend name
    requires: tuple[str, ...]  # modules that must import for the backend to run
    manual: Callable[[Sizes, int, torch.device], Runner]
    options: Callable[[Sizes, int], dict[str, Any]] = field(default=lambda sizes, k: {})
    accelerate: bool = False  # Accelerate's accumulate on this backend (DDP path only)
    gradsync_policy: str | None = None  # the "gradsync" mode's sync_policy (None: the default)
    best_options: dict[str, Any] = field(default_factory=dict)  # and its extra options
    process_setup: Callable[[], None] | None = None
    note: str = ""
    rep_scale: int = 1  # cheap cells get more repetitions, for tighter ratios
    grads_are_views: bool = False  # the backend's buckets are views of .grad: never drop them

    def missing(self) -> str | None:
        """None when every required module imports, else why this backend is skipped."""
        for module in self.requires:
            try:
                importlib.import_module(module)
            except Exception as err:  # ImportError, or an import-time failure of the backend
                return (
                    f"{self.label}: skipped, `import {module}` failed ({type(err).__name__}: {err})"
                )
        return None


def _deepspeed(stage: int) -> BackendCells:
    # The best policy on ZeRO 2 is "defer" (one coalesced reduction per step); the default
    # ("auto") picks it when the window's gradients fit the memory budget.
    defer = stage >= 2
    return BackendCells(
        label=f"deepspeed-{stage}",
        backend="deepspeed",
        requires=("deepspeed", "gradsync.backends.deepspeed"),
        manual=lambda sizes, k, device: DeepSpeedManual(stage, defer, sizes, k, device),
        options=lambda sizes, k: {"deepspeed_config": deepspeed_config(stage, sizes, k)},
        process_setup=deepspeed_process_setup,
        gradsync_policy="defer" if defer else None,
        note=(f"deepspeed-{stage}: the gradsync column uses sync_policy='defer'" if defer else ""),
    )


CELLS: dict[str, BackendCells] = {
    "ddp": BackendCells(
        label="ddp",
        backend="ddp",
        requires=("gradsync.backends.ddp",),
        manual=DDPManual,
        accelerate=True,
        rep_scale=3,
    ),
    "fsdp": BackendCells(
        label="fsdp",
        backend="fsdp",
        requires=("gradsync.backends.fsdp",),
        manual=FSDPManual,
        gradsync_policy="defer",
        best_options={"fsdp_keep_params_in_window": True},
        note=(
            "fsdp: FSDP2 (fully_shard per block, then the root); on gloo its reduce-scatter runs as a "
            "full all-reduce; the gradsync column uses sync_policy='defer' with "
            "fsdp_keep_params_in_window=True, the manual one the same through FSDP2's public setters"
        ),
    ),
    "deepspeed-0": _deepspeed(0),
    "deepspeed-2": _deepspeed(2),
    "fairscale": BackendCells(
        label="fairscale",
        backend="fairscale",
        requires=("fairscale", "gradsync.backends.fairscale"),
        manual=FairscaleManual,
        grads_are_views=True,
        note=(
            "fairscale: legacy ShardedDataParallel + OSS (fairscale 0.4.13); a sync is one reduce "
            "per owning rank (the gradients go to the rank whose optimizer shard holds them), "
            "and each step broadcasts the updated parameters"
        ),
    ),
}

MODES = ("naive", "default", "gradsync", "manual", "accelerate")


def checksum(model: Any) -> float:
    """A fingerprint of the full parameters (equal across modes that trained alike)."""
    inner = getattr(model, "module", model)
    total = 0.0
    for i, p in enumerate(inner.parameters()):
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        total += float((t.detach().double() * (1.0 + 0.01 * i)).sum())
    return total


def build(cells: BackendCells, mode: str, sizes: Sizes, k: int, device: torch.device) -> Runner:
    """The runner of one mode on one backend at accumulation ``k``."""
    if mode == "naive":
        return GradsyncRunner(cells.backend, sizes, k, "every_step", cells.options(sizes, k))
    if mode == "default":
        return GradsyncRunner(cells.backend, sizes, k, None, cells.options(sizes, k))
    if mode == "gradsync":
        return GradsyncRunner(
            cells.backend,
            sizes,
            k,
            cells.gradsync_policy,
            {**cells.options(sizes, k), **cells.best_options},
        )
    if mode == "manual":
        return cells.manual(sizes, k, device)
    if mode == "accelerate":
        return AccelerateRunner(sizes, k, device)
    raise ValueError(f"mode={mode!r} is unknown; use one of {', '.join(MODES)}")


def mode_skip(cells: BackendCells, mode: str) -> str | None:
    """Why ``mode`` does not run on this backend (None when it does)."""
    if mode != "accelerate":
        return None
    if not cells.accelerate:
        return (
            f"{cells.label}/accelerate: not measured; Accelerate configures FSDP and DeepSpeed "
            "process-wide from its own launcher, so only its DDP path runs side by side here"
        )
    try:
        importlib.import_module("accelerate")
    except ImportError:
        return f"{cells.label}/accelerate: skipped, accelerate is not installed (pip install 'gradsync[bench]')"
    return None
