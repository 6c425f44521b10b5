"""What an Accelerator puts into a checkpoint and takes back out of it.

The folder's format and verification live in ``folder``, its commit in ``commit``; the
models and optimizers go through the backend's ``save`` / ``load`` hooks; this module adds
the rest: the accumulation window, the prepared loaders' positions, the schedulers, the
fp16 loss scaler, the registered objects and every rank's RNG, and checks that a
checkpoint fits before anything is loaded. It reads the registry of prepared objects, the
window and the backend; it never sees the Accelerator.
"""

from __future__ import annotations

import collections
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.utils.hooks import RemovableHandle

from gradsync._core.microstep import drop_window
from gradsync._support import dist
from gradsync.errors import CheckpointError, ConfigError, UsageError
from gradsync.storage.commit import Committer
from gradsync.storage.folder import (
    LoaderPosition,
    Manifest,
    check_target,
    load_file,
    new_manifest,
    read_manifest,
    save_file,
)
from gradsync.storage.rng import capture_rng, restore_rng
from gradsync.storage.safety import allow_list

if TYPE_CHECKING:
    from gradsync._core.registry import Prepared
    from gradsync._plan.window import Window
    from gradsync.backends.base import Backend, Held
    from gradsync.data import LoaderContext

log = logging.getLogger("gradsync")


