"""Pipeline parallelism (``parallelism={"pp": 2, ...}``) composed with accumulation, run by
mp_worker.py in one audited gloo group (2 ranks: pp 2; 4 ranks: pp 2 x dp_shard 2)."""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from gradsync import Accelerator, ConfigError

from scenarios.common import FEATURES, Dropped, Indexed, to_lists
from scenarios.tp import Warnings

#: Where the second stage begins: Linear-Tanh-Linear-Tanh | Linear-Tanh-Linear.
SPLIT = ["4"]
#: Every Linear split over tp, a colwise-rowwise pair in each stage (the activations sent
#: between the stages are whole).
TP_PLAN = {"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise"}
WIDTH = 16


def make_seq(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, 1),
    )


def positive_targets(batch: Any) -> int:
    """The items of a batch: its samples with a positive target (a stand-in for tokens)."""
    return int((batch[1] > 0).sum())


def masked_sse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The summed squared error over the samples with a positive target."""
    return ((out - y).pow(2) * (y > 0)).sum()


def by_slices(model: nn.Sequential, stages: int) -> list[nn.Module]:
    """A callable split: four ``nn.Sequential`` slices of ``make_seq``'s model, cut at 2, 4, 6."""
    assert stages == 4, stages
    return [model[0:2], model[2:4], model[4:6], model[6:]]


def fresh_halves(model: nn.Sequential, stages: int) -> list[nn.Module]:
    """A callable split: two fresh ``nn.Sequential`` of ``make_seq``'s modules, cut at 4, each
    numbering its modules from 0 (gradsync names the stages' tensors as the whole model)."""
    assert stages == 2, stages
    return [nn.Sequential(*model[:4]), nn.Sequential(*model[4:])]


#: The callable splits a scenario names by a word.
CALLABLES = {"slices": by_slices, "fresh": fresh_halves}


def _accel(dims: dict[str, int], steps: int, policy: str, **options: Any) -> Accelerator:
    """An Accelerator for ``dims`` (with a pipeline: cut at ``SPLIT`` unless ``split`` says
    otherwise, a word of ``CALLABLES`` naming a callable); no dims: the same loop without a
    pipeline."""
    backend = options.pop("backend", "fsdp")
    if dims:
        split = options.pop("split", SPLIT)
        split = CALLABLES.get(split, split) if isinstance(split, str) else split
        options = {"parallelism": dims, "pp_split": split, **options}
    return Accelerator(
        backend=backend,
        gradient_accumulation_steps=steps,
        sync_policy=policy,
        seed=0,
        audit=True,
        **options,
    )


