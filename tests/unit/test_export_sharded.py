"""``save_model`` in Transformers' layout (one file, or shards plus an index; safetensors or
torch.save; config.json), read back by ``from_pretrained``; ``max_shard_size``; re-saves
into the same folder; ``save`` on the main process only."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel

from gradsync import CheckpointError, ConfigError, backends
from gradsync.backends import _save_pretrained
from gradsync.checkpoint import export
from gradsync.checkpoint.export import parse_size, save, save_model, shard_plan
from gradsync.config import Config

TIED = "lm_head.weight"  # GPT-2 ties it to transformer.wte.weight


@pytest.fixture
def single(clean_env):
    backend = backends.create("single")
    backend.setup(Config())
    return backend


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config).eval()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weight_files(folder: Path) -> list[str]:
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.name.startswith(("model", "pytorch_model")) or p.name.startswith(".")
    )


def assert_same_model(loaded: torch.nn.Module, model: torch.nn.Module) -> None:
    saved = model.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(saved)
    assert all(torch.equal(got[k], v) for k, v in saved.items())
    x = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_sharded_safetensors_load_with_from_pretrained(tmp_path, single):
    model = gpt2()
    unique = {k: v for k, v in model.state_dict().items() if k != TIED}
    limit = sum(nbytes(v) for v in unique.values()) // 4  # forces several shards
    out = save_model(single, model, tmp_path / "gpt2", 0, max_shard_size=limit)
    folder = Path(out)
    assert folder == tmp_path / "gpt2"

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3
    assert shards == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    assert set(index["weight_map"]) == set(unique)  # every key but the tied one, once
    assert index["metadata"] == {"total_size": sum(nbytes(v) for v in unique.values())}
    assert not (folder / "model.safetensors").exists()

    order: list[str] = []
    for name in shards:  # filled in state-dict order, each within the limit unless alone
        with safe_open(str(folder / name), "pt") as f:
            keys = list(f.keys())
            assert f.metadata()["format"] == "pt"
            assert json.loads(f.metadata()["tied"]) == {TIED: "transformer.wte.weight"}
            size = sum(nbytes(f.get_tensor(k)) for k in keys)
        assert size <= limit or len(keys) == 1
        assert all(index["weight_map"][k] == name for k in keys)
        order += sorted(keys, key=list(unique).index)
    assert order == list(unique)

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["n_layer"] == 2
    assert (folder / "generation_config.json").is_file()  # as save_pretrained writes it
    assert model.config.architectures is None  # the model's own config is left alone

    assert_same_model(GPT2LMHeadModel.from_pretrained(folder), model)


def test_one_file_when_the_weights_fit(tmp_path, single):
    model = gpt2()
    folder = Path(save_model(single, model, tmp_path / "gpt2", 0))  # "10GB"
    assert weight_files(folder) == ["model.safetensors"]
    assert_same_model(GPT2LMHeadModel.from_pretrained(folder), model)


@pytest.mark.parametrize("limit", ["4KB", "10GB"])
def test_torch_save_layout_loads_with_from_pretrained(tmp_path, single, limit):
    model = gpt2()
    folder = Path(
        save_model(
            single, model, tmp_path / "gpt2", 0, max_shard_size=limit, safe_serialization=False
        )
    )
    files = weight_files(folder)
    if limit == "10GB":
        assert files == ["pytorch_model.bin"]
    else:
        index = json.loads((folder / "pytorch_model.bin.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) >= 3 and files == sorted([*shards, "pytorch_model.bin.index.json"])
        assert all(s.startswith("pytorch_model-") and s.endswith(".bin") for s in shards)
        first = torch.load(folder / shards[0], weights_only=True)
        assert all(t.untyped_storage().nbytes() == nbytes(t) for t in first.values())
    assert_same_model(GPT2LMHeadModel.from_pretrained(folder), model)


def test_a_plain_module_gets_weights_and_no_config(tmp_path, single):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    folder = Path(save_model(single, model, tmp_path / "plain", 0))
    assert sorted(os.listdir(folder)) == ["model.safetensors"]
    saved = load_file(folder / "model.safetensors")
    assert saved.keys() == model.state_dict().keys()
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


def test_a_resave_leaves_only_its_own_weights(tmp_path, single):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")  # not ours: kept
    first, second = gpt2(0), gpt2(1)
    save_model(single, first, folder, 0, max_shard_size="4KB")
    many = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    save_model(single, second, folder, 0, max_shard_size="16KB")  # fewer shards
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert 1 < len(shards) < len(set(many.values()))
    assert weight_files(folder) == sorted([*shards, "model.safetensors.index.json"])
    assert_same_model(GPT2LMHeadModel.from_pretrained(folder), second)

    save_model(single, first, folder, 0, safe_serialization=False)  # one file, the other format
    assert weight_files(folder) == ["pytorch_model.bin"]  # no index nor shards left to shadow it
    assert_same_model(GPT2LMHeadModel.from_pretrained(folder), first)
    save_model(single, second, folder, 0)
    assert weight_files(folder) == ["model.safetensors"]
    assert (folder / "tokenizer.json").read_text() == "{}"


def test_a_save_that_dies_midway_leaves_no_index_over_other_shards(tmp_path, single, monkeypatch):
    folder = tmp_path / "gpt2"
    first, second = gpt2(0), gpt2(1)
    save_model(single, first, folder, 0, max_shard_size="4KB")
    before = sorted(
        set(
            json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()
        )
    )
    renames = []
    real = os.replace

    def dies_on_the_second_shard(src, dst):
        if str(dst).endswith(".safetensors"):
            renames.append(dst)
            if len(renames) == 2:
                raise OSError("disk gone")
        real(src, dst)

    monkeypatch.setattr(export.os, "replace", dies_on_the_second_shard)
    with pytest.raises(OSError, match="disk gone"):
        save_model(single, second, folder, 0, max_shard_size="4KB")  # the same shard names
    monkeypatch.setattr(export.os, "replace", real)
    assert len(renames) == 2
    # The first shard is the new one, the rest old: no index may lead a loader to that mix.
    assert not (folder / "model.safetensors.index.json").exists()
    with pytest.raises(OSError):
        GPT2LMHeadModel.from_pretrained(folder)
    save_model(single, second, folder, 0, max_shard_size="4KB")  # the next save tidies up
    assert weight_files(folder) == sorted([*before, "model.safetensors.index.json"])
    assert_same_model(GPT2LMHeadModel.from_pretrained(folder), second)


def test_a_state_dict_entry_that_is_not_a_tensor_is_refused():
    # What a backend's gathered state dict may hold besides tensors (a module's extra state).
    with pytest.raises(CheckpointError, match="'_extra_state' is a dict, not a tensor"):
        export._standalone({"weight": torch.ones(2), "_extra_state": {"note": 1}}, {})


def test_an_existing_file_is_refused(tmp_path, single):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="that path is an existing file; give a folder"):
        save_model(single, gpt2(), tmp_path / "file", 0)


def test_tensors_fill_shards_in_order_and_a_large_one_stands_alone():
    sizes = {"a": 5, "big": 20, "b": 5, "c": 4, "d": 2}
    assert shard_plan(sizes, 10, "model.safetensors") == {
        "model-00001-of-00003.safetensors": ["big"],
        "model-00002-of-00003.safetensors": ["a", "b"],
        "model-00003-of-00003.safetensors": ["c", "d"],
    }
    assert shard_plan(sizes, 36, "pytorch_model.bin") == {"pytorch_model.bin": list(sizes)}
    assert shard_plan({}, 10, "model.safetensors") == {"model.safetensors": []}


@pytest.mark.parametrize(
    "value, size",
    [
        (123, 123),
        ("5GB", 5 * 10**9),
        ("5GiB", 5 * 2**30),
        ("500MB", 500 * 10**6),
        ("1.5GB", 1_500_000_000),
        ("64KiB", 64 * 2**10),
        ("2MiB", 2 * 2**20),
        ("1TB", 10**12),
        (" 10 kb ", 10**4 // 8),  # a lowercase b: bits, as in Accelerate
        ("8Gb", 10**9),
    ],
)
def test_sizes_are_read_like_accelerate(value, size):
    assert parse_size(value) == size


@pytest.mark.parametrize(
    "value", ["5", "five GB", "5XB", "GB", "-1MB", 0, -3, 1.5, True, None, "nanGB"]
)
def test_a_bad_size_names_the_value_and_the_fix(value, single, tmp_path):
    with pytest.raises(ConfigError, match=r"max_shard_size=.* e\.g\. '5GB'"):
        parse_size(value)
    with pytest.raises(ConfigError, match="max_shard_size"):
        save_model(single, gpt2(), tmp_path / "x", 0, max_shard_size=value)
    assert not (tmp_path / "x").exists()


def test_save_writes_on_the_main_process_only(tmp_path):
    obj = {"step": 3, "values": [1, 2]}
    save(obj, tmp_path / "other.pt", main=False)
    assert not (tmp_path / "other.pt").exists()
    save(obj, tmp_path / "main.pt", main=True)
    assert torch.load(tmp_path / "main.pt", weights_only=True) == obj
    assert sorted(os.listdir(tmp_path)) == ["main.pt"]  # no temporary file left
    buffer = io.BytesIO()
    save(obj, buffer, main=True)
    assert torch.load(io.BytesIO(buffer.getvalue()), weights_only=True) == obj


def test_save_with_safetensors_keeps_every_key_of_shared_tensors(tmp_path):
    w = torch.randn(4, 4)
    state = {"a": w, "b": w, "row": w[1]}  # one storage three times
    save(state, tmp_path / "w.safetensors", main=True, safe_serialization=True)
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert got.keys() == state.keys() and all(torch.equal(got[k], v) for k, v in state.items())
    buffer = io.BytesIO()
    save({"x": torch.ones(2)}, buffer, main=True, safe_serialization=True)
    assert len(buffer.getvalue()) > 0
    save(state, tmp_path / "no.safetensors", main=False, safe_serialization=True)
    assert not (tmp_path / "no.safetensors").exists()


def test_save_with_safetensors_refuses_what_is_not_a_dict_of_tensors(tmp_path):
    for obj in ([torch.ones(1)], {"a": torch.ones(1), "step": 3}):
        with pytest.raises(
            ConfigError, match="takes a dict of str -> tensor.*safe_serialization=False"
        ):
            save(obj, tmp_path / "x.safetensors", main=True, safe_serialization=True)
    assert not (tmp_path / "x.safetensors").exists()


class _OwnSave(torch.nn.Module):
    """A module whose ``save_pretrained`` records what it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.calls: list[tuple[str, bool, object]] = []

    def save_pretrained(
        self, save_directory: str, is_main_process: bool = True, state_dict: dict | None = None
    ) -> str:
        self.calls.append((save_directory, is_main_process, state_dict))
        return "written"


