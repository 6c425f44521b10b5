"""Checking a checkpoint folder before anything in it is loaded: no file name leaves the
folder, and no pickle in it can run code.

A pickle runs code only through the globals it names (``GLOBAL``, ``STACK_GLOBAL``,
``INST``, the extension registry) and its persistent ids: what it then calls. The scan reads
every pickle of the folder with each of those replaced by an inert stand-in, so nothing from
the file runs, and refuses a global that is not on the allow-list of the checkpoint's format: torch's own ``weights_only`` set
(tensors, storages, dtypes, ``OrderedDict``), ``torch.distributed.checkpoint``'s metadata
classes, and what a backend adds (DeepSpeed's enums and config classes). Pickles are found
in plain files, in ``torch.save`` archives (their ``*.pkl`` members) and inside
``torch.distributed.checkpoint`` shards (the non-tensor items, located through the shard
folder's metadata, which is itself scanned first).

Every check happens on rank 0 before ``load_state`` changes anything; its verdict goes to
every rank. ``load_state(path, trusted=True)`` skips it, for checkpoints the user trusts.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from gradsync._support.torch_compat import weights_only_globals
from gradsync.errors import CheckpointError

#: Globals the metadata of a ``torch.distributed.checkpoint`` folder (``.metadata``) holds,
#: besides torch's ``weights_only`` set (read from DCP's files with torch 2.13).
DCP_METADATA_GLOBALS = frozenset(
    {
        "torch.distributed.checkpoint.metadata.Metadata",
        "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
        "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
        "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
        "torch.distributed.checkpoint.metadata.TensorProperties",
        "torch.distributed.checkpoint.metadata.MetadataIndex",
        "torch.distributed.checkpoint.metadata.StorageMeta",
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "pathlib.PosixPath",
    }
)


#: A numpy array of numbers, as an RNG state holds one (Accelerate's ``random_states_N.pkl``,
#: which gradsync.accelerate writes beside its own files): the array, its dtype and the bytes
#: of the dtype (numpy 1 and 2 spell the module of ``_reconstruct`` differently). An array of
#: objects would name its objects' globals, which the scan checks like any other.
NUMPY_ARRAY_GLOBALS = frozenset(
    {
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy.ndarray",
        "numpy.dtype",
        "numpy.dtypes.UInt32DType",
        "_codecs.encode",
    }
)


def allow_list(extra: frozenset[str] = frozenset()) -> frozenset[str]:
    """torch's ``weights_only`` globals, numpy arrays of numbers and ``extra`` (a backend's
    own)."""
    return weights_only_globals() | NUMPY_ARRAY_GLOBALS | extra


class _Inert:
    """What every global of a scanned pickle becomes: it accepts whatever the pickle does
    with it (call, ``__setstate__``, items) and does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def add(self, value: Any) -> None:
        pass


class _GlobalsReader(pickle.Unpickler):
    """Reads a pickle with every global (``GLOBAL``, ``STACK_GLOBAL``, ``INST``, the
    extension registry: all go through ``find_class``) and every persistent id replaced by
    an inert stand-in, recording the globals' names. Nothing from the file is ever called:
    a pickle can call only what ``find_class`` or ``persistent_load`` hand it."""

    def __init__(self, file: Any, found: list[str]) -> None:
        super().__init__(file)
        self._found = found

    def find_class(self, module: str, name: str) -> Any:
        self._found.append(f"{module}.{name}")
        return _Inert

    def persistent_load(self, pid: Any) -> Any:
        return _Inert()


def pickle_globals(data: bytes) -> list[str]:
    """Every global a pickle names, as ``module.name``, read without running anything from
    it; several pickles in a row are read to the end. Bytes that are no pickle raise."""
    found: list[str] = []
    stream = io.BytesIO(data)
    while stream.tell() < len(data):
        _GlobalsReader(stream, found).load()
    return found


def _refused(data: bytes, allowed: Callable[[str], bool]) -> str | None:
    try:
        for found in pickle_globals(data):
            if not allowed(found):
                return found
    except Exception as err:  # not a readable pickle: nothing gradsync wrote
        return f"<unreadable pickle: {type(err).__name__}>"
    return None