class CheckpointState:
    """``save_state`` / ``load_state`` over what one Accelerator prepared (``prepared``), its
    window and its backend. The window is changed only through its own methods."""

    def __init__(
        self, prepared: Prepared, window: Window, backend: Backend, loaders: LoaderContext
    ) -> None:
        self._prepared = prepared
        self._window = window
        self._backend = backend
        self._loaders = loaders
        self._committer = Committer()
        self._allowed: frozenset[str] | None = None
        #: Called with the folder being written, after the models and optimizers (every rank).
        self.save_hooks: dict[int, Callable[[Path], None]] = collections.OrderedDict()
        #: Called with the folder, once it is verified and before anything is loaded.
        self.load_hooks: dict[int, Callable[[Path], None]] = collections.OrderedDict()
        #: Called once everything is loaded (gradsync's own parts that derive from it).
        self.after_load: list[Callable[[], None]] = []

    def save(
        self,
        path: str | os.PathLike[str],
        keep_last: int | None,
        pending: int = 0,
        background: bool = False,
    ) -> str:
        p, window, backend = self._prepared, self._window, self._backend
        if window.current is not None:
            raise UsageError(
                "save_state() was called inside `with accel.accumulate(model):`; call it after "
                "the block (where optimizer.step() may also be)"
            )
        self._settle_quietly()  # before looking at the folder: the commit may be renaming it
        target = check_target(path, keep_last)
        last = self._loaders.last_pass() if self._loaders.last_pass is not None else None
        positions = [
            loader.position(pending if last is not None and loader.pass_in_progress is last else 0)
            for loader in p.loaders
        ]
        manifest = new_manifest(
            backend=backend.name,
            format=backend.checkpoint_format,
            world_size=dist.world_size(),
            optimizer_steps=p.steps_applied(),
            steps_applied=[o.steps_applied for o in p.optimizers],
            optimizer_models=[list(p.model_indices(o)) for o in p.optimizers],
            window=window.state_dict(),
            models=len(p.models),
            schedulers=len(p.schedulers),
            objects=len(p.objects),
            scaler=backend.scaler is not None,
            loaders=[_saved_position(pos) for pos in positions],
        )
        rank = dist.rank()
        # The user's hooks may gather (get_state_dict on a sharded backend): they run once
        # every rank has written its own files, so none of them waits for a rank that failed.
        with self._committer.writing(
            target,
            manifest,
            keep_last=keep_last,
            background=background,
            device=backend.device,
            then=list(self.save_hooks.values()),
        ) as tmp:
            backend.save(tmp, p.models, p.held(), window_open=window.is_open)
            if rank == 0:
                save_file([s.state_dict() for s in p.schedulers], tmp / "schedulers.pt")
                save_file([o.state_dict() for o in p.objects], tmp / "objects.pt")
                if backend.scaler is not None:
                    save_file(backend.scaler.state_dict(), tmp / "scaler.pt")
            save_file(
                {"rng": capture_rng(), "loaders": [pos["rng"] for pos in positions]},
                tmp / f"rng_rank{rank}.pt",
            )
        return str(target)

    def add_save_hook(
        self,
        hook: Callable[[list[Any], list[dict[str, Any]], str], None],
        unwrap: Callable[[Any], Any],
        state_dict: Callable[[Any], dict[str, Any]],
    ) -> RemovableHandle:
        """``register_save_state_pre_hook``: ``hook(models, weights, folder)`` in every save."""

        def call(folder: Path) -> None:
            hook(
                [unwrap(m) for m in self._prepared.models],
                [state_dict(m) for m in self._prepared.models],
                str(folder),
            )

        handle = RemovableHandle(self.save_hooks)
        self.save_hooks[handle.id] = call
        return handle

    def add_load_hook(
        self, hook: Callable[[list[Any], str], None], unwrap: Callable[[Any], Any]
    ) -> RemovableHandle:
        """``register_load_state_pre_hook``: ``hook(models, folder)`` in every load."""

        def call(folder: Path) -> None:
            hook([unwrap(m) for m in self._prepared.models], str(folder))

        handle = RemovableHandle(self.load_hooks)
        self.load_hooks[handle.id] = call
        return handle

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
        if failure is not None and dist.rank() == 0:
            warnings.warn(
                f"gradsync: {failure}; that checkpoint does not exist", RuntimeWarning, stacklevel=4
            )

    def finish(self) -> CheckpointError | None:
        return self._committer.finish()

    def _check(self, where: str, manifest: Manifest) -> None:
        backend, here = self._backend, dist.world_size()
        saved_backend, saved_format = manifest.get("backend"), manifest.get("format")
        mid = int(manifest["window"]["index"]) > 0
        if saved_format != backend.checkpoint_format:
            # imported here: torch's pipelining imports torch.compile's dynamo (seconds)
            from gradsync.backends import _pipeline, _plain_into_stage

            pipelined = any(_pipeline.is_stage(m) for m in self._prepared.models)
            if pipelined and saved_format == "plain" and mid:
                raise _plain_into_stage.mid_window(where, f"backend={saved_backend!r}")
            if pipelined and saved_format != "plain":
                raise CheckpointError(
                    f"checkpoint {where!r} was saved with backend={saved_backend!r} in its "
                    f"{saved_format!r} format, and a pipeline (pp) reads DCP and plain-file "
                    f"checkpoints only; resume it without pp, with backend={saved_backend!r}"
                )
            if not pipelined:
                raise CheckpointError(
                    f"checkpoint {where!r} was saved with backend={saved_backend!r}, whose "
                    f"format backend={backend.name!r} cannot read; load it with "
                    f"backend={saved_backend!r}"
                )
        have = self._prepared.counts()
        saved = {
            "models": manifest["models"],
            "schedulers": manifest["schedulers"],
            "objects": manifest["objects"],
            "loaders": len(manifest["loaders"]),
            "optimizers": len(manifest["steps_applied"]),
        }
        if have != saved:
            diff = ", ".join(
                f"{k} {saved[k]} saved vs {have[k]} here" for k in have if have[k] != saved[k]
            )
            raise CheckpointError(
                f"checkpoint {where!r} does not fit this training: {diff}; prepare (and "
                "register) the same objects before load_state()"
            )
        world = int(manifest["world_size"])
        if world != here and mid:
            raise CheckpointError(
                f"checkpoint {where!r} was saved mid-window on {world} rank(s); its per-rank window "
                f"gradients cannot be resumed on {here}: resume on {world}, or from a "
                "checkpoint saved at a boundary"
            )
        if world != here and not backend.reshardable:
            raise CheckpointError(
                f"checkpoint {where!r} was saved on {world} rank(s) and backend={backend.name!r} "
                f"cannot reshard it to {here}; resume on {world} rank(s)"
            )

    def _held(self, where: str, manifest: Manifest) -> list[Held]:
        """The optimizers in the checkpoint's layout; a ``CheckpointError`` when the models
        each one holds differ from this training's."""
        p = self._prepared
        if manifest["gradsync_checkpoint"] == 1:  # gradsync 0.1: one optimizer per model
            try:
                return p.held_by_model()
            except ValueError as err:
                raise CheckpointError(
                    f"checkpoint {where!r} was written by gradsync 0.1 (one optimizer per model), "
                    f"but here {err}: prepare one optimizer per model to resume it"
                ) from None
        held = p.held()
        saved = [tuple(m) for m in manifest["optimizer_models"]]
        for h, models in zip(held, saved):
            if h.models != models:
                raise CheckpointError(
                    f"checkpoint {where!r} does not fit this training: its optimizer {h.index} "
                    f"holds models {list(models)}, here {list(h.models)}; prepare the same "
                    "models and optimizers, in the same order, before load_state()"
                )
        return held

    def allowed(self) -> frozenset[str]:
        """The globals this backend's checkpoints may name: torch's ``weights_only`` set and
        the backend's own."""
        if self._allowed is None:
            self._allowed = allow_list(self._backend.checkpoint_globals)
        return self._allowed

    def load(self, path: str | os.PathLike[str], trusted: bool = False) -> None:
        p, window, backend = self._prepared, self._window, self._backend
        here = dist.world_size()
        if window.current is not None:
            raise UsageError(
                "load_state() was called inside `with accel.accumulate(model):`; call it before the loop"
            )
        self._settle_quietly()  # a background save of this very folder may still be committing
        manifest = read_manifest(path, None if trusted else self.allowed().__contains__)
        folder = Path(path)
        self._check(str(folder), manifest)
        for hook in list(self.load_hooks.values()):
            hook(folder)
        world = int(manifest["world_size"])
        same_world = world == here
        # Everything gradsync itself keeps is read before the backend changes anything.
        rng = load_file(folder / f"rng_rank{dist.rank() if same_world else 0}.pt", trusted=trusted)
        schedulers = load_file(folder / "schedulers.pt", trusted=trusted)
        objects = load_file(folder / "objects.pt", trusted=trusted)
        scaler = backend.scaler
        scaler_state = (
            load_file(folder / "scaler.pt", trusted=trusted)
            if scaler is not None and manifest.get("scaler")
            else None
        )
        if window.is_open:
            drop_window(window, backend, p)
        backend.load(
            folder,
            p.models,
            self._held(str(folder), manifest),
            trusted=trusted,
            window_open=int(manifest["window"]["index"]) > 0,
        )
        for opt, steps in zip(p.optimizers, manifest["steps_applied"]):
            opt.steps_applied = int(steps)
        for sched, state in zip(p.schedulers, schedulers):
            sched.load_state_dict(state)  # after the optimizers' step counts: it re-aligns to them
        for obj, state in zip(p.objects, objects):
            obj.load_state_dict(state)
        if scaler is not None and scaler_state is not None:
            scaler.load_state_dict(scaler_state)
        window.load_state_dict(dict(manifest["window"]))

        def now() -> None:
            restore_rng(rng["rng"])

        for loader, pos, pass_rng in zip(p.loaders, manifest["loaders"], rng["loaders"]):
            if not same_world:
                pos, pass_rng = _rescale(pos, world, here), None
            loader.resume({**pos, "rng": pass_rng}, now)
        now()
        for after in self.after_load:
            after()


