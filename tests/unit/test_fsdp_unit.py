"""FSDP adapter pieces that need no process group (wrap policy, cost, budget, bad settings),
and a window dropped before the first forward on a one-rank group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradsync import Accelerator, ConfigError
from gradsync.backends import fsdp

from scenarios.common import Block, Net


def _names(model: nn.Module, units: list[nn.Module]) -> list[str]:
    by_id = {id(m): n for n, m in model.named_modules()}
    return [by_id[id(u)] for u in units]


def test_default_wrap_shards_the_children_of_containers():
    model = Net()
    assert _names(model, fsdp.select_units(model)) == ["blocks.0", "blocks.1"]


def test_default_wrap_does_not_descend_into_a_unit():
    inner = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    model = nn.Sequential(nn.Sequential(inner), nn.Linear(2, 2), nn.ReLU())
    # the root's children with parameters; ReLU has none, and nothing inside a unit
    assert _names(model, fsdp.select_units(model)) == ["0", "1"]


def test_wrap_by_class_name_class_or_callable():
    model = Net()
    linears = ["inp", "blocks.0.lin", "blocks.1.lin", "head"]
    assert _names(model, fsdp.select_units(model, ["Linear"])) == linears
    assert _names(model, fsdp.select_units(model, nn.Linear)) == linears
    assert _names(model, fsdp.select_units(model, [Block])) == ["blocks.0", "blocks.1"]
    picked = fsdp.select_units(model, lambda m: isinstance(m, Block))
    assert _names(model, picked) == ["blocks.0", "blocks.1"]
    # outermost wins: Block is taken whole, its Linear inside is not a second unit
    assert _names(model, fsdp.select_units(model, ["Block", "Linear"])) == [
        "inp",
        "blocks.0",
        "blocks.1",
        "head",
    ]


def test_wrap_naming_no_class_of_the_model_is_an_error():
    with pytest.raises(ConfigError, match=r"fsdp_wrap=\['TransformerBlock'\].*Block"):
        fsdp.select_units(Net(), ["TransformerBlock"])


def test_deferral_cost_is_the_unsharded_gradients_minus_the_shard():
    model = Net()  # 705 parameters
    assert (
        fsdp.deferral_cost(model, 2, grad_bytes=None, keep_params=False) == 705 * 4 - 705 * 4 // 2
    )
    assert fsdp.deferral_cost(model, 4, grad_bytes=None, keep_params=False) == 2820 - 2820 // 4
    # keeping the parameters unsharded adds their bytes too
    assert (
        fsdp.deferral_cost(model, 2, grad_bytes=None, keep_params=True) == 2820 - 2820 // 2 + 2820
    )  # the whole gathered copy
    half = Net().to(torch.bfloat16)
    assert fsdp.deferral_cost(half, 2, grad_bytes=None, keep_params=False) == 705
    assert fsdp.deferral_cost(half, 2, grad_bytes=4, keep_params=False) == 1410  # fp32 reduce dtype


def test_available_memory_on_cpu_is_split_over_local_ranks(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one, where = fsdp.available_memory(torch.device("cpu"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    four, _ = fsdp.available_memory(torch.device("cpu"))
    assert one > 0 and "available RAM" in where
    assert four < one  # not exact: free memory moves between the two reads


def test_fsdp_without_a_process_group_is_a_clear_error(clean_env):
    with pytest.raises(
        RuntimeError, match=r"backend='fsdp' needs a process group.*gradsync launch"
    ):
        Accelerator(backend="fsdp")


def test_unknown_sync_policy_is_a_config_error(clean_env):
    with pytest.raises(ConfigError, match=r"sync_policy='sometimes' is unknown; use one of"):
        Accelerator(backend="fsdp", sync_policy="sometimes")


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ({"sync_policy": "native"}, "sync_policy='native' is DeepSpeed's; with backend='fsdp'"),
        ({"activation_checkpointing": 3}, "activation_checkpointing=3 must be a module class name"),
    ],
)
def test_settings_fsdp_cannot_honour_fail_before_any_group(clean_env, setting, match):
    with pytest.raises(ConfigError, match=match):
        Accelerator(backend="fsdp", **setting)


def test_keeping_parameters_with_every_step_is_refused_before_any_group(clean_env):
    with pytest.raises(
        ConfigError,
        match=r"fsdp_keep_params_in_window=True .* sync_policy='every_step' defers nothing",
    ):
        Accelerator(backend="fsdp", sync_policy="every_step", fsdp_keep_params_in_window=True)


def _decide(asked="auto", keep=None, legacy=False, budget=None):
    from gradsync.backends._fsdp_policy import decide
    from gradsync.backends._memory import Budget

    b = Budget(budget, "sync_memory_budget") if budget is not None else None
    return decide(asked, keep, legacy, grads=100, full=200, budget=b, world=2)


@pytest.mark.parametrize(
    ("kwargs", "policy", "keep", "extra"),
    [
        ({"budget": 200}, "defer", "window", 200),
        ({"budget": 199}, "defer", "no", 100),
        ({"budget": 99}, "every_step", "no", 0),
        ({"budget": 10**6, "keep": False}, "defer", "no", 100),
        ({"budget": 150, "keep": True}, "every_step", "no", 0),  # keeping is asked: it must fit too
        ({"budget": 10**6, "legacy": True}, "defer", "after_backward", 200),
        ({"asked": "defer"}, "defer", "no", 100),  # an explicit policy does not consult the budget
        ({"asked": "defer", "keep": True}, "defer", "window", 200),
        ({"asked": "every_step"}, "every_step", "no", 0),
    ],
)
def test_auto_picks_the_deepest_level_that_fits(kwargs, policy, keep, extra):
    got = _decide(**kwargs)
    assert got[:3] == (policy, keep, extra), got[3]
    if "budget" in kwargs:
        assert f"({kwargs['budget']} bytes, sync_memory_budget)" in got[3]


@pytest.mark.parametrize("policy", ["defer", "every_step"])
def test_a_window_dropped_before_the_first_forward_raises_the_users_error(
    tmp_path, clean_env, policy
):
    """The user's block fails before the model ever ran: the window is dropped and the
    user's own exception comes out (not one from inside torch's reset of an FSDP2 root that
    was never initialised), and the next window trains."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    accel = Accelerator(backend="fsdp", sync_policy=policy, gradient_accumulation_steps=2)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model, opt = accel.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="^the user's block failed$"):
        with accel.accumulate(model):
            raise ValueError("the user's block failed")
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        with accel.accumulate(model):
            accel.backward(model(torch.ones(2, 4)).sum())
            opt.step()
            opt.zero_grad()
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
