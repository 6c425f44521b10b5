"""The in-process side of ``gradsync verify``: what an Accelerator records (or replays) while
the script runs under verification.

``gradsync verify`` (``gradsync.verify``) runs the user's script twice and sets these
variables; an ``Accelerator`` built while ``GRADSYNC_VERIFY`` is set attaches a ``Verifier``:

* ``GRADSYNC_VERIFY=<folder>``: record into the folder: every batch each prepared loader's
  source yields on this rank (a copy on the CPU, per pass, in order); at the start of the
  first window and after every window, every trained model's full state dict (rank 0 keeps
  it) and the window's loss (``window_loss``) and the audit's gradient reduction bytes off
  and on the boundary. Dropout modules of the prepared models get ``p=0``. After
  ``GRADSYNC_VERIFY_STEPS`` windows, at the start of the next one, the Accelerator ends and
  every rank exits with status 0.
* ``GRADSYNC_VERIFY_REPLAY=<folder of the launched run>`` as well: the reference, one
  process. The settings are forced (``overrides``: backend ``single``, each window k x N
  micro-batches, no backend option), the models start from the launched run's initial
  parameters, the prepared schedulers step as many times per optimizer step as on the
  launched world (the rule book's ``scheduler_steps``: N under Accelerate's, unless
  ``split_batches``), and each prepared loader (matched by prepare order) replays the
  batches the N ranks read: position by position, rank by rank within a position, with the
  passes ending where they ended. A window of k micro-steps on N ranks is thus one window of the same k x N
  micro-batches, in (micro-step, rank) order; partial windows, schedules and item counts
  are the global window's.

On an N-D mesh (``parallelism`` with tp > 1) the ranks of one tensor-parallel group read the
same micro-batches: N is then the data-parallel size R x S, the meta's ``readers`` lists
the ranks of each data-parallel position, and the reference replays the first of each
(``mismatched_readers`` checks beforehand that the others read the same). With a pipeline
(pp > 1) the stages of one pipeline read the same micro-batches too, and each rank holds
its own stage's parameters: the snapshots and the parameter names are gathered from every
rank, so rank 0 writes the whole model's.

Nothing here runs unless those variables are set.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from gradsync._support import dist
from gradsync.data.batches import tree_map
from gradsync.rules import GRADSYNC, Rules
from gradsync.settings import SETTINGS
from gradsync.storage.rng import capture_rng
from gradsync.verify.records import (
    ENV_RECORD,
    ENV_REPLAY,
    ENV_STEPS,
    META,
    batches_file,
    params_file,
    read_meta,
    readers,
)

log = logging.getLogger("gradsync")


class GlobalWindows:
    """The reference's accumulation schedule: window ``w`` holds ``world`` times the
    micro-steps the launched run's window ``w`` had (its k, not a partial size: the end
    of the replayed pass makes the partial windows)."""

    def __init__(self, steps: list[int], world: int) -> None:
        self.steps = list(steps) or [1]
        self.world = world

    def __call__(self, optimizer_step: int) -> int:
        return self.world * self.steps[min(optimizer_step, len(self.steps) - 1)]

    def __repr__(self) -> str:
        return f"GlobalWindows({self.steps}, world={self.world})"


def overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings verification forces, over every other source (the script's keywords too).

    The launched run: the audit (for the gradient bytes off the boundary) and the window
    loss are on. The reference: one process on the ``single`` backend, window ``w`` of
    k x N micro-batches (the launched run's k of that window, N its world size), the sync
    policy ``auto``, no backend option, no audit, the window loss on.

    Args:
        environ: the variables (``ENV_RECORD``, ``ENV_REPLAY``).

    Returns:
        Setting name -> value (None is a value here: "unset"); {} outside verification.
    """
    if ENV_RECORD not in environ:
        return {}
    if ENV_REPLAY not in environ:
        return {"audit": True, "track_window_loss": True}
    meta = read_meta(environ[ENV_REPLAY])
    forced: dict[str, Any] = {s.name: s.default for s in SETTINGS if s.backend is not None}
    forced.update(
        backend="single",
        sync_policy="auto",
        audit=False,
        track_window_loss=True,
        global_batch_size=None,
        gradient_accumulation_steps=GlobalWindows(meta.get("k", [1]), int(meta.get("world", 1))),
    )
    return forced