def is_pickle(head: bytes) -> bool:
    """Whether bytes start like a pickle (protocol 2 or later, as torch and DCP write)."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def refused_in_blob(blob: bytes, allowed: Callable[[str], bool]) -> str | None:
    """The first global not allowed in a ``torch.save`` archive or a plain pickle held in
    memory, or None; a blob that is neither is refused."""
    if blob[:4] == b"PK\x03\x04":
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            return _refused_in_zip(archive, allowed)
    if is_pickle(blob[:2]):
        return _refused(blob, allowed)
    return "<not a pickle>"


def _refused_in_zip(archive: zipfile.ZipFile, allowed: Callable[[str], bool]) -> str | None:
    for member in archive.namelist():
        if member.endswith(".pkl"):
            refused = _refused(archive.read(member), allowed)
            if refused is not None:
                return refused
    return None


#: File kinds torch.load (gradsync's and DeepSpeed's) reads: whatever they hold is checked as
#: a pickle even when it does not start like one (protocol 0 and 1 have no header).
LOADED_SUFFIXES = (".pt", ".pth", ".bin", ".pkl")


def refused_in_file(path: Path, allowed: Callable[[str], bool]) -> str | None:
    """The first global not allowed in a file, or None (also for a file that is never
    unpickled: raw tensor bytes, JSON, a script)."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04" and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            return _refused_in_zip(archive, allowed)
    if is_pickle(head) or path.suffix in LOADED_SUFFIXES:
        return _refused(path.read_bytes(), allowed)
    return None


# -- torch.distributed.checkpoint folders -----------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    """Loads a DCP ``.metadata`` file, finding only the classes it may hold."""

    def __init__(self, file: Any, allowed: Callable[[str], bool]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if not self._allowed(f"{module}.{name}"):
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return super().find_class(module, name)


def read_dcp_metadata(path: Path, allowed: Callable[[str], bool]) -> Any:
    """A DCP folder's ``.metadata``, unpickled with only ``allowed`` globals."""
    with open(path, "rb") as f:
        return _MetadataUnpickler(f, lambda g: g in DCP_METADATA_GLOBALS or allowed(g)).load()


def refused_in_dcp(folder: Path, allowed: Callable[[str], bool]) -> tuple[str, str] | None:
    """(file, global) of the first pickled item of a DCP folder that names a global not
    allowed, or None. The metadata is scanned, then read, then every non-tensor item of
    the shards it points to."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    meta_path = folder / ".metadata"
    refused = refused_in_file(meta_path, lambda g: g in DCP_METADATA_GLOBALS or allowed(g))
    if refused is not None:
        return ".metadata", refused
    metadata = read_dcp_metadata(meta_path, allowed)
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata):
            continue
        info = metadata.storage_data.get(MetadataIndex(fqn))
        if info is None:
            continue
        file = folder / str(info.relative_path)
        if not is_inside(folder, file):
            return str(info.relative_path), "<a path outside the checkpoint>"
        with open(file, "rb") as f:
            f.seek(int(info.offset))
            blob = f.read(int(info.length))
        refused = refused_in_blob(blob, allowed)
        if refused is not None:
            return f"{info.relative_path} (item {fqn})", refused
    return None


# -- file names -------------------------------------------------------------------------
def is_inside(folder: Path, path: Path) -> bool:
    """``path`` resolves (symlinks followed) to a place inside ``folder``."""
    root = folder.resolve()
    try:
        path.resolve().relative_to(root)
    except ValueError:
        return False
    return True


def check_name(folder: Path, name: str) -> Path:
    """The file ``name`` of a manifest inside ``folder``; a CheckpointError for an absolute
    name, a ``..`` in it, or a symlink that leads out of the folder."""
    where = str(folder)
    candidate = Path(name)
    if candidate.is_absolute() or ".." in candidate.parts or not candidate.parts:
        raise CheckpointError(
            f"checkpoint {where!r}: its manifest names {name!r}, a path outside the checkpoint "
            "folder; refused (nothing was read)"
        )
    path = folder / candidate
    if not is_inside(folder, path):
        raise CheckpointError(
            f"checkpoint {where!r}: {name} is a link to {str(path.resolve())!r}, outside the "
            "checkpoint folder; refused (nothing was read)"
        )
    return path


def scan_folder(folder: Path, names: Iterable[str], allowed: Callable[[str], bool]) -> None:
    """Refuse the checkpoint (a one-line CheckpointError naming the file and the global) when
    any pickle among ``names`` names a global that ``allowed`` does not accept."""
    dcp_folders = set()
    for name in sorted(names):
        path = folder / name
        if path.name == ".metadata":
            dcp_folders.add(path.parent)
            continue
        if path.suffix == ".distcp":
            dcp_folders.add(path.parent)
            continue
        refused = refused_in_file(path, allowed)
        if refused is not None:
            raise _unsafe(folder, name, refused)
    for dcp in sorted(dcp_folders):
        found = refused_in_dcp(dcp, allowed)
        if found is not None:
            file, refused = found
            raise _unsafe(folder, str((dcp / file).relative_to(folder)), refused)


def _unsafe(folder: Path, name: str, refused: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {str(folder)!r}: {name} holds a pickle that names {refused}, which a "
        "checkpoint of this format never holds and which could run code; refused (nothing was "
        "loaded). Load it with load_state(path, trusted=True) only if you trust where it came from"
    )
