"""Reading trackers' files back with their own libraries' formats (for the tests)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any


def wandb_records(path: Path) -> list[Any]:
    """The records of a .wandb file (W&B's LevelDB-style log of its Record protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        if pos + 7 + length > len(data):  # still being written
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, or the last piece of a record
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out
