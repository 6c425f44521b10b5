"""A checkpoint rewritten by someone who can write its folder: a pickle payload that leaves a
marker file when it runs (and then hands back what it replaced, so a trusted load still
works), and a manifest whose sizes and CRC-32s are updated to match.

Used by the tests in one process and inside the multi-process workers.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

import torch

from gradsync.storage.folder import MANIFEST, checksum


def plant(marker: str, value: Any) -> Any:
    """What the payload runs when it is unpickled."""
    Path(marker).write_text("the payload ran")
    return value


class Payload:
    """Pickles as a call of ``plant(marker, value)``."""

    def __init__(self, marker: str | Path, value: Any) -> None:
        self.marker = str(marker)
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        return plant, (self.marker, self.value)


def refresh_manifest(folder: Path, *names: str) -> None:
    """Record the files' new sizes and checksums, as an attacker would."""
    manifest_path = folder / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    for name in names:
        manifest["files"][name] = list(checksum(folder / name))
    manifest_path.write_text(json.dumps(manifest, indent=1))


def tamper_torch_file(folder: Path, name: str, marker: str | Path) -> None:
    """Wrap what a ``torch.save`` file holds in the payload."""
    path = folder / name
    obj = torch.load(path, map_location="cpu", weights_only=False)
    torch.save(Payload(marker, obj), path)
    refresh_manifest(folder, name)


def tamper_pickle_file(folder: Path, name: str, marker: str | Path) -> None:
    """Wrap what a plain pickle file (DCP's ``.metadata``) holds in the payload."""
    path = folder / name
    with open(path, "rb") as f:
        obj = pickle.load(f)
    with open(path, "wb") as f:
        pickle.dump(Payload(marker, obj), f)
    refresh_manifest(folder, name)


def tamper_dcp_item(folder: Path, dcp: str, marker: str | Path) -> str:
    """Wrap the first non-tensor item of the DCP folder ``folder/dcp`` in the payload: its
    bytes are appended to its shard file and the metadata points there. Returns the item."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    meta_path = folder / dcp / ".metadata"
    with open(meta_path, "rb") as f:
        metadata = pickle.load(f)
    fqn = next(
        k
        for k, v in sorted(metadata.state_dict_metadata.items())
        if isinstance(v, BytesStorageMetadata)
    )
    index = MetadataIndex(fqn)
    info = metadata.storage_data[index]
    shard = folder / dcp / str(info.relative_path)
    with open(shard, "rb") as f:
        f.seek(int(info.offset))
        original = torch.load(io.BytesIO(f.read(int(info.length))), weights_only=False)
    buffer = io.BytesIO()
    torch.save(Payload(marker, original), buffer)
    blob = buffer.getvalue()
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(blob)
    metadata.storage_data[index] = type(info)(
        info.relative_path, offset, len(blob), *[getattr(info, n) for n in _extra_fields(info)]
    )
    with open(meta_path, "wb") as f:
        pickle.dump(metadata, f)
    refresh_manifest(folder, f"{dcp}/.metadata", f"{dcp}/{info.relative_path}")
    return fqn


def _extra_fields(info: Any) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(info)][3:]