class _NoStateDict(torch.nn.Module):
    def save_pretrained(self, save_directory: str, is_main_process: bool = True) -> None:
        raise AssertionError("never replaced")


def test_gather_in_save_pretrained_gathers_only_when_no_whole_state_dict_is_given(clean_env):
    module, gathered, barriers = _OwnSave(), {"lin.weight": torch.ones(2, 2)}, []
    _save_pretrained.gather_in_save_pretrained(module, lambda: gathered, lambda: barriers.append(1))
    _save_pretrained.gather_in_save_pretrained(module, lambda: {}, lambda: None)  # once is enough
    assert module.save_pretrained("d", False) == "written"  # one process: nobody to wait for
    assert module.calls == [("d", False, gathered)] and barriers == [1]
    mine = {"lin.weight": torch.zeros(2, 2)}
    module.save_pretrained("e", state_dict=mine)  # whole tensors: the module's own call
    assert module.calls[-1] == ("e", True, mine) and barriers == [1]
    assert "save_pretrained" not in vars(_OwnSave())  # other instances keep the class's


def test_gather_in_save_pretrained_leaves_a_save_pretrained_without_state_dict_alone(clean_env):
    module = _NoStateDict()
    _save_pretrained.gather_in_save_pretrained(module, dict, lambda: None)
    assert "save_pretrained" not in vars(module)
