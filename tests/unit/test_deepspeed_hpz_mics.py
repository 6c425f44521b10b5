"""DeepSpeed's removed MiCS keys and ZeRO++ hpZ's group size, refused when the Accelerator is
built: in this process, before any process group exists (the hpZ runs on 4 ranks:
multiprocess/test_deepspeed_hpz.py)."""

from __future__ import annotations

import pytest

from gradsync import Accelerator, ConfigError
from gradsync.backends._deepspeed_config import MICS_KEYS, check_hpz, check_removed_keys

deepspeed = pytest.importorskip("deepspeed")


def _refusal(ds: dict) -> str:
    with pytest.raises(ConfigError) as err:
        Accelerator(backend="deepspeed", deepspeed_config=ds)
    message = str(err.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    ("key", "value"), [("mics_shard_size", 8), ("mics_hierarchical_params_gather", True)]
)
def test_a_mics_key_is_deepspeeds_refusal_plus_the_fsdp_mesh_way(clean_env, key, value):
    import torch.distributed as dist

    message = _refusal({"zero_optimization": {"stage": 3, key: value}})
    assert message.startswith(f"deepspeed_config zero_optimization.{key}={value!r}: "), message
    assert "MiCS ZeRO-3 sharding has been removed" in message  # DeepSpeed's own words
    assert "backend='fsdp', fsdp_mesh=(R, S)" in message and "fsdp_mesh='node'" in message
    assert "drop the key" in message
    assert not dist.is_initialized()  # refused before any group


def test_the_mics_keys_are_the_ones_deepspeed_removed():
    """gradsync's list is DeepSpeed's: each key alone is refused by DeepSpeed's own check."""
    from gradsync.backends._deepspeed_compat import removed_key_message

    for key in MICS_KEYS:
        message = removed_key_message({"zero_optimization": {key: 1}})
        assert message is not None and "MiCS" in message, (key, message)
    assert (
        removed_key_message({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}})
        is None
    )


def test_another_removed_key_keeps_deepspeeds_message_without_the_mesh_hint(clean_env):
    message = _refusal({"zero_optimization": {"stage": 3, "zeropp_loco_param": {"err_beta": 0.8}}})
    assert message.startswith("deepspeed_config: LoCo-Zero++ has been removed"), message
    assert "fsdp_mesh" not in message


def test_a_config_without_removed_keys_passes():
    check_removed_keys({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}})
    check_removed_keys({})


@pytest.mark.parametrize(
    ("hpz", "stage", "world"),
    [
        (2, 3, 4),
        (4, 3, 4),
        (8, 3, 4),
        (1, 3, 3),
        (0, 3, 3),
        (3, 2, 4),  # divides, or not ZeRO 3
    ],
)
def test_hpz_sizes_deepspeed_accepts(hpz, stage, world):
    check_hpz({"zero_optimization": {"stage": stage, "zero_hpz_partition_size": hpz}}, stage, world)


def test_an_hpz_size_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ConfigError) as err:
        check_hpz({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}, 3, 4)
    message = str(err.value)
    assert "zero_hpz_partition_size=3 does not divide world_size=4" in message
    assert "use a divisor of 4" in message and "drop the key" in message and "\n" not in message