def _on_cpu(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().to("cpu", copy=True) for k, v in state.items() if isinstance(v, torch.Tensor)
    }


class ReplayExhausted(RuntimeError):
    """The reference asked for a batch the launched run never read."""


def _cpu_copy(batch: Any) -> Any:
    """``batch`` with every tensor copied to the CPU (the script may change its batch in place)."""
    return tree_map(
        lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v, batch
    )


def _sized(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


class RecordingLoader:
    """Stands in for a prepared loader's source: yields what it yields and keeps a copy of
    each batch, per pass (``passes``: ``{"batches", "exhausted", "len"}`` each)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.passes: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        record: dict[str, Any] = {"batches": [], "exhausted": False, "len": _sized(self.loader)}
        self.passes.append(record)
        return self._record(iter(self.loader), record)

    @staticmethod
    def _record(source: Iterator[Any], record: dict[str, Any]) -> Iterator[Any]:
        for batch in source:
            record["batches"].append(_cpu_copy(batch))
            yield batch
        record["exhausted"] = True


class ReplayLoader:
    """Stands in for a prepared loader's source in the reference: pass ``p`` yields the
    batches the launched run's ranks read in their pass ``p``, position by position and rank
    by rank within a position; its length is the ranks' lengths summed."""

    def __init__(self, loader: Any, passes: list[list[dict[str, Any]]], index: int) -> None:
        self.loader = loader
        self._passes = passes  # pass -> rank -> record
        self._index = index
        self._next = 0
        self._shown = 0  # the pass len() describes

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        if self._shown >= len(self._passes):
            raise TypeError("the launched run recorded no such pass")
        lengths = [r["len"] for r in self._passes[self._shown]]
        if any(n is None for n in lengths):
            raise TypeError("the launched run's loader has no length")
        return int(sum(lengths))

    def __iter__(self) -> Iterator[Any]:
        number, self._next = self._next, self._next + 1
        self._shown = number
        return self._replay(number)

    def _replay(self, number: int) -> Iterator[Any]:
        where = f"prepared loader {self._index + 1}, pass {number + 1}"
        if number >= len(self._passes):
            raise ReplayExhausted(
                f"the reference started {where}, which the launched run never started"
            )
        ranks = self._passes[number]
        longest = max((len(r["batches"]) for r in ranks), default=0)
        for position in range(longest):
            for record in ranks:
                if position < len(record["batches"]):
                    yield record["batches"][position]
        if not all(r["exhausted"] for r in ranks):
            raise ReplayExhausted(
                f"the reference needed batch {longest + 1} per rank of {where}, which the "
                "launched run never read"
            )


def _rng_states() -> dict[str, Any]:
    """Every random generator a training step may draw from (torch's, CUDA's, Python's,
    NumPy's), as ``checkpoint.rng.capture_rng`` captures them."""
    with contextlib.suppress(ImportError):
        import numpy  # noqa: F401  (capture_rng reads NumPy's generator once it is imported)
    return capture_rng()


def _advanced(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The generators whose state changed."""
    out = []
    for name, old in before.items():
        new: Any = after.get(name)
        if name in ("torch",):
            same = torch.equal(old, new)
        elif name == "cuda":
            same = len(old) == len(new) and all(torch.equal(a, b) for a, b in zip(old, new))
        elif name == "numpy":  # [name, key (a tensor), position, has_gauss, cached]
            same = old[0] == new[0] and torch.equal(old[1], new[1]) and old[2:] == new[2:]
        else:
            same = old == new
        if not same:
            out.append(name)
    return out


def _quiet_dropout(model: torch.nn.Module) -> list[str]:
    """Set every dropout of ``model`` to p=0; the modules changed (name: old p)."""
    changed = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            changed.append(f"{name or type(module).__name__} (p={module.p:g})")
            module.p = 0.0
        elif isinstance(module, torch.nn.MultiheadAttention) and module.dropout > 0:
            changed.append(f"{name or 'MultiheadAttention'} (dropout={module.dropout:g})")
            module.dropout = 0.0
    return changed


def _save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class Verifier:
    """Records (or replays) one run under ``gradsync verify``; made by ``attach``.

    Args:
        accel: the Accelerator (its public API: ``get_state_dict``, ``unwrap_model``,
            ``window_loss``, ``audit``, ``end`` ...).
        runner: its micro-step runner (``before_window`` and ``at_boundary`` hooks).
        preparer: its preparer (``loader_hook``).
        prepared: its registry of prepared objects.
        folder: where to record.
        steps: the windows to run before stopping.
        replay_from: the launched run's folder (the reference), or None (the launched run).
        data_parallel: the ranks that read distinct micro-batches (``Backend.data_parallel``:
            ``rank``, ``size``); None: every rank.
        rules: the rule book the Accelerator follows (``gradsync.rules``); the reference
            replays the launched run's: its prepared schedulers step as many times per
            optimizer step as the launched world's do.
    """

    def __init__(
        self,
        accel: Any,
        runner: Any,
        preparer: Any,
        prepared: Any,
        folder: str,
        steps: int,
        replay_from: str | None,
        data_parallel: Any = None,
        rules: Rules = GRADSYNC,
    ) -> None:
        self.accel = accel
        self.prepared = prepared
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.steps = steps
        self.replay_from = Path(replay_from) if replay_from else None
        self.rank = int(accel.rank)
        self.loaders: list[RecordingLoader] = []
        self._replayed: list[list[list[dict[str, Any]]]] | None = None  # loader -> pass -> rank
        self.windows = 0
        self.snapshots = -1  # the last step snapshotted (0: the initial parameters)
        self.pending = False
        self._steps_at_start = 0
        self._audit_seen = 0
        self._rng_start: dict[str, Any] | None = None
        processes = int(accel.world_size)
        self.meta: dict[str, Any] = {
            "rank": self.rank,
            "world": processes,
            "processes": processes,
            "readers": [[r] for r in range(processes)],
            "reference": self.replay_from is not None,
            "backend": accel.backend,
            "mixed_precision": accel.mixed_precision,
            "comm": {
                "hook": accel.config.comm_hook,
                "wrapper": accel.config.comm_wrapper,
                "options": dict(accel.config.comm_state_option or {}),
            },
            "sync_policy": None,
            "steps_wanted": steps,
            "k": [],
            "rows": [],
            "dropout": [],
            "dtypes": [],
            "param_names": [],
            "unverifiable": None,
            "rng_drawn": [],
            "loaders": 0,
            "stopped": False,
        }
        if data_parallel is not None and int(data_parallel.size) != processes:
            self.meta["world"] = int(data_parallel.size)
            self.meta["readers"] = readers(
                dist.all_gather_object(int(data_parallel.rank)), int(data_parallel.size)
            )
        launched_world = int(self.meta["world"])
        if self.replay_from is not None:  # the schedule steps as on the launched world
            launched_world = int(read_meta(self.replay_from).get("world", 1))
            preparer.scheduler_processes = launched_world
        self.meta["rules"] = {
            "name": rules.name,
            "scheduler_steps": rules.scheduler_steps(launched_world),
            "loss_divisor": rules.loss_divisor,
            "dealing": rules.dealing,
        }
        runner.before_window.append(self._before_window)
        runner.at_boundary.append(self._at_boundary)
        preparer.loader_hook = self._wrap_loader
        if self.replay_from is None:
            atexit.register(self._write_batches)
        self._write_meta()

    # -- the loaders --------------------------------------------------------------
    def _wrap_loader(self, loader: Any) -> Any:
        index = self.meta["loaders"]  # loaders are matched by prepare order
        self.meta["loaders"] += 1
        if self.replay_from is not None:
            if self._replayed is None:
                self._replayed = self._read_batches()
            passes = self._replayed[index] if index < len(self._replayed) else []
            return ReplayLoader(loader, passes, index)
        if self.accel.config.dataset_shards_itself and isinstance(
            getattr(loader, "dataset", None), torch.utils.data.IterableDataset
        ):
            self._unverifiable(
                "the script prepares an IterableDataset with dataset_shards_itself=True: each rank "
                "reads a stream gradsync does not shard, so the ranks' batches cannot be lined up "
                "into one process's windows"
            )
        recording = RecordingLoader(loader)
        self.loaders.append(recording)
        return recording

    def _read_batches(self) -> list[list[list[dict[str, Any]]]]:
        assert self.replay_from is not None
        meta = read_meta(self.replay_from)
        world = int(meta.get("world", 1))
        first = [group[0] for group in meta.get("readers") or [[r] for r in range(world)]]
        per_rank = []
        for rank in first:  # one rank per data-parallel position
            path = self.replay_from / batches_file(rank)
            if not path.is_file():
                raise ReplayExhausted(
                    f"the launched run left no {path.name} (rank {rank} recorded nothing)"
                )
            per_rank.append(torch.load(path, weights_only=False)["loaders"])
        loaders = max((len(r) for r in per_rank), default=0)
        out: list[list[list[dict[str, Any]]]] = []
        for i in range(loaders):
            passes = min(len(r[i]) if i < len(r) else 0 for r in per_rank)
            out.append([[r[i][p] for r in per_rank] for p in range(passes)])
        return out

    def _write_batches(self) -> None:
        with contextlib.suppress(Exception):
            _save(
                {"loaders": [loader.passes for loader in self.loaders]},
                self.folder / batches_file(self.rank),
            )

    # -- the windows --------------------------------------------------------------
    def _before_window(self) -> None:
        if self.windows == 0:
            self._first()
        elif self.pending:
            self._snapshot()
        if self.meta["unverifiable"] is not None or self.snapshots >= self.steps:
            self._stop()
        # a loop that accumulates by itself (Transformers' Trainer) declares its window's k
        declared = getattr(self.accel, "declared_steps", None)
        self.meta["k"].append(int(declared or self.accel.gradient_accumulation_steps))
        self.meta["sync_policy"] = str(self.accel.sync_policy)
        self.windows += 1
        self._steps_at_start = self.prepared.steps_applied()
        self.pending = False

    def _at_boundary(self, step: Any) -> None:
        if self.prepared.steps_applied() > self._steps_at_start:  # stepped inside the block
            self._snapshot()
        else:  # the step follows the block (or was skipped): at the next window's start
            self.pending = True

    def _first(self) -> None:
        if not self.prepared.loaders:
            self._unverifiable(
                "the script prepared no dataloader: gradsync replays the batches of the loaders "
                "passed to accel.prepare; prepare the training DataLoader"
            )
            return
        if self.replay_from is not None and not self.prepared.optimizers:
            self._unverifiable(
                "one process has no optimizer: the script prepares none (an optimizer defined "
                "only in the DeepSpeed config has no single-process equivalent); build it in "
                "the script and pass it to accel.prepare"
            )
            return
        for model in self.prepared.models:
            self.meta["dropout"] += _quiet_dropout(self.accel.unwrap_model(model))
        names = []
        dtypes: set[str] = set()
        for model in self.prepared.trained:
            params = list(self.accel.unwrap_model(model).named_parameters())
            names.append([n for n, _ in params])
            dtypes.update(str(p.dtype).replace("torch.", "") for _, p in params)
        if self._pipelined():  # each rank names its own stage's: the whole model's, in order
            names = [
                list(dict.fromkeys(n for each in per_rank for n in each[i]))
                for per_rank in [dist.all_gather_object(names)]
                for i in range(len(names))
            ]
        self.meta["param_names"] = names
        self.meta["dtypes"] = sorted(dtypes)
        if self.replay_from is not None:
            self._load_initial()
            self._rng_start = _rng_states()
        self._snapshot()

    def _pipelined(self) -> bool:
        """Whether this launched run pipelines its models (each rank holds one stage)."""
        return (
            self.replay_from is None
            and getattr(self.accel.config, "pp_split", None) is not None
            and int(self.accel.world_size) > 1
        )

    def _load_initial(self) -> None:
        """The reference starts from the launched run's initial parameters (whatever the
        script's seeding)."""
        assert self.replay_from is not None
        path = self.replay_from / params_file(0)
        states = torch.load(path, weights_only=False)
        for model, state in zip(self.prepared.trained, states):
            module = self.accel.unwrap_model(model)
            with torch.no_grad():
                module.load_state_dict(state, strict=False)

    def _snapshot(self) -> None:
        step = self.snapshots + 1
        states = [self.accel.get_state_dict(model) for model in self.prepared.trained]  # collective
        if self._pipelined():  # each rank holds its stage's part: rank 0 writes the whole
            per_rank = dist.all_gather_object([_on_cpu(s) for s in states])
            states = [
                {k: v for part in per_rank for k, v in part[i].items()} for i in range(len(states))
            ]
        loss = None
        if step > 0:
            with contextlib.suppress(Exception):
                loss = float(self.accel.window_loss)
        if step > 0 and self._pipelined():  # the loss is the last stage's (NaN on the others)
            found = [v for v in dist.all_gather_object(loss) if v is not None and not math.isnan(v)]
            loss = found[0] if found else loss
        off = on = None
        audit = getattr(self.accel, "audit", None)
        if audit is not None and step > 0:
            records = audit.records[self._audit_seen :]
            self._audit_seen = len(audit.records)
            off = sum(r.reduction_bytes for r in records if not r.boundary)
            on = sum(r.reduction_bytes for r in records if r.boundary)
        self.snapshots = step
        self.pending = False
        if self.rank == 0:
            _save(
                [
                    {
                        k: v.detach().to("cpu", copy=True)
                        for k, v in s.items()
                        if isinstance(v, torch.Tensor)
                    }
                    for s in states
                ],
                self.folder / params_file(step),
            )
            if step > 0:
                self.meta["rows"].append(
                    {
                        "step": step,
                        "loss": None if loss is None or math.isnan(loss) else loss,
                        "off_boundary_bytes": off,
                        "boundary_bytes": on,
                        "optimizer_steps": self.prepared.steps_applied(),
                        "lr": self._learning_rates(),
                        "k": self.meta["k"][step - 1] if step - 1 < len(self.meta["k"]) else None,
                    }
                )
            if self._rng_start is not None:
                self.meta["rng_drawn"] = _advanced(self._rng_start, _rng_states())
            self._write_meta()

    def _learning_rates(self) -> list[float]:
        """Every prepared optimizer's parameter groups' learning rates, in order (what the
        schedulers set for the next step)."""
        return [
            float(group["lr"])
            for optimizer in self.prepared.optimizers
            for group in getattr(optimizer, "param_groups", [])
            if "lr" in group
        ]

    def _unverifiable(self, why: str) -> None:
        if self.meta["unverifiable"] is None:
            self.meta["unverifiable"] = why
            self._write_meta()

    def _stop(self) -> None:
        """Enough windows (or nothing to verify): record, end the Accelerator, exit 0."""
        self.meta["stopped"] = True
        self._write_meta()
        if self.replay_from is None:
            self._write_batches()
        self.accel.end()
        raise SystemExit(0)

    def _write_meta(self) -> None:
        if self.rank == 0:
            path = self.folder / META
            tmp = path.with_name(META + ".tmp")
            tmp.write_text(json.dumps(self.meta, indent=1))
            os.replace(tmp, path)


def attach(accel: Any, parts: Any, environ: Mapping[str, str] | None = None) -> Verifier | None:
    """The Verifier of an Accelerator built under ``gradsync verify``, hooked into it (the
    core calls this through ``GRADSYNC_EXTENSIONS``, which ``gradsync verify`` sets).

    Args:
        accel: the Accelerator being built (at the end of its ``__init__``).
        parts: its ``assembly.Parts`` (the runner, the preparer, the registry).
        environ: the variables (default: ``os.environ``).

    Returns:
        The Verifier, or None when ``GRADSYNC_VERIFY`` is not set.
    """
    env = os.environ if environ is None else environ
    folder = env.get(ENV_RECORD)
    if not folder:
        return None
    steps = int(env.get(ENV_STEPS, "3"))
    return Verifier(
        accel,
        parts.runner,
        parts.preparer,
        parts.prepared,
        folder,
        steps,
        env.get(ENV_REPLAY) or None,
        parts.backend.data_parallel,
        parts.rules,
    )
