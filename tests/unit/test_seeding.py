"""``gradsync.set_seed``: the same seed gives the same draws from random, NumPy and torch;
``device_specific`` adds the rank; ``deterministic``; bad seeds."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from gradsync import ConfigError
from gradsync.seeding import MAX_SEED, set_seed


def draws() -> tuple[list[float], list[float], list[float]]:
    return ([random.random() for _ in range(3)], np.random.rand(3).tolist(), torch.rand(3).tolist())


@pytest.fixture
def torch_flags(monkeypatch):
    """Put back what ``deterministic=True`` changes."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
    yield monkeypatch
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.benchmark = before[1]


def test_the_same_seed_gives_the_same_draws(clean_env):
    set_seed(1234)
    first = draws()
    set_seed(1234)
    assert draws() == first
    set_seed(1235)
    other = draws()
    assert all(a != b for a, b in zip(other, first, strict=True))  # each generator was seeded


def test_every_generator_is_seeded_as_its_own_seed_function_would(clean_env):
    set_seed(7)
    got = draws()
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    assert got == draws()


def test_device_specific_adds_the_rank(clean_env):
    set_seed(100, device_specific=True)  # one process: rank 0
    alone = draws()
    set_seed(100)
    assert draws() == alone
    clean_env.setenv("RANK", "3")  # the launcher's rank, read while there is no group
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("LOCAL_RANK", "3")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", "29500")
    set_seed(100, device_specific=True)
    third = draws()
    set_seed(103)
    assert draws() == third != alone
    with pytest.raises(
        ConfigError, match=rf"on rank 3 gives {MAX_SEED + 3}.*from 0 to {MAX_SEED - 3}"
    ):
        set_seed(MAX_SEED, device_specific=True)


def test_deterministic_turns_on_deterministic_algorithms(clean_env, torch_flags):
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    set_seed(0)
    assert not torch.are_deterministic_algorithms_enabled()
    set_seed(0, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.benchmark is False
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    torch_flags.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # a value of the user's stays
    set_seed(0, deterministic=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@pytest.mark.parametrize("seed", [-1, MAX_SEED + 1, 1.0, "42", True, None])
def test_a_bad_seed_names_the_value_and_the_fix(clean_env, seed):
    with pytest.raises(ConfigError, match=rf"set_seed\(seed={seed!r}\).*(e\.g\. set_seed\(42\))"):
        set_seed(seed)


def test_the_ends_of_the_range_are_seeds(clean_env):
    set_seed(0)
    set_seed(MAX_SEED)
    assert np.random.get_state()[1][0] == np.random.RandomState(MAX_SEED).get_state()[1][0]