def choose_folder(
    call: str,
    path: str | os.PathLike[str] | None,
    alias: str,
    other: str | os.PathLike[str] | None,
    project_dir: str | None,
    steps: int,
) -> str | os.PathLike[str]:
    """The folder of ``save_state`` / ``load_state``: ``path`` or Accelerate's name for it
    (never both); for ``save_state`` without either, ``project_dir/checkpoints/step-N``."""
    if path is not None and other is not None:
        raise ConfigError(f"{call}() got both path and {alias}; give one of them")
    chosen = path if path is not None else other
    if chosen is not None:
        return chosen
    if project_dir is None or call != "save_state":
        raise ConfigError(
            f"{call}() needs the checkpoint folder: {call}(path), or set "
            "project_dir to save under project_dir/checkpoints"
        )
    return os.path.join(project_dir, "checkpoints", f"step-{steps}")


def _rescale(pos: LoaderPosition, saved_world: int, world: int) -> LoaderPosition:
    """A pass position on another world size: as many samples of the epoch are skipped as
    were consumed on all ranks together. Which samples they are follows the new sharding
    (the same ones when both world sizes shard the same DistributedSampler order)."""
    consumed = int(pos["consumed"]) * saved_world
    if consumed % world:
        log.warning(
            "gradsync: resuming on %d rank(s) a pass saved on %d: %d batches consumed do not divide "
            "evenly; resuming after %d",
            world,
            saved_world,
            pos["consumed"],
            consumed // world,
        )
    out: LoaderPosition = {
        "epoch": pos["epoch"],
        "consumed": consumed // world,
        "read": consumed // world,
    }
    if "split" in pos:
        out["split"] = pos["split"]
    return out


def _saved_position(pos: dict[str, Any]) -> LoaderPosition:
    """What the manifest keeps of a loader's position (its split only once one happened)."""
    out: LoaderPosition = {"epoch": pos["epoch"], "consumed": pos["consumed"], "read": pos["read"]}
    if pos.get("split", 1) > 1:
        out["split"] = pos["split"]
    return out
