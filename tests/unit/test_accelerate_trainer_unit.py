"""What Transformers' Trainer hands ``gradsync.accelerate.Accelerator`` (its own
``TorchDynamoPlugin`` and ``DistributedDataParallelKwargs``, ``accelerator._models``) and how
it accumulates (``gradient_state._set_sync_gradients``, ``no_sync`` on all but the last
micro-batch, ``optimizer.step()``), on one process. The Trainer itself, on 2 ranks under both
libraries: tests/multiprocess/test_trainer.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradsync import ConfigError
from gradsync.accelerate import Accelerator
from gradsync.accelerate.config import translate

accelerate_utils = pytest.importorskip("accelerate.utils")


def _translate(**kw: object) -> dict[str, object]:
    args: dict[str, object] = {
        "split_batches": None,
        "cpu": False,
        "dataloader_config": None,
        "project_dir": None,
        "project_config": None,
        "gradient_accumulation_steps": 1,
        "gradient_accumulation_plugin": None,
        "kwargs_handlers": None,
        "dynamo_backend": None,
    }
    args.update(kw)
    return translate(**args).settings  # type: ignore[arg-type]


def test_a_dynamo_plugin_compiles_only_with_a_backend():
    plugin = accelerate_utils.TorchDynamoPlugin
    assert "compile" not in _translate(dynamo_plugin=plugin(backend="no"))
    assert _translate(dynamo_plugin=plugin(backend="inductor", mode="reduce-overhead"))[
        "compile"
    ] == {"backend": "inductor", "mode": "reduce-overhead", "fullgraph": False}
    with pytest.raises(ConfigError, match="dynamo_backend and dynamo_plugin"):
        _translate(dynamo_backend="inductor", dynamo_plugin=plugin(backend="inductor"))


def test_accelerates_own_kwargs_handlers_are_read():
    handler = accelerate_utils.DistributedDataParallelKwargs(
        find_unused_parameters=True, bucket_cap_mb=10, comm_hook="fp16"
    )
    found = _translate(kwargs_handlers=[handler])
    assert found["ddp_kwargs"] == {"find_unused_parameters": True, "bucket_cap_mb": 10}
    assert found["comm_hook"] == "fp16"
    timeout = accelerate_utils.InitProcessGroupKwargs(timeout=__import__("datetime").timedelta(9))
    assert _translate(kwargs_handlers=[timeout])["timeout"] == 9 * 86400


def test_a_handler_gradsync_does_not_take_is_named_with_its_module():
    class DistributedDataParallelKwargsLike:
        pass

    with pytest.raises(ConfigError) as err:
        _translate(kwargs_handlers=[DistributedDataParallelKwargsLike()])
    assert f"got a {__name__}." in str(err.value)
    assert "(gradsync.accelerate.utils' or Accelerate's)" in str(err.value)


def _trainer_like(clean_env, windows: list[int]):
    """A loop written as the Trainer writes it; returns the audit's windows (boundary flags)
    and the optimizer steps applied."""
    accel = Accelerator(backend="single", audit=True)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert accel._models == []
    model, optimizer = accel.prepare(model, optimizer)
    assert accel._models == [model]
    for size in windows:
        for i in range(size):
            last = i == size - 1
            accel.gradient_state._set_sync_gradients(last)
            assert accel.gradient_state.sync_gradients is last
            ctx = torch.enable_grad() if last else accel.no_sync(model)
            with ctx:
                loss = model(torch.ones(2, 3)).pow(2).mean() / size
                accel.backward(loss)
            if last:
                optimizer.step()
                model.zero_grad()
    assert accel.audit is not None
    found = [[r.boundary for r in w] for w in accel.audit.windows()]
    steps = accel.optimizer_steps
    accel.end()
    return found, steps


def test_the_trainers_declared_windows_are_gradsyncs(clean_env):
    found, steps = _trainer_like(clean_env, [4, 1, 3])
    # each micro-batch is a micro-step; the last backward, outside no_sync, closes its
    # window, also a window of one
    assert found == [[False, False, False, True], [True], [False, False, True]]
    assert steps == 3


def test_a_model_evaluated_before_training_is_prepared_when_training_starts(clean_env):
    accel = Accelerator(backend="single")
    model = nn.Linear(3, 1)
    try:
        assert accel.prepare_model(model, evaluation_mode=True) is model  # placed only
        assert accel._models == []
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accel.prepare(model, optimizer)  # what Trainer.train() then does
        assert accel._models == [model]
    finally:
        accel.end()
