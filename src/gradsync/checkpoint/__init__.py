"""Checkpoints: atomic folders with a verified manifest.

* ``folder``: the layout, the typed manifest, verification, ``latest_checkpoint``, pruning;
* ``commit``: writing a folder on every rank and committing it on rank 0;
* ``failure``: a failed write's OS error and the one line every rank raises for it;
* ``state``: what an Accelerator saves and loads (the registry of prepared objects, the
  window, the backend);
* ``rng``: every random-number state gradsync saves or restores;
* ``safety``: the check before a load: no name leaves the folder, no pickle can run code;
* ``export``: a model's full weights as safetensors;
* ``signals``: SIGTERM, to save before a preempted job exits.
"""

from __future__ import annotations

from gradsync.storage.folder import (
    MANIFEST,
    Manifest,
    latest_checkpoint,
    load_file,
    read_manifest,
    save_file,
)

__all__ = ["MANIFEST", "Manifest", "latest_checkpoint", "load_file", "read_manifest", "save_file"]
