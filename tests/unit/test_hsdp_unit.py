"""FSDP2 on a 2-D mesh (HSDP), the parts that need no process group: the ``fsdp_mesh`` forms
and their bad values, the (R, S) arithmetic, ``defer_replicate``'s refusals, and what
``auto`` picks with S-aware memory numbers."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from gradsync import Accelerator, ConfigError
from gradsync.backends import fsdp
from gradsync.backends._fsdp_policy import crosses_nodes, decide, mesh_shape, partial_cost
from gradsync.backends._memory import Budget
from gradsync.cli import build_parser, launch_config
from gradsync.config import Config, from_env, load_config
from gradsync.options.fsdp import mesh_from_text


class FakeMesh:
    """What the settings read of a DeviceMesh (its dimensions and their names)."""

    def __init__(self, shape: tuple[int, ...], names: tuple[str, ...] | None) -> None:
        self.shape, self.ndim, self.mesh_dim_names = shape, len(shape), names


def _error(**settings) -> str:
    with pytest.raises(ConfigError) as info:
        Config(**settings).validate()
    return str(info.value)


# -- the forms ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, expected",
    [
        ((2, 2), (2, 2)),
        ([4, -1], (4, -1)),
        ("node", "node"),
        ("2,8", (2, 8)),
        ("-1, 4", (-1, 4)),
        ("NODE", "node"),
    ],
)
def test_mesh_forms_validate(value, expected):
    assert Config(backend="fsdp", fsdp_mesh=value).validate().fsdp_mesh == expected


def test_mesh_from_text_variable_yaml_and_flag(clean_env, tmp_path):
    assert mesh_from_text("2,4", "GRADSYNC_FSDP_MESH") == (2, 4)
    assert mesh_from_text(" node ", "GRADSYNC_FSDP_MESH") == "node"
    assert from_env({"GRADSYNC_FSDP_MESH": "-1,2"}) == {"fsdp_mesh": (-1, 2)}
    path = tmp_path / "c.yaml"
    path.write_text("backend: fsdp\nfsdp_mesh: [2, 2]\n")
    assert load_config(config_file=path).fsdp_mesh == (2, 2)
    args = build_parser().parse_args(["launch", "--backend", "fsdp", "--fsdp-mesh", "2,2", "x.py"])
    assert launch_config(args).fsdp_mesh == (2, 2)
    with pytest.raises(ConfigError, match=r"GRADSYNC_FSDP_MESH='2;2' is not a mesh; give 'R,S'"):
        mesh_from_text("2;2", "GRADSYNC_FSDP_MESH")


def test_a_user_device_mesh_passes_with_names():
    mesh = FakeMesh((2, 2), ("replicate", "shard"))
    assert Config(backend="fsdp", fsdp_mesh=mesh).validate().fsdp_mesh is mesh


# -- bad input: each a ConfigError naming the value and the fix --------------------------------
@pytest.mark.parametrize(
    "value, words",
    [
        ((0, 4), ["(0, 4)", "not positive", "R x S = the world size"]),
        ((-2, 2), ["(-2, 2)", "not positive"]),
        ((-1, -1), ["(-1, -1)", "two -1", "only one can be inferred"]),
        ((2, 2, 1), ["(2, 2, 1)", "two whole numbers"]),
        ((2.0, 2), ["two whole numbers"]),
        ("rack", ["'rack'", "give 'R,S'"]),
        (FakeMesh((2, 2), None), ["no dimension names", "mesh_dim_names=('replicate', 'shard')"]),
        (FakeMesh((2, 2, 2), ("a", "b", "c")), ["3 dimensions", "(replicate, shard)"]),
    ],
)
def test_bad_mesh_values_are_refused(value, words):
    text = _error(backend="fsdp", fsdp_mesh=value)
    for word in words:
        assert word in text, text


@pytest.mark.parametrize("backend", ["ddp", "single", "deepspeed", "auto"])
def test_a_mesh_on_another_backend_is_refused(backend):
    text = _error(backend=backend, fsdp_mesh=(2, 2))
    assert f"backend={backend!r}" in text and "use backend='fsdp'" in text, text


@pytest.mark.parametrize("backend", ["ddp", "single", "deepspeed", "fairscale", "auto"])
def test_defer_replicate_on_another_backend_is_refused(backend):
    text = _error(backend=backend, sync_policy="defer_replicate")
    assert (
        "defer_replicate" in text and f"backend={backend!r}" in text and "fsdp_mesh=(R, S)" in text
    ), text


def test_unknown_policy_names_the_choices():
    assert "defer_replicate" in _error(sync_policy="defer_replica")


@pytest.mark.parametrize(
    "spec, world, words",
    [
        ((2, 2), 8, ["(2, 2)", "2 x 2 = 4", "world has 8", "(-1, 2)"]),
        ((3, -1), 8, ["3 does not divide the world of 8"]),
        ((-1, 3), 8, ["3 does not divide"]),
        ("node", 6, ["'node'", "4 processes of a node", "world of 6"]),
    ],
)
def test_mesh_product_against_the_world(spec, world, words):
    with pytest.raises(ConfigError) as info:
        mesh_shape(spec, world, 4)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_mesh_shapes():
    assert mesh_shape(None, 8, 4) == (1, 8)
    assert mesh_shape((2, 4), 8, 4) == (2, 4)
    assert mesh_shape((-1, 4), 8, 4) == (2, 4)
    assert mesh_shape((2, -1), 8, 4) == (2, 4)
    assert mesh_shape("node", 128, 8) == (16, 8)
    assert mesh_shape("node", 4, 4) == (1, 4)  # one node: 1-D
    assert not crosses_nodes(4, 8) and not crosses_nodes(1, 3) and not crosses_nodes(8, 8)
    assert crosses_nodes(3, 8) and crosses_nodes(16, 8)


def _launched(monkeypatch, world: int, per_node: int) -> None:
    """The launch environment of a rank of ``world`` (no process group is formed)."""
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": str(per_node),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(key, value)


def test_setup_refuses_a_mesh_that_does_not_fit_before_any_collective(clean_env):
    _launched(clean_env, 8, 4)
    backend = fsdp.FSDPBackend()
    with pytest.raises(
        ConfigError, match=r"fsdp_mesh=\(2, 2\) holds 2 x 2 = 4 processes, but the world has 8"
    ):
        backend.setup(Config(backend="fsdp", fsdp_mesh=(2, 2)).validate())
    assert not torch.distributed.is_initialized()  # refused before the group was formed


@pytest.mark.parametrize("mesh", [None, (1, 4), (1, -1), "node"])
def test_defer_replicate_on_a_1d_mesh_is_refused_at_setup(clean_env, mesh):
    _launched(clean_env, 4, 4)
    config = Config(backend="fsdp", sync_policy="defer_replicate", fsdp_mesh=mesh).validate()
    with pytest.raises(
        ConfigError, match="has one replica .* give fsdp_mesh=\\(R, S\\) with R > 1"
    ):
        fsdp.FSDPBackend().setup(config)
    assert not torch.distributed.is_initialized()


def test_keep_params_with_defer_replicate_is_refused(clean_env):
    config = Config(
        backend="fsdp", sync_policy="defer_replicate", fsdp_keep_params_in_window=True
    ).validate()
    with pytest.raises(ConfigError, match="sync_policy='defer_replicate' reduces every micro-step"):
        fsdp.FSDPBackend().setup(config)


def test_shards_crossing_nodes_warn(clean_env, caplog):
    _launched(clean_env, 12, 4)
    backend = fsdp.FSDPBackend()
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        assert backend._mesh_shape((2, 6)) == (2, 6)
    assert "does not divide the 4 processes per node: shard groups cross nodes" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        assert backend._mesh_shape((3, 4)) == (3, 4)
    assert not caplog.text


def test_accelerator_refuses_before_a_group(clean_env):
    with pytest.raises(ConfigError, match="backend='ddp'"):
        Accelerator(backend="ddp", fsdp_mesh=(2, 2))


# -- auto: S-aware arithmetic ------------------------------------------------------------------
GRADS, PARAMS = 1000, 1000  # bytes of the full fp32 gradients / parameters of the model below


def _model() -> nn.Module:
    return nn.Linear(25, 10, bias=False)  # 250 parameters: 1000 bytes in fp32


def test_costs_divide_by_the_shards_not_the_world():
    model = _model()
    # R = 2, S = 2 on 4 ranks: the shard is 1/2, not 1/4
    assert fsdp.deferral_cost(model, 2, grad_bytes=None, keep_params=False) == GRADS - GRADS // 2
    assert fsdp.deferral_cost(model, 2, grad_bytes=None, keep_params=True) == 1000 - 500 + 1000
    assert partial_cost(model, 2, grad_bytes=None) == 500
    assert partial_cost(model, 8, grad_bytes=None) == 125
    assert partial_cost(model.to(torch.bfloat16), 2, grad_bytes=4) == 500  # fp32 reduction


def _decide(asked: str, budget: int, replicas: int = 2, shards: int = 2):
    model = _model()
    grads = fsdp.deferral_cost(model, shards, grad_bytes=None, keep_params=False)
    full = fsdp.deferral_cost(model, shards, grad_bytes=None, keep_params=True)
    return decide(
        asked,
        None,
        False,
        grads=grads,
        full=full,
        budget=Budget(budget, "test"),
        world=shards,
        replicas=replicas,
        partial=partial_cost(model, shards, grad_bytes=None),
    )


def test_auto_on_a_2d_mesh_picks_by_the_budget():
    policy, keep, extra, reason = _decide("auto", 10**6)
    assert (policy, keep, extra) == ("defer", "window", 1500), reason
    policy, keep, extra, reason = _decide("auto", 600)  # gradients (500) fit, parameters too not
    assert (policy, keep, extra) == ("defer", "no", 500), reason
    policy, keep, extra, reason = _decide(
        "auto", 499, shards=4, replicas=2
    )  # grads 750 > 499 >= 250
    assert (policy, keep, extra) == ("defer_replicate", "no", 250), reason
    assert (
        reason.startswith("auto -> defer_replicate:")
        and "250 bytes" in reason
        and "1/4 of the gradients" in reason
    )
    assert "exceeds the budget" in reason and "across the 2 replicas" in reason
    policy, _, extra, reason = _decide("auto", 100, shards=4)
    assert (policy, extra) == ("every_step", 0) and "both exceed the budget" in reason, reason


def test_auto_on_a_1d_mesh_never_picks_defer_replicate():
    policy, _, _, reason = _decide("auto", 499, replicas=1, shards=4)
    assert policy == "every_step" and "defer_replicate" not in reason, reason


def test_defer_replicate_requested_says_what_it_holds():
    policy, keep, extra, reason = _decide("defer_replicate", 0)
    assert (policy, keep, extra) == ("defer_replicate", "no", 500)
    assert reason.startswith("defer_replicate (requested): ") and "500 bytes" in reason


def test_the_launcher_takes_a_mesh_of_numbers(clean_env):
    """--fsdp-mesh R,S passes the launcher's check (its type also allows "node")."""
    from pathlib import Path

    from gradsync.cli import main

    script = Path(__file__).resolve().parents[2] / "examples" / "train.py"
    assert (
        main(
            [
                "launch",
                "--dry-run",
                "--nproc-per-node",
                "4",
                "--backend",
                "fsdp",
                "--fsdp-mesh",
                "2,2",
                str(script),
            ]
        )
        == 0
    )
