"""Worker side: a Transformers GPT-2 trained one step on 2 ranks, then saved every way an
Accelerate script saves it; rank 0 loads each folder with ``from_pretrained`` and compares it
with the full parameters gathered from the run."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradsync import Accelerator
from gradsync.backends import _save_pretrained

#: Imported on first use by a scenario here (mp_worker.py's agent imports it once).
PRELOAD = ("transformers.models.gpt2.modeling_gpt2",)


def _tiny_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


def _compare(
    folder: Path, full: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]
) -> dict[str, Any]:
    from transformers import GPT2LMHeadModel

    loaded = GPT2LMHeadModel.from_pretrained(str(folder)).state_dict()
    return {
        "files": sorted(p.name for p in folder.iterdir()),
        "missing": sorted(set(full) - set(loaded)),
        "differ": sorted(k for k in full if k in loaded and not torch.equal(loaded[k], full[k])),
        "trained": not torch.equal(
            loaded["transformer.h.0.mlp.c_fc.weight"], initial["transformer.h.0.mlp.c_fc.weight"]
        ),
    }


def pretrained_saves(*, backend: str) -> dict[str, Any]:
    """One optimizer step, then on every rank ``unwrap_model(model).save_pretrained(dir,
    is_main_process=..., save_function=accel.save)`` without a state dict, with
    ``accel.get_state_dict(model)``, with the model's own (sharded) state dict, and
    ``accel.save_model``; then the same ``save_pretrained`` on rank 0 alone."""
    accel = Accelerator(backend=backend, seed=0)
    box = [tempfile.mkdtemp(prefix="gradsync-scn-") if accel.is_main_process else None]
    dist.broadcast_object_list(box, src=0)
    root = Path(str(box[0]))
    model = _tiny_gpt2()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accel.prepare(model, opt)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(accel.process_index))
    accel.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    opt.zero_grad()
    full = {k: v.clone() for k, v in accel.get_state_dict(model).items()}

    def pretrained(**kwargs: Any) -> Callable[[Path], Any]:
        return lambda folder: accel.unwrap_model(model).save_pretrained(
            folder, is_main_process=accel.is_main_process, save_function=accel.save, **kwargs
        )

    spellings: dict[str, Callable[[Path], Any]] = {
        "plain": pretrained(),
        "get_state_dict": lambda folder: pretrained(state_dict=accel.get_state_dict(model))(folder),
        "own_state_dict": lambda folder: pretrained(
            state_dict=accel.unwrap_model(model).state_dict()
        )(folder),
        "save_model": lambda folder: accel.save_model(model, folder),
    }
    out: dict[str, Any] = {}
    for name, save in spellings.items():
        try:
            save(root / name)
            error = None
        except Exception as err:  # recorded: the parent asserts there was none
            error = f"{type(err).__name__}: {err}"
        accel.wait_for_everyone()
        out[name] = {"error": error}
        if accel.is_main_process and error is None:
            out[name].update(_compare(root / name, full, initial))
    _save_pretrained.ARRIVAL_TIMEOUT_S = 2.0  # rank 0 alone: give up on the other rank quickly
    if accel.is_main_process:
        started = time.monotonic()
        try:
            accel.unwrap_model(model).save_pretrained(root / "main_only")
            out["main_only"] = {"error": None, **_compare(root / "main_only", full, initial)}
        except Exception as err:
            out["main_only"] = {"error": f"{type(err).__name__}: {err}"}
        out["main_only"]["seconds"] = time.monotonic() - started
    accel.wait_for_everyone()
    if accel.is_main_process:
        shutil.rmtree(root)
    accel.end_training()
    return out
