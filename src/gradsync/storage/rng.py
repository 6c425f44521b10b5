"""Random-number state: what a checkpoint saves of every rank, and what a prepared loader's
pass was created under. The one place gradsync captures and restores RNG."""

from __future__ import annotations

import random
import sys
from typing import Any

import torch


def capture_rng() -> dict[str, Any]:
    """Python's, numpy's (when numpy is in use), torch's CPU and CUDA generators."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        name, key, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [
            str(name),
            torch.from_numpy(key.astype("int64")),
            int(pos),
            int(has_gauss),
            float(cached),
        ]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what ``capture_rng`` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        name, key, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


#: The torch RNG states a DataLoader iterator draws from when it is created.
RngState = dict[str, torch.Tensor]


def _generators(loader: Any) -> dict[str, torch.Generator]:
    """The loader's own generator and its batch sampler's (batches dealt whole), if any."""
    found = {}
    for key, owner in (("generator", loader), ("batches", getattr(loader, "batch_sampler", None))):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator):
            found[key] = generator
    return found


def get_rng(loader: Any) -> RngState:
    """The global torch CPU RNG and the loader's own generators, if it has any."""
    state = {"torch": torch.get_rng_state()}
    for key, generator in _generators(loader).items():
        state[key] = generator.get_state()
    return state


def dealing_rng(loader: Any) -> RngState | None:
    """The state of the generator a loader that deals whole batches draws its batch
    sequence from (it carries over from one pass to the next), or None."""
    generator = _generators(loader).get("batches")
    return {"batches": generator.get_state()} if generator is not None else None


def set_rng(state: RngState, loader: Any) -> None:
    """Put back what ``get_rng`` (or ``dealing_rng``) returned."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    for key, generator in _generators(loader).items():
        if key in state:
            generator.set_state(state[key])
