"""``to_accelerate``: a checkpoint of gradsync's own format as a folder Accelerate's
``load_state`` resumes, written in one process, without the training script.

``gradsync.Accelerator`` writes gradsync's format only; ``gradsync.accelerate.Accelerator``
writes Accelerate's files beside it (see ``_layout``). This turns a folder of the first kind
into Accelerate's layout. The other way needs no conversion: ``gradsync.accelerate``'s
``load_state`` reads Accelerate's folder, and its next ``save_state`` holds gradsync's
format too.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from gradsync.accelerate._layout import numbered
from gradsync.errors import CheckpointError
from gradsync.storage.folder import load_file, read_manifest, save_file
from gradsync.storage.safety import allow_list


def _numpy_state(saved: list[Any] | None) -> tuple[Any, ...]:
    import numpy as np

    if saved is None:  # numpy was not in use where it was saved: any state will do
        return tuple(np.random.RandomState(0).get_state())
    name, key, pos, has_gauss, cached = saved
    return (name, key.numpy().astype(np.uint32), pos, has_gauss, cached)


def to_accelerate(
    checkpoint: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    trusted: bool = False,
) -> str:
    """Write the folder ``output_dir`` in Accelerate's layout from a gradsync checkpoint
    saved on one process or on DDP (``model.safetensors``, ``optimizer.bin``,
    ``scheduler.bin``, ``custom_checkpoint_N.pkl``, ``random_states_N.pkl``). Call it in
    one process (no process group needed). Accelerate's layout keeps no loader position:
    resume it with Accelerate's ``load_state`` and ``skip_first_batches``; a window left
    open when it was saved loses its gradients there, as under Accelerate.

    Args:
        checkpoint: a folder ``save_state`` wrote (verified and scanned first).
        output_dir: the folder to write (created; it must not exist yet).
        trusted: skip the scan of the checkpoint's pickles (only for a folder you trust).

    Returns:
        ``output_dir``.

    Raises:
        CheckpointError: a folder that is no intact gradsync checkpoint, one of a sharded
            backend's format, or ``output_dir`` already there (one line each).
    """
    source, target = Path(checkpoint), Path(output_dir)
    manifest = read_manifest(source, None if trusted else allow_list().__contains__)
    if manifest.get("format") != "plain":
        raise CheckpointError(
            f"checkpoint {str(source)!r} was saved with backend={manifest.get('backend')!r}; "
            "to_accelerate converts checkpoints saved on one process or on DDP (on FSDP2, "
            "gradsync.accelerate.Accelerator's save_state writes Accelerate's layout itself)"
        )
    if target.exists():
        raise CheckpointError(f"to_accelerate(): {str(target)!r} exists; name a new folder")
    from safetensors.torch import save_file as save_safetensors

    from gradsync.accelerate._layout import _unshared

    target.mkdir(parents=True)
    for i in range(int(manifest["models"])):
        state = load_file(source / f"model_{i}.pt", trusted=trusted)
        out = str(target / numbered("model", i, ".safetensors"))
        save_safetensors(_unshared(state), out, metadata={"format": "pt"})
    for j in range(len(manifest["steps_applied"])):
        shutil.copyfile(source / f"optimizer_{j}.pt", target / numbered("optimizer", j, ".bin"))
    for i, state in enumerate(load_file(source / "schedulers.pt", trusted=trusted)):
        save_file(state, target / numbered("scheduler", i, ".bin"))
    for i, state in enumerate(load_file(source / "objects.pt", trusted=trusted)):
        save_file(state, target / f"custom_checkpoint_{i}.pkl")
    if (source / "scaler.pt").is_file():
        shutil.copyfile(source / "scaler.pt", target / "scaler.pt")
    step = int(manifest["window"]["index"])
    for rank in range(int(manifest["world_size"])):
        rng = load_file(source / f"rng_rank{rank}.pt", trusted=trusted)["rng"]
        version, internal, gauss = rng["python"]
        kept: dict[str, Any] = {
            "step": step,
            "random_state": (version, tuple(internal), gauss),
            "numpy_random_seed": _numpy_state(rng.get("numpy")),
            "torch_manual_seed": rng["torch"],
        }
        if "cuda" in rng:
            kept["torch_cuda_manual_seed"] = rng["cuda"]
        save_file(kept, target / f"random_states_{rank}.pkl")
    return str(target)


__all__ = ["to_accelerate"]
