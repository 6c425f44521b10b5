"""Cross-rank helpers on 2 real ranks (one audited gloo group): reduce, gather_object,
gather_for_metrics of objects over a prepared evaluation loader, split_between_processes,
the on_*_process decorators, goes_first; and the same calls through Accelerate's own
PartialState where Accelerate has them, for the parent to compare."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from gradsync import Accelerator, ConfigError, metrics, processes
from gradsync._support import dist
from gradsync.processes import split_between_processes

EVAL_SAMPLES = 45  # odd: the sampler pads one sample in on 2 ranks
BATCH = 4


def _error(call: Any) -> str:
    try:
        call()
    except ConfigError as err:
        return f"ConfigError: {err}"
    return "no error"


def _plain(value: Any) -> Any:
    """JSON for the parent: tensors as {"dtype", "values"}."""
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype).removeprefix("torch."), "values": value.tolist()}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def reductions() -> dict[str, Any]:
    """metrics.reduce with every reduction, scale and the op alias: rank r holds
    [r + 1, 10 - r] (floats and ints)."""
    rank = dist.rank()
    f = torch.tensor([rank + 1.0, 10.0 - rank])
    i = torch.tensor([rank + 1, 10 - rank])
    out: dict[str, Any] = {}
    for reduction in metrics.REDUCTIONS:
        out[reduction] = _plain(metrics.reduce(f, reduction))
        out[f"{reduction}_int"] = _plain(metrics.reduce(i, reduction))
        out[f"{reduction}_scaled"] = _plain(metrics.reduce(f, reduction, scale=0.5))
        out[f"{reduction}_op"] = _plain(metrics.reduce(f, op=reduction))
    out["nested"] = _plain(metrics.reduce({"a": f, "b": [i, (f * 2,)]}, "max"))
    out["unknown"] = _error(lambda: metrics.reduce(f, "median"))
    out["disagree"] = _error(lambda: metrics.reduce(f, "mean", op="sum"))
    return out


def objects() -> dict[str, Any]:
    """metrics.gather_object of lists (of different lengths), tuples and other objects."""
    rank = dist.rank()
    return {
        "list": metrics.gather_object([f"r{rank}-{k}" for k in range(rank + 1)]),
        "tuple": metrics.gather_object((rank, f"r{rank}")),
        "empty_on_rank_0": metrics.gather_object([] if rank == 0 else ["x"]),
        "str": metrics.gather_object(f"rank{rank}"),
        "dict": metrics.gather_object({"rank": rank, "ids": [rank] * 2}),
        "int": metrics.gather_object(rank * 7),
    }


class Samples(torch.utils.data.Dataset[dict[str, Any]]):
    """Evaluation samples: an id and a text per sample."""

    def __len__(self) -> int:
        return EVAL_SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": i, "text": f"sample-{i}"}


def _for_metrics(accel: Accelerator, data: Any, use_gather_object: bool = False) -> Any:
    """Through the Accelerator, as a user calls it."""
    return accel.gather_for_metrics(data, use_gather_object=use_gather_object)


def evaluation(shuffle: bool) -> dict[str, Any]:
    """gather_for_metrics over a prepared loader of 45 samples (batches of 4): the ids
    through the tensor path, the texts as objects (chosen for strings, and forced), one
    tensor per sample forced through gather_object, and plain gather_object for contrast."""
    accel = Accelerator(backend="ddp", seed=0)
    loader = accel.prepare(DataLoader(Samples(), batch_size=BATCH, shuffle=shuffle))
    out: dict[str, list[Any]] = {
        k: []
        for k in (
            "ids",
            "ids_through_accel",
            "texts",
            "texts_forced",
            "rows_forced",
            "plain_objects",
            "per_batch_lists",
        )
    }
    for batch in loader:
        out["ids"] += _for_metrics(accel, batch["id"]).tolist()
        out["ids_through_accel"] += accel.gather_for_metrics(batch["id"]).tolist()
        out["texts"] += _for_metrics(accel, batch["text"])
        out["texts_forced"] += _for_metrics(accel, batch["text"], use_gather_object=True)
        rows = _for_metrics(accel, list(batch["id"].unsqueeze(1)), use_gather_object=True)
        out["rows_forced"] += [row.tolist() for row in rows]
        out["plain_objects"] += metrics.gather_object(batch["text"])
        out["per_batch_lists"].append(_for_metrics(accel, {"texts": batch["text"]}))
    # a list that is not one entry per sample (longer than the batch) is concatenated
    out["not_per_sample"] = _for_metrics(accel, [f"r{accel.rank}"] * (BATCH + 1))
    return out


def splits() -> dict[str, Any]:
    """split_between_processes with the ranks from gradsync._support.dist: lists, tuples, dicts and
    tensors of 1 to 5 entries, with and without padding."""
    out: dict[str, Any] = {}
    for n in range(1, 6):
        for pad in (False, True):
            key = f"{n}_{'pad' if pad else 'plain'}"
            with split_between_processes([f"p{k}" for k in range(n)], apply_padding=pad) as part:
                out[f"list_{key}"] = part
            with split_between_processes(tuple(range(n)), apply_padding=pad) as part:
                out[f"tuple_{key}"] = list(part)
            data = {"text": [f"p{k}" for k in range(n)], "id": torch.arange(n) * 10}
            with split_between_processes(data, apply_padding=pad) as part:
                out[f"dict_{key}"] = _plain(part)
            with split_between_processes(
                torch.arange(2 * n).reshape(n, 2).float(), apply_padding=pad
            ) as part:
                out[f"tensor_{key}"] = _plain(part)
    out["bad"] = _error(_split_a_string)
    return out


def _split_a_string() -> None:
    with split_between_processes("text"):
        pass


def decorators() -> dict[str, Any]:
    """Each decorator, with an Accelerator as the rank facts and with gradsync._support.dist's, and
    goes_first: rank 0 writes a file inside the block after a pause; rank 1 must see it on
    entering."""
    accel = Accelerator(backend="ddp", seed=0)
    ran: dict[str, Any] = {}
    for facts in ("accel", "dist"):
        ranks = accel if facts == "accel" else None

        def record(name: str, facts: str = facts) -> str:
            ran[f"{facts}_{name}"] = accel.rank
            return name

        results = {
            "main": processes.on_main_process(lambda: record("main"), ranks=ranks)(),
            "local_main": processes.on_local_main_process(
                lambda: record("local_main"), ranks=ranks
            )(),
            "last": processes.on_last_process(lambda: record("last"), ranks=ranks)(),
            "process_0": processes.on_process(process_index=0, ranks=ranks)(
                lambda: record("process_0")
            )(),
            "process_1": processes.on_process(process_index=1, ranks=ranks)(
                lambda: record("process_1")
            )(),
            "local_1": processes.on_local_process(local_process_index=1, ranks=ranks)(
                lambda: record("local_1")
            )(),
        }
        ran[f"{facts}_returned"] = results
    out_of_range = processes.on_process(process_index=2, ranks=accel)(lambda: record("never"))
    ran["out_of_range"] = _error(out_of_range)

    marker = Path(shared_folder()) / "first-done"
    with processes.goes_first(accel.is_local_main_process):
        if accel.is_local_main_process:
            time.sleep(0.5)
            marker.write_text(str(accel.rank))
        else:
            ran["saw_first"] = marker.exists()
    with processes.goes_first(accel.is_main_process, accel.wait_for_everyone):
        pass
    return ran


def accelerate_reference() -> dict[str, Any]:
    """The same inputs through Accelerate's PartialState and accelerate.utils (its reduce,
    gather_object and split_between_processes) on this group."""
    from accelerate import PartialState
    from accelerate.utils import gather_object, reduce

    state = PartialState(cpu=True)  # gloo on CPU: Accelerate's MULTI_CPU
    rank = state.process_index
    f = torch.tensor([rank + 1.0, 10.0 - rank])
    out: dict[str, Any] = {"process_index": rank, "num_processes": state.num_processes}
    for reduction in ("sum", "mean", "max"):
        out[reduction] = _plain(reduce(f, reduction))
        out[f"{reduction}_ours"] = _plain(metrics.reduce(f, reduction))
    out["list"] = gather_object([f"r{rank}-{k}" for k in range(rank + 1)])
    out["list_ours"] = metrics.gather_object([f"r{rank}-{k}" for k in range(rank + 1)])
    pairs = []
    for n in range(1, 6):
        for pad in (False, True):
            inputs = {
                "list": lambda n=n: [f"p{k}" for k in range(n)],
                "dict": lambda n=n: {
                    "text": [f"p{k}" for k in range(n)],
                    "id": torch.arange(n) * 10,
                },
                "tensor": lambda n=n: torch.arange(2 * n).reshape(n, 2).float(),
            }
            for kind, make in inputs.items():
                with state.split_between_processes(make(), apply_padding=pad) as theirs:
                    theirs = _plain(theirs)
                with split_between_processes(make(), apply_padding=pad) as ours:
                    ours = _plain(ours)
                pairs.append({"case": f"{kind}_{n}_{pad}", "theirs": theirs, "ours": ours})
    out["splits"] = pairs
    return out


def shared_folder() -> str:
    """A folder on rank 0's disk, its name sent to every rank (one machine here)."""
    import tempfile

    return str(
        dist.broadcast_object(
            tempfile.mkdtemp(prefix="gradsync-first-") if dist.rank() == 0 else None
        )
    )
