"""Compressed gradient sync (``comm_hook``) scenarios, run by mp_worker.py inside one 2-rank
gloo group: the shared loop with each hook, a dropped window's effect on PowerSGD's state,
a mid-window save and resume, and the refusals."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from gradsync import Accelerator

from scenarios.common import DEEPSPEED_PRELOAD as PRELOAD  # noqa: F401  (mp_worker.py)
from scenarios.common import Indexed, Loop, make_model, make_optimizer, make_scheduler, train

#: PowerSGD from the third optimizer step on (torch needs two plain ones first), rank 1.
POWER = {"start_powerSGD_iter": 2, "matrix_approximation_rank": 1}


def train_hooked(
    *,
    steps: int,
    loop: Loop,
    hook: str,
    backend: str = "ddp",
    policy: str = "auto",
    wrapper: str = "no",
    options: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The shared loop with ``comm_hook=hook``, audited; for PowerSGD also its counter."""
    accel = Accelerator(
        backend=backend,
        gradient_accumulation_steps=steps,
        sync_policy=policy,
        seed=0,
        audit=True,
        comm_hook=hook,
        comm_wrapper=wrapper,
        comm_state_option=options,
        **(extra or {}),
    )
    out = train(accel, loop)
    hooked = list(getattr(accel._backend, "_hooked", {}).values())
    out["hook_iter"] = hooked[0].state.iter if hooked and hooked[0].state is not None else None
    return out


def _digest(accel: Accelerator) -> str:
    """PowerSGD's whole state on this rank, as one hash (counters, RNG, error, matrices)."""
    (hooked,) = accel._backend._hooked.values()  # type: ignore[attr-defined]
    state = hooked.state_dict()
    h = hashlib.sha256(repr((state["iter"], state["stats"], state["rng"]["pos"])).encode())
    h.update(state["rng"]["keys"].numpy().tobytes())
    for part in state["buckets"]:
        for key in ("error", "p", "q"):
            if key in part:
                h.update(key.encode() + part[key].numpy().tobytes())
    return h.hexdigest()


def dropped_windows(*, hook: str) -> dict[str, Any]:
    """PowerSGD's state around dropped windows: under every_step the hook runs on the
    dropped window's micro-steps, under defer in its boundary micro-step (the block raises
    after that backward); either way the state must be what the window found."""
    out: dict[str, Any] = {}
    for policy in ("every_step", "defer"):
        accel = Accelerator(
            backend="ddp",
            gradient_accumulation_steps=4,
            sync_policy=policy,
            seed=0,
            comm_hook=hook,
            comm_state_option=POWER,
        )
        model = make_model()
        opt = make_optimizer(model.parameters(), "sgd", 0.05)
        loader = DataLoader(Indexed(64), batch_size=2)
        model, opt, loader = accel.prepare(model, opt, loader)
        batches = iter(loader)
        digests, raise_at = [], 1 if policy == "every_step" else 3
        for window in range(4):  # windows 0-2 reach PowerSGD (iter 2 from the third on)
            digests.append(_digest(accel))
            for micro in range(4):
                x, y, _ = next(batches)
                try:
                    with accel.accumulate(model):
                        accel.backward(F.mse_loss(model(x), y))
                        if window == 3 and micro == raise_at:
                            raise RuntimeError("dropped")
                        opt.step()
                        opt.zero_grad()
                except RuntimeError:
                    break
        iter_before_drop = accel._backend._hooked[id(model)].state.iter  # type: ignore[attr-defined]
        out[policy] = {
            "moved": digests[3] != digests[2],  # a kept window changes the state
            "after_drop": _digest(accel) == digests[3],
            "iter": iter_before_drop,
            "grads_cleared": all(p.grad is None for p in model.parameters()),
        }
    return out


def _resume_run(
    hook: str,
    *,
    stop_at: int | None = None,
    folder: Path | None = None,
    resume: Path | None = None,
    wrapper: str = "no",
) -> dict[str, Any]:
    """k=4 over 2 epochs of 44 samples (windows 4, 4, 3 per epoch and rank), PowerSGD from
    the third step; saves into ``folder`` after micro-step ``stop_at`` and stops, or resumes
    from ``resume`` (a new Accelerator and a new DDP wrapper: DDP's first bucket layout)."""
    accel = Accelerator(
        backend="ddp",
        gradient_accumulation_steps=4,
        seed=0,
        comm_hook=hook,
        comm_wrapper=wrapper,
        comm_state_option=POWER,
    )
    model = make_model()
    opt = make_optimizer(model.parameters(), "sgd", 0.05)
    sched = make_scheduler(opt)
    loader = DataLoader(Indexed(44), batch_size=2, shuffle=True)
    model, opt, loader, sched = accel.prepare(model, opt, loader, sched)
    if resume is not None:
        accel.load_state(resume)
    micro = 0
    for _epoch in range(loader.epoch, 2):
        for x, y, _ in loader:
            with accel.accumulate(model):
                accel.backward(F.mse_loss(model(x), y))
                opt.step()
                sched.step()
                opt.zero_grad()
            micro += 1
            if stop_at is not None and micro == stop_at:
                assert folder is not None and not accel.sync_gradients, "save mid-window"
                accel.save_state(folder)
                return {"saved": sorted(p.name for p in folder.iterdir())}
    state = {k: v.clone() for k, v in accel.get_state_dict(model).items()}
    (hooked,) = accel._backend._hooked.values()  # type: ignore[attr-defined]
    return {"state": state, "iter": hooked.state.iter, "steps": accel.optimizer_steps}


def resume_mid_window(*, hook: str, stop_at: int, wrapper: str = "no") -> dict[str, Any]:
    """The uninterrupted run, then one saved mid-window at ``stop_at`` and resumed in a new
    Accelerator: the final parameters, PowerSGD's counter and the step count must be equal."""
    box = [tempfile.mkdtemp(prefix="gradsync-scn-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    root = Path(str(box[0]))
    whole = _resume_run(hook, wrapper=wrapper)
    saved = _resume_run(hook, stop_at=stop_at, folder=root / "mid", wrapper=wrapper)
    resumed = _resume_run(hook, resume=root / "mid", wrapper=wrapper)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root)
    return {
        "saved": saved["saved"],
        "bitwise": all(torch.equal(whole["state"][k], resumed["state"][k]) for k in whole["state"]),
        "max_diff": max(
            float((whole["state"][k] - resumed["state"][k]).abs().max()) for k in whole["state"]
        ),
        "iter": [whole["iter"], resumed["iter"]],
        "steps": [whole["steps"], resumed["steps"]],
    }


def refusals() -> dict[str, str]:
    """Each hook a backend cannot run: the one-line error (every rank alike)."""
    asked = {
        "fsdp_power_sgd": {"backend": "fsdp", "comm_hook": "power_sgd"},
        "deepspeed_power_sgd": {
            "backend": "deepspeed",
            "comm_hook": "batched_power_sgd",
            "deepspeed_config": {"zero_optimization": {"stage": 1}},
        },
        "deepspeed_contradiction": {
            "backend": "deepspeed",
            "comm_hook": "fp16",
            "deepspeed_config": {"communication_data_type": "bf16"},
        },
        "fairscale_fp16": {"backend": "fairscale", "comm_hook": "fp16"},
        "ddp_bad_option": {
            "backend": "ddp",
            "comm_hook": "power_sgd",
            "comm_state_option": {"start_powerSGD_iter": 1},
        },
    }
    out = {}
    for name, kwargs in asked.items():
        try:
            Accelerator(**kwargs)
            out[name] = "no error"
        except Exception as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out
