"""What an Accelerator puts into a checkpoint and takes back out of it.

The folder's format, atomic writes and verification live in ``checkpoint``; the models
and optimizers go through the backend's ``save`` / ``load`` hooks; this module adds the
rest: the accumulation window, the prepared loaders' positions, the schedulers, the
fp16 loss scaler, the registered objects and every rank's RNG, and checks that a
checkpoint fits before anything is loaded.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gradsync import checkpoint
from gradsync.checkpoint import CheckpointError, load_file, save_file
from gradsync.errors import ConfigError

if TYPE_CHECKING:
    from gradsync.accelerator import Accelerator
    from gradsync.backends.base import Backend

log = logging.getLogger("gradsync")


# -- RNG ----------------------------------------------------------------------------
def capture_rng() -> dict[str, Any]:
    """Python's, numpy's (when numpy is in use), torch's CPU and CUDA generators."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        name, key, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [str(name), torch.from_numpy(key.astype("int64")), int(pos),
                          int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        name, key, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- SIGTERM -------------------------------------------------------------------------
class SigtermWatch:
    """Remembers that SIGTERM arrived (with ``save_on_sigterm``); the Accelerator acts on
    it when the next window starts."""

    def __init__(self, root: str | None) -> None:
        self.enabled = root is not None
        self.received = False
        if not self.enabled:
            return
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                "save_on_sigterm needs the Accelerator to be built in the main thread (only it "
                "can receive signals); build it there, or leave save_on_sigterm unset"
            )
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received = True


# -- save and load -------------------------------------------------------------------
class CheckpointState:
    """``save_state`` / ``load_state`` of one Accelerator (it reads the Accelerator's
    prepared objects; the window is changed only through its own methods)."""

    def __init__(self, accel: Accelerator) -> None:
        self._accel = accel
        self._committer = checkpoint.Committer()

    def _optimizers(self) -> list[torch.optim.Optimizer | None]:
        return [o.optimizer if o is not None else None for o in self._accel._model_optimizers]

    def save(self, path: str | os.PathLike[str], keep_last: int | None, pending: int = 0,
             background: bool = False) -> str:
        a = self._accel
        if a._window.current is not None:
            raise RuntimeError(
                "save_state() was called inside `with accel.accumulate(model):`; call it after "
                "the block (where optimizer.step() may also be)"
            )
        self._settle_quietly()  # before looking at the folder: the commit may be renaming it
        target = checkpoint.check_target(path, keep_last)
        last = a._loaders.last_pass() if a._loaders.last_pass is not None else None
        positions = [
            loader.position(pending if last is not None and loader.pass_in_progress is last else 0)
            for loader in a._prepared_loaders
        ]
        manifest = checkpoint.new_manifest(
            backend=a.backend, format=a._backend.checkpoint_format, world_size=a.world_size,
            optimizer_steps=a.optimizer_steps, steps_applied=[o.steps_applied for o in a._optimizers],
            window=a._window.state_dict(), models=len(a._models), schedulers=len(a._schedulers),
            objects=len(a._registered), scaler=a._backend.scaler is not None,
            loaders=[{k: p[k] for k in ("epoch", "consumed", "read")} for p in positions],
        )
        rank = a.rank
        with self._committer.writing(target, manifest, keep_last=keep_last, background=background,
                                     device=a.device) as tmp:
            a._backend.save(tmp, a._models, self._optimizers(), window_open=a._window.is_open)
            if rank == 0:
                save_file([s.state_dict() for s in a._schedulers], tmp / "schedulers.pt")
                save_file([o.state_dict() for o in a._registered], tmp / "objects.pt")
                if a._backend.scaler is not None:
                    save_file(a._backend.scaler.state_dict(), tmp / "scaler.pt")
            save_file({"rng": capture_rng(), "loaders": [p["rng"] for p in positions]},
                      tmp / f"rng_rank{rank}.pt")
        return str(target)

    def settle(self) -> str | None:
        """Wait for an outstanding background save (collective); its folder, or None. Its
        failure raises CheckpointError on every rank."""
        target, failure = self._committer.settle()
        if failure is not None:
            raise failure
        return target

    def _settle_quietly(self) -> None:
        """Before another save or a load: wait for an outstanding background save; a failure
        is a warning (rank 0) and the new save or load goes on (the SIGTERM save too)."""
        _, failure = self._committer.settle()
        if failure is not None and self._accel.rank == 0:
            warnings.warn(f"gradsync: {failure}; that checkpoint does not exist", RuntimeWarning, stacklevel=4)

    def finish(self) -> CheckpointError | None:
        return self._committer.finish()

    def _check(self, where: str, manifest: dict[str, Any]) -> None:
        a = self._accel
        saved_backend = manifest.get("backend")
        if manifest.get("format") != a._backend.checkpoint_format:
            raise CheckpointError(
                f"checkpoint {where!r} was saved with backend={saved_backend!r}, whose format "
                f"backend={a.backend!r} cannot read; load it with backend={saved_backend!r}"
            )
        have = {"models": len(a._models), "schedulers": len(a._schedulers), "objects": len(a._registered),
                "loaders": len(a._prepared_loaders), "optimizers": len(a._optimizers)}
        saved = {"models": manifest["models"], "schedulers": manifest["schedulers"],
                 "objects": manifest["objects"], "loaders": len(manifest["loaders"]),
                 "optimizers": len(manifest["steps_applied"])}
        if have != saved:
            diff = ", ".join(f"{k} {saved[k]} saved vs {have[k]} here" for k in have if have[k] != saved[k])
            raise CheckpointError(
                f"checkpoint {where!r} does not fit this training: {diff}; prepare (and "
                "register) the same objects before load_state()"
            )
        world, mid = int(manifest["world_size"]), int(manifest["window"]["index"]) > 0
        if world != a.world_size and mid:
            raise CheckpointError(
                f"checkpoint {where!r} was saved mid-window on {world} rank(s); its per-rank window "
                f"gradients cannot be resumed on {a.world_size}: resume on {world}, or from a "
                "checkpoint saved at a boundary"
            )
        if world != a.world_size and not a._backend.reshardable:
            raise CheckpointError(
                f"checkpoint {where!r} was saved on {world} rank(s) and backend={a.backend!r} "
                f"cannot reshard it to {a.world_size}; resume on {world} rank(s)"
            )

    def load(self, path: str | os.PathLike[str]) -> None:
        a = self._accel
        if a._window.current is not None:
            raise RuntimeError(
                "load_state() was called inside `with accel.accumulate(model):`; call it before the loop"
            )
        self._settle_quietly()  # a background save of this very folder may still be committing
        manifest = checkpoint.read_manifest(path)
        folder = Path(path)
        self._check(str(folder), manifest)
        world = int(manifest["world_size"])
        same_world = world == a.world_size
        # Everything gradsync itself keeps is read before the backend changes anything.
        rng = load_file(folder / f"rng_rank{a.rank if same_world else 0}.pt")
        schedulers = load_file(folder / "schedulers.pt")
        objects = load_file(folder / "objects.pt")
        scaler = a._backend.scaler
        scaler_state = load_file(folder / "scaler.pt") if scaler is not None and manifest.get("scaler") else None
        if a._window.is_open:
            a._drop_window()
        a._backend.load(folder, a._models, self._optimizers(),
                        window_open=int(manifest["window"]["index"]) > 0)
        for opt, steps in zip(a._optimizers, manifest["steps_applied"]):
            opt.steps_applied = int(steps)
        for sched, state in zip(a._schedulers, schedulers):
            sched.load_state_dict(state)  # after the optimizers' step counts: it re-aligns to them
        for obj, state in zip(a._registered, objects):
            obj.load_state_dict(state)
        if scaler is not None and scaler_state is not None:
            scaler.load_state_dict(scaler_state)
        a._window.load_state_dict(manifest["window"])

        def now() -> None:
            restore_rng(rng["rng"])

        for loader, pos, pass_rng in zip(a._prepared_loaders, manifest["loaders"], rng["loaders"]):
            if not same_world:
                pos, pass_rng = _rescale(pos, world, a.world_size), None
            loader.resume({**pos, "rng": pass_rng}, now)
        now()


