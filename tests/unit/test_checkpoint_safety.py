"""Loading a checkpoint never runs code from it (backend "single", the plain format; the
other formats are in tests/multiprocess/test_checkpoint_safety.py): a payload with a
matching manifest is refused in one line naming the file and the global, before anything
is loaded; trusted=True loads it; manifest names that leave the folder are never read."""

from __future__ import annotations

import io
import json
import pickle
import pickletools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from gradsync import Accelerator, CheckpointError
from gradsync.checkpoint import MANIFEST
from gradsync.storage import safety
from payload import Payload, refresh_manifest, tamper_torch_file


class Counter:
    """A registered object (saved in objects.pt)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def build(seed: int = 0) -> tuple[Accelerator, torch.nn.Module, object, object, Counter]:
    torch.manual_seed(seed)
    accel = Accelerator(backend="single", gradient_accumulation_steps=2, seed=seed)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    model, opt, loader, sched = accel.prepare(model, opt, DataLoader(data, batch_size=2), sched)
    counter = Counter()
    accel.register_for_checkpointing(counter)
    return accel, model, opt, loader, counter


@pytest.fixture
def saved(tmp_path, clean_env) -> Path:
    accel, model, opt, loader, counter = build()
    for i, (x, y) in enumerate(loader):
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        counter.n += 1
        if i == 4:  # mid-window: the window's gradients are saved too
            break
    return Path(accel.save_state(tmp_path / "ckpts" / "a"))


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


FILES = [
    "model_0.pt",
    "optimizer_0.pt",
    "schedulers.pt",
    "objects.pt",
    "rng_rank0.pt",
    "window_rank0.pt",
]


@pytest.mark.parametrize("name", FILES)
def test_a_payload_never_runs_and_the_load_fails_in_one_line(saved, tmp_path, clean_env, name):
    assert (saved / name).is_file()
    marker = tmp_path / "ran"
    tamper_torch_file(saved, name, marker)
    accel, model, opt, _loader, counter = build(seed=1)
    before, opt_before = snapshot(model), opt.state_dict()
    with pytest.raises(CheckpointError) as err:
        accel.load_state(saved)
    text = str(err.value)
    assert not marker.exists(), "the payload ran"
    assert "\n" not in text and name in text and "payload.plant" in text, text
    assert "trusted=True" in text
    assert unchanged(model, before) and opt.state_dict() == opt_before and counter.n == 0
    assert accel.optimizer_steps == 0
    # The user trusts it: the payload runs, and the checkpoint loads.
    accel.load_state(saved, trusted=True)
    assert marker.exists() and counter.n == 5 and accel.optimizer_steps == 2


def test_an_untampered_checkpoint_loads_bitwise(saved, clean_env):
    reference = torch.load(saved / "model_0.pt", weights_only=True)
    accel, model, *_ = build(seed=1)
    accel.load_state(saved)
    assert all(torch.equal(reference[k], v) for k, v in model.state_dict().items())


def test_a_file_outside_the_manifest_is_checked_too(saved, tmp_path, clean_env):
    marker = tmp_path / "ran"
    torch.save(Payload(marker, {}), saved / "extra.pt")
    accel, *_ = build(seed=1)
    with pytest.raises(
        CheckpointError, match=r"extra\.pt holds a pickle that names payload\.plant"
    ):
        accel.load_state(saved)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["../outside.pt", "/ABS/outside.pt"])
def test_a_manifest_naming_a_path_outside_the_folder_is_refused_unread(
    saved, tmp_path, clean_env, monkeypatch, name
):
    outside = tmp_path / "ckpts" / "outside.pt"
    torch.save({"x": torch.ones(1)}, outside)
    name = name.replace("/ABS", str(tmp_path / "ckpts"))
    manifest = json.loads((saved / MANIFEST).read_text())
    manifest["files"][name] = [outside.stat().st_size, 0]
    (saved / MANIFEST).write_text(json.dumps(manifest))
    import gradsync.storage.folder as folder

    read: list[Path] = []
    real = folder.checksum
    monkeypatch.setattr(folder, "checksum", lambda p: read.append(Path(p)) or real(p))
    accel, model, *_ = build(seed=1)
    before = snapshot(model)
    with pytest.raises(CheckpointError) as err:
        accel.load_state(saved)
    text = str(err.value)
    assert "outside the checkpoint folder" in text and name in text and "\n" not in text, text
    assert read == [], "a file was read before the names were checked"
    assert unchanged(model, before)
    # keep_last removes old checkpoints, never what their manifests name outside.
    accel2, *_ = build(seed=2)
    accel2.save_state(tmp_path / "ckpts" / "b", keep_last=1)
    assert not saved.exists() and outside.is_file()


def test_a_link_out_of_the_folder_is_refused(saved, tmp_path, clean_env):
    outside = tmp_path / "elsewhere.pt"
    (saved / "model_0.pt").rename(outside)
    (saved / "model_0.pt").symlink_to(outside)  # same bytes: the checksum alone would pass
    accel, *_ = build(seed=1)
    with pytest.raises(
        CheckpointError, match=r"model_0\.pt is a link to .*outside the checkpoint folder"
    ):
        accel.load_state(saved)


# -- the scanner ---------------------------------------------------------------------
@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_the_scan_sees_the_global_of_every_pickle_protocol(tmp_path, protocol):
    data = pickle.dumps([Payload(tmp_path / "m", 1), Payload(tmp_path / "m", 2)], protocol=protocol)
    assert "payload.plant" in set(safety.pickle_globals(data))
    assert not (tmp_path / "m").exists()


def test_the_scan_sees_a_global_built_from_memoised_strings():
    # STACK_GLOBAL whose operands come from the memo (BINGET), as pickle writes a repeated name
    data = pickle.dumps((print, print, len), protocol=4)
    ops = [op.name for op, _, _ in pickletools.genops(data)]
    assert "STACK_GLOBAL" in ops and ("BINGET" in ops or "MEMOIZE" in ops)
    assert set(safety.pickle_globals(data)) == {"builtins.print", "builtins.len"}


def test_the_scan_refuses_what_it_cannot_name(tmp_path):
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buffer)
    allowed = safety.allow_list().__contains__
    assert safety.refused_in_blob(buffer.getvalue(), allowed) is None
    assert safety.refused_in_blob(b"not a pickle at all", allowed) == "<not a pickle>"
    opaque = b"\x80\x04\x8c\x01a\x94K\x01\x93."  # STACK_GLOBAL over a string and an int
    assert safety.refused_in_blob(opaque, allowed).startswith("<unreadable pickle")
    extension = b"\x80\x02\x82\x7f."  # EXT1 127: a global from the extension registry
    assert safety.refused_in_blob(extension, allowed).startswith("<unreadable pickle")


def test_a_headerless_protocol_0_pickle_in_a_loaded_file_is_checked(saved, tmp_path, clean_env):
    """Protocol 0 and 1 pickles have no header byte; a .pt file is checked whatever it starts with."""
    marker = tmp_path / "ran"
    (saved / "objects.pt").write_bytes(pickle.dumps(Payload(marker, []), protocol=0))
    refresh_manifest(saved, "objects.pt")
    accel, *_ = build(seed=1)
    with pytest.raises(
        CheckpointError, match=r"objects\.pt holds a pickle that names payload\.plant"
    ):
        accel.load_state(saved)
    assert not marker.exists()


def test_the_scan_reads_every_pickle_of_a_file(tmp_path):
    """torch's legacy format holds several pickles in a row: a payload in a later one counts."""
    data = pickle.dumps({"magic": 1}, protocol=2) + pickle.dumps(
        Payload(tmp_path / "m", 1), protocol=2
    )
    assert safety.refused_in_blob(data, safety.allow_list().__contains__) == "payload.plant"
    assert not (tmp_path / "m").exists()