def train_pp(
    *,
    dims: dict[str, int],
    steps: int,
    policy: str,
    schedule: str,
    microbatches: int,
    samples: int,
    micro_batch: int,
    clip: float | None = None,
    budget: int | None = None,
    tokens: bool = False,
    tp_plan: dict[str, str] | None = None,
    raise_at: tuple[int, int] | None = None,
    backend: str = "fsdp",
    split: list[str] | str | None = None,
    per_rank: int = 1,
    comm_hook: str | None = None,
    comm_state_option: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The loop a user writes: one pipeline_step per micro-step inside accumulate (with
    ``tokens``, a summed loss over the window's counted items; ``split`` a word: the callable
    of ``CALLABLES``)."""
    options: dict[str, Any] = {"backend": backend}
    if dims:
        options.update(pp_schedule=schedule, pp_microbatches=microbatches)
        if per_rank > 1:
            options.update(pp_stages_per_rank=per_rank)
        if split is not None:
            options.update(split=split)
    if budget is not None:
        options["sync_memory_budget"] = budget
    if comm_hook is not None:
        options.update(comm_hook=comm_hook, comm_state_option=comm_state_option)
    if tokens:
        options["count_items"] = positive_targets
    if tp_plan:
        options["tp_plan"] = tp_plan
    accel = _accel(dims, steps, policy, **options)
    loss_fn, reduction = (masked_sse, "sum") if tokens else (F.mse_loss, "mean")
    model = make_seq()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(Indexed(samples), batch_size=micro_batch)
    model, opt, loader = accel.prepare(model, opt, loader)
    warnings = Warnings()  # the self-check's among them
    logging.getLogger("gradsync").addHandler(warnings)
    windows: list[list[list[int]]] = []
    current: list[list[int]] = []
    losses: list[float | None] = []
    norms: list[float] = []
    dropped: list[list[list[int]]] = []
    window_losses: list[float] = []
    for x, y, idx in loader:
        try:
            with accel.accumulate(model):
                loss = accel.pipeline_step(model, x, y, loss_fn, reduction)
                losses.append(None if loss is None else float(loss))
                current.append(idx.tolist())
                if raise_at == (len(windows), len(current) - 1):
                    raise Dropped  # on every rank: the window is dropped
                if clip is not None and accel.sync_gradients:
                    norms.append(float(accel.clip_grad_norm_(model.parameters(), clip)))
                opt.step()
                opt.zero_grad()
        except Dropped:
            opt.step()  # a stray step after the error must apply nothing
            dropped.append(current)
            current = []
            continue
        if accel.sync_gradients:
            windows.append(current)
            window_losses.append(accel.window_loss)
            current = []
    logging.getLogger("gradsync").removeHandler(warnings)
    backend = accel._backend  # type: ignore[attr-defined]
    mesh = accel.mesh
    assert accel.audit is not None
    return {
        "windows": windows,
        "dropped": dropped,
        "window_losses": window_losses,
        "losses": losses,
        "norms": norms,
        "optimizer_steps": accel.optimizer_steps,
        "state": to_lists(accel.get_state_dict(model)),  # the whole model's, on every rank
        "held": sorted(accel.unwrap_model(model).state_dict()),  # this rank's stage's names
        "stage": mesh.get_local_rank("pp") if dims else 0,
        "data_rank": backend.data_parallel.rank,
        "data_size": backend.data_parallel.size,
        "policy": accel.sync_policy,
        "audit": [r.to_dict() for r in accel.audit.records],
        "summaries": [accel.audit.summary(w) for w in accel.audit.windows()],
        "opt_params": sum(len(g["params"]) for g in opt.param_groups),
        "warnings": warnings.lines,
    }


def misuse() -> dict[str, Any]:
    """A plain forward on a stage, and pipeline_step outside accumulate: one line each."""
    accel = _accel({"pp": 2}, 2, "defer", pp_microbatches=2)
    model = accel.prepare(make_seq())
    out: dict[str, Any] = {}
    try:
        model(torch.zeros(4, FEATURES))
    except Exception as e:
        out["forward"] = f"{type(e).__name__}: {e}"
    try:
        accel.pipeline_step(model, torch.zeros(4, FEATURES), torch.zeros(4, 1), F.mse_loss)
    except Exception as e:
        out["outside"] = f"{type(e).__name__}: {e}"
    with accel.accumulate(model):
        try:
            accel.pipeline_step(model, torch.zeros(3, FEATURES), torch.zeros(3, 1), F.mse_loss)
        except Exception as e:
            out["indivisible"] = f"{type(e).__name__}: {e}"
    return out


def refused(**options: Any) -> dict[str, Any]:
    """What prepare (or the Accelerator) says to a bad pipeline setting: one ConfigError line,
    before any collective."""
    dims = options.pop("dims", {"pp": 2})
    micro_batch = options.pop("micro_batch", 4)
    bare_tail = options.pop("bare_tail", False)
    try:
        accel = _accel(dims, 2, "defer", **options)
        model = nn.Sequential(nn.Linear(FEATURES, 1), nn.Tanh()) if bare_tail else make_seq()
        accel.prepare(model, DataLoader(Indexed(16), batch_size=micro_batch))
    except ConfigError as e:
        return {"error": str(e)}
    return {"error": None}


# -- checkpoints ----------------------------------------------------------------------------
def _prepared(
    dims: dict[str, int] | None, policy: str, per_rank: int = 1, **options: Any
) -> tuple[Accelerator, Any, Any]:
    """The model and its optimizer prepared: ``dims`` None: the whole model in one process
    (``backend``: "fsdp" unless ``options`` say otherwise); ``dims`` without "pp": FSDP2
    without a pipeline; else a pipeline (with ``per_rank`` 2: the stages cut at 2, 4, 6, two
    on each rank). ``extra``: the model with one more layer (another model's names)."""
    extra = options.pop("extra", False)
    if dims is None or "pp" not in dims:
        options.setdefault("backend", "fsdp")
        if dims:
            options["parallelism"] = dims
        accel = Accelerator(gradient_accumulation_steps=4, seed=0, **options)
    elif per_rank > 1:
        options = {"pp_schedule": "Interleaved1F1B", "pp_stages_per_rank": per_rank}
        accel = _accel(dims, 4, policy, pp_microbatches=2, split=["2", "4", "6"], **options)
    else:
        accel = _accel(dims, 4, policy, pp_microbatches=2, **options)
    raw = make_seq()
    if extra:
        raw.append(nn.Linear(1, 1))
    model, opt = accel.prepare(raw, torch.optim.SGD(raw.parameters(), lr=0.05, momentum=0.9))
    return accel, model, opt


def _batches(accel: Accelerator, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` micro-batches of 4 for this rank's data-parallel position (each its own)."""
    data = accel._backend.data_parallel  # type: ignore[attr-defined]
    x, y = _data(n, data.size)
    return [(x[i, data.rank], y[i, data.rank]) for i in range(n)]


def _data(n: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, size, 4, FEATURES, generator=g)
    return x, torch.randn(n, size, 4, 1, generator=g)


def _step(accel: Accelerator, model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    with accel.accumulate(model):
        accel.pipeline_step(model, x, y, F.mse_loss)
        opt.step()
        opt.zero_grad()


def resume_mid_window(
    *,
    dims: dict[str, int],
    policy: str,
    folder: str,
    per_rank: int = 1,
    backend: str = "fsdp",
    windows: int = 2,
    **options: Any,
) -> dict[str, Any]:
    """``windows`` windows of 4, the last saved after 2 micro-steps, finished in the same run
    and in a fresh one that loads the checkpoint: both end with the same parameters
    (bitwise). ``options``: more of the Accelerator's (a ``comm_hook``)."""
    accel, model, opt = _prepared(dims, policy, per_rank, backend=backend, **options)
    data = _batches(accel, 4 * windows)
    cut = 4 * windows - 2
    for x, y in data[:cut]:
        _step(accel, model, opt, x, y)
    accel.save_state(folder)
    for x, y in data[cut:]:
        _step(accel, model, opt, x, y)
    seen: dict[str, Any] = {"went_on": to_lists(accel.get_state_dict(model))}
    accel2, model2, opt2 = _prepared(dims, policy, per_rank, backend=backend, **options)
    accel2.load_state(folder)
    for x, y in data[cut:]:
        _step(accel2, model2, opt2, x, y)
    seen["resumed"] = to_lists(accel2.get_state_dict(model2))
    seen["steps"] = [accel.optimizer_steps, accel2.optimizer_steps]
    return seen


def save_at_boundary(
    *, dims: dict[str, int] | None, folder: str, per_rank: int = 1, **options: Any
) -> dict[str, Any]:
    """Two windows, saved at the boundary (each rank its part), then two more; ``dims`` None
    or without "pp": the model without a pipeline (``_prepared``)."""
    accel, model, opt = _prepared(dims, "defer", per_rank, **options)
    data = _batches(accel, 16)
    for x, y in data[:8]:
        _step(accel, model, opt, x, y)
    accel.save_state(folder)
    for x, y in data[8:]:
        _step(accel, model, opt, x, y)
    return {"state": to_lists(accel.get_state_dict(model)), "steps": accel.optimizer_steps}


def save_model(*, dims: dict[str, int], folder: str, backend: str) -> dict[str, Any]:
    """Two windows on a pipeline, then ``save_model`` on every rank (``pytorch_model.bin``):
    rank 0 writes the whole model, gathered from the stages (each over its data ranks)."""
    accel, model, opt = _prepared(dims, "defer", backend=backend)
    for x, y in _batches(accel, 8):
        _step(accel, model, opt, x, y)
    accel.save_model(model, folder, safe_serialization=False)
    return {
        "state": to_lists(accel.get_state_dict(model)),
        "held": sorted(accel.unwrap_model(model).state_dict()),
    }


def accelerate_layout(*, folder: str, backend: str) -> dict[str, Any]:
    """``gradsync.accelerate``'s save_state on a pipeline: Accelerate has no pipeline to
    resume, so only gradsync's checkpoint is written, with a warning saying why; a fresh
    pipeline's load_state reads it back."""
    from gradsync.accelerate import Accelerator as Shim

    def prepared() -> tuple[Any, Any, Any]:
        accel = Shim(
            backend=backend,
            gradient_accumulation_steps=2,
            parallelism={"pp": 2},
            pp_split=SPLIT,
            pp_microbatches=2,
            seed=0,
        )
        raw = make_seq()
        return accel, *accel.prepare(raw, torch.optim.SGD(raw.parameters(), lr=0.05))

    accel, model, opt = prepared()
    for x, y in _batches(accel, 4):
        _step(accel, model, opt, x, y)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        accel.save_state(folder)
    fresh, model2, _ = prepared()
    fresh.load_state(folder)
    return {
        "warnings": [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)],
        "files": sorted(p.name for p in Path(folder).iterdir()),
        "same": to_lists(accel.get_state_dict(model)) == to_lists(fresh.get_state_dict(model2)),
    }


def refused_mid_other_split(*, folder: str) -> dict[str, Any]:
    """pp 4 over ``make_seq`` with a fifth Linear, saved mid-window cut at 2, 4, 6 and loaded
    cut at 2, 4, 7: stages 0 and 1 hold the same parameters as when saved, stages 2 and 3
    others. Every rank refuses (none goes on alone to the collective read, which would hang)."""
    from gradsync import CheckpointError

    def prepared(split: list[str]) -> tuple[Accelerator, Any, Any]:
        accel = _accel({"pp": 4}, 4, "defer", pp_microbatches=4, split=split)
        raw = make_seq()
        raw.append(nn.Linear(1, 1))
        return accel, *accel.prepare(raw, torch.optim.SGD(raw.parameters(), lr=0.05))

    accel, model, opt = prepared(["2", "4", "6"])
    for x, y in _batches(accel, 2):
        _step(accel, model, opt, x, y)
    accel.save_state(folder)
    fresh, _, _ = prepared(["2", "4", "7"])
    try:
        fresh.load_state(folder)
    except CheckpointError as err:
        return {"error": str(err)}
    return {"error": None}


def save_mid_window(*, folder: str, **options: Any) -> dict[str, Any]:
    """The model without a pipeline (``_prepared`` with no dims: ``backend`` in ``options``),
    saved after 6 micro-steps, inside its second window of 4."""
    accel, model, opt = _prepared(None, "defer", **options)
    for x, y in _batches(accel, 6):
        _step(accel, model, opt, x, y)
    accel.save_state(folder)
    return {"steps": accel.optimizer_steps}


def load_whole(*, folder: str, data_size: int, backend: str = "fsdp") -> dict[str, Any]:
    """That checkpoint loaded into the whole model in one process (parameters and the
    optimizer's momentum), which then trains the same two windows on the global batches."""
    accel, model, opt = _prepared(None, "defer", backend=backend)
    accel.load_state(folder)
    x, y = _data(16, data_size)
    for i in range(8, 16):
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(x[i].flatten(0, 1)), y[i].flatten(0, 1)))
            opt.step()
            opt.zero_grad()
    return {"state": to_lists(accel.get_state_dict(model)), "steps": accel.optimizer_steps}


def load_pipeline(*, dims: dict[str, int], folder: str, **options: Any) -> dict[str, Any]:
    """A checkpoint saved without pp loaded into a pipeline (each stage its part, momentum
    included), which then trains two windows, each data rank on its own batches."""
    accel, model, opt = _prepared(dims, "defer", **options)
    accel.load_state(folder)
    for x, y in _batches(accel, 16)[8:]:
        _step(accel, model, opt, x, y)
    return {"state": to_lists(accel.get_state_dict(model)), "steps": accel.optimizer_steps}


def refused_loads(*, dims: dict[str, int], folders: list[str], **options: Any) -> dict[str, Any]:
    """What load_state says to checkpoints that do not fit (``dims``: a pipeline's, or
    without pp): one line each."""
    accel, _, _ = _prepared(dims, "defer", **options)
    out = {}
    for folder in folders:
        try:
            accel.load_state(folder)
        except Exception as e:
            out[folder] = f"{type(e).__name__}: {e}"
        else:
            out[folder] = None
    return out


def world_label() -> dict[str, Any]:
    """The world group's audit label, after pipelines spanning the world ran in this group."""
    import torch.distributed as dist

    group = dist.distributed_c10d._get_default_group()
    return {"label": group.label() if hasattr(group, "label") else None}


def _reduces_too(stage: Any, scale: int) -> None:
    """A stage hook that reduces on every schedule step before gradsync's end of backward."""
    from torch.distributed.pipelining import PipelineStage

    PipelineStage.perform_reduce_grad(stage, scale)
    stage._end_backward()


def canary(
    *,
    broken: str = "",
    dims: dict[str, int] | None = None,
    policy: str = "defer",
    per_rank: int = 1,
) -> dict[str, Any]:
    """On a torch taken as newer than the tested range, a pipeline's first window (k = 4) is
    checked schedule step by schedule step. ``broken="renamed"``: the stage's end of
    backward is torch's own again, as on a torch that renamed the method gradsync replaces;
    ``"reduces"``: torch's reduction runs before gradsync's end of backward. The first
    schedule step is then refused. The range and the method are put back afterwards (the
    group's processes run further scenarios)."""
    from torch.distributed.pipelining import PipelineStage

    from gradsync._support import torch_range
    from gradsync.backends import _pipeline, _pipeline_compat

    saved = torch_range.NEWEST, _pipeline_compat.Stage.perform_reduce_grad
    torch_range.NEWEST = "2.0"
    if broken:
        hook = PipelineStage.perform_reduce_grad if broken == "renamed" else _reduces_too
        _pipeline_compat.Stage.perform_reduce_grad = hook  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the untested torch's warning at prepare
            accel, model, opt = _prepared(dims or {"pp": 2}, policy, per_rank)
        errors: list[str] = []
        for x, y in _batches(accel, 6):
            with accel.accumulate(model):
                try:
                    accel.pipeline_step(model, x, y, F.mse_loss)
                except RuntimeError as e:
                    errors.append(str(e))
                    break
                opt.step()
                opt.zero_grad()
        return {"errors": errors, "checked": not _pipeline.of(model).canary.active}
    finally:
        torch_range.NEWEST, _pipeline_compat.Stage.perform_reduce_grad = saved  # type: ignore[method-assign]


def buffers(*, dims: dict[str, int], backend: str) -> dict[str, Any]:
    """A pipeline whose stages hold batch norms, the data ranks reading different batches
    (windows of 2): each stage's batch-norm running statistics after the first schedule
    step ("got") and one process's after the same two parts of that micro-batch ("want"), and
    the running mean each stage's batch norm holds as each schedule step's forward begins (on
    DDP the buffers are broadcast from the data group's first rank at the first forward after
    a synchronised one: the first of each window under defer)."""
    import copy

    from gradsync.backends import _pipeline

    accel = _accel(dims, 2, "defer", backend=backend, pp_microbatches=2, split=["3"])
    torch.manual_seed(0)
    raw = nn.Sequential(
        nn.Linear(FEATURES, WIDTH),
        nn.BatchNorm1d(WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        nn.BatchNorm1d(WIDTH),
        nn.Linear(WIDTH, 1),
    )
    alone = copy.deepcopy(raw)
    model, opt = accel.prepare(raw, torch.optim.SGD(raw.parameters(), lr=0.05))
    stage = _pipeline.of(model).index
    norm = next(m for m in model.modules() if isinstance(m, nn.BatchNorm1d))
    seen: list[list[float]] = []
    steps: list[int] = []
    norm.register_forward_pre_hook(lambda m, args: seen.append(m.running_mean.tolist()))
    got: list[list[float]] = []
    batches = _batches(accel, 4)
    for x, y in batches:
        steps.append(len(seen))  # the first forward of this schedule step
        _step(accel, model, opt, x, y)
        if not got:
            got = [norm.running_mean.tolist(), norm.running_var.tolist()]
    with torch.no_grad():  # one process: the first micro-batch's two parts, in order
        for part in batches[0][0].chunk(2):
            alone(part)
    want = alone[1 if stage == 0 else 4]
    data = accel._backend.data_parallel  # type: ignore[attr-defined]
    return {
        "stage": stage,
        "data_rank": data.rank,
        "at_step": [seen[i] for i in steps],
        "got": got,
        "want": [want.running_mean.tolist(), want.running_var.tolist()],
    }


def tampered_load(*, dims: dict[str, int], folder: str, backend: str) -> dict[str, Any]:
    """A pipeline's boundary checkpoint whose DCP metadata (``dcp_0/.metadata``, a pickle)
    rank 0 rewrote with a payload: a fresh pipeline's load refuses it in one line naming the
    file, and the payload never runs."""
    from gradsync import CheckpointError
    from payload import tamper_pickle_file

    root = Path(folder)
    accel, model, opt = _prepared(dims, "defer", backend=backend)
    for x, y in _batches(accel, 4):
        _step(accel, model, opt, x, y)
    saved = Path(accel.save_state(root / "saved"))
    copy, marker = root / "tampered", root / "ran"
    if dist.get_rank() == 0:
        shutil.copytree(saved, copy)
        tamper_pickle_file(copy, "dcp_0/.metadata", marker)
    dist.barrier()
    fresh, _, _ = _prepared(dims, "defer", backend=backend)
    error = ""
    try:
        fresh.load_state(copy)
    except CheckpointError as err:
        error = str(err)
    dist.barrier()
    return {"error": error, "ran": marker.exists()}