def _rescale(pos: dict[str, Any], saved_world: int, world: int) -> dict[str, Any]:
    """A pass position on another world size: as many samples of the epoch are skipped as
    were consumed on all ranks together. Which samples they are follows the new sharding
    (the same ones when both world sizes shard the same DistributedSampler order)."""
    consumed = int(pos["consumed"]) * saved_world
    if consumed % world:
        log.warning(
            "gradsync: resuming on %d rank(s) a pass saved on %d: %d batches consumed do not divide "
            "evenly; resuming after %d", world, saved_world, pos["consumed"], consumed // world,
        )
    return {"epoch": pos["epoch"], "consumed": consumed // world, "read": consumed // world}


# -- safetensors export ---------------------------------------------------------------
def save_model(backend: Backend, model: torch.nn.Module, directory: str | os.PathLike[str],
               rank: int) -> str:
    folder = Path(directory)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(
            f"save_model(directory={str(folder)!r}): that path is an existing file; give a folder"
        )
    state = backend.state_dict(model)  # gathered (a collective on sharded backends)
    target = folder / "model.safetensors"
    if rank == 0:
        from safetensors.torch import save_file as save_safetensors

        module = backend.unwrap(model)
        first: dict[int, str] = {}
        tied: dict[str, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in first:
                tied[name] = first[id(p)]  # written once, under its first name
            else:
                first[id(p)] = name
        tensors: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for key, value in state.items():
            if key in tied:
                continue
            t = value.detach().cpu().contiguous()
            ptr = t.untyped_storage().data_ptr()
            if ptr in storages:  # safetensors refuses tensors that share memory
                t = t.clone()
            storages.add(t.untyped_storage().data_ptr())
            tensors[key] = t
        folder.mkdir(parents=True, exist_ok=True)
        part = folder / "model.safetensors.part"
        save_safetensors(tensors, str(part), metadata={"format": "pt", "tied": json.dumps(tied)})
        os.replace(part, target)
    backend.barrier()
    return str(target)