def test_a_refused_file_names_the_global_even_after_the_manifest_was_updated(saved, tmp_path):
    torch.save(Payload(tmp_path / "m", 1), saved / "objects.pt")
    refresh_manifest(saved, "objects.pt")
    with pytest.raises(CheckpointError, match="objects.pt holds a pickle that names payload.plant"):
        safety.scan_folder(saved, ["objects.pt"], safety.allow_list().__contains__)


# -- the second line of defence, where a backend's own loader reads the files ---------------
def test_dcps_planner_and_reader_refuse_a_payload_on_their_own(tmp_path):
    from gradsync.backends import _fsdp_checkpoint

    buffer = io.BytesIO()
    torch.save(Payload(tmp_path / "m", {"lr": 0.1}), buffer)
    planner = _fsdp_checkpoint._CheckedPlanner(tmp_path, safety.allow_list().__contains__)

    class Item:
        class dest_index:
            fqn = "optim.param_groups"

    with pytest.raises(CheckpointError, match="item optim.param_groups names payload.plant"):
        planner.load_bytes(Item(), buffer)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload(tmp_path / "m", None)))
    reader = _fsdp_checkpoint._CheckedReader(tmp_path, safety.allow_list().__contains__)
    with pytest.raises(CheckpointError, match=r"\.metadata' names payload\.plant"):
        reader.read_metadata()
    assert not (tmp_path / "m").exists()


def test_deepspeeds_checkpoint_engine_is_checked_while_it_loads(tmp_path):
    from gradsync.backends import _deepspeed_checkpoint, _deepspeed_compat

    class Engine:
        def __init__(self) -> None:
            self.checkpoint_engine = self  # stands in for DeepSpeed's TorchCheckpointEngine

        def load(self, path: str, map_location: object = None) -> object:
            return torch.load(path, weights_only=False)

    engine, file = Engine(), tmp_path / "mp_rank_00_model_states.pt"
    torch.save(Payload(tmp_path / "m", {"module": {}}), file)
    inner = engine.checkpoint_engine
    with pytest.raises(CheckpointError, match="names payload.plant"):
        with _deepspeed_compat.checked_loads(engine, _deepspeed_checkpoint._check):
            engine.checkpoint_engine.load(str(file))
    assert engine.checkpoint_engine is inner and not (tmp_path / "m").exists()
