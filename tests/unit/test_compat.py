"""Every private torch / DeepSpeed attribute gradsync reaches, reached once here on the
installed versions (one process, a 1-rank gloo group), and the error a missing one gives.

DeepSpeed's need a real engine; the 2-rank tests in test_deepspeed.py reach each of them:
``clear_window_gradients`` (test_a_dropped_window_leaks_nothing), ``set_clipping``
(test_clipping_*), ``can_coalesce`` (the ``defer`` scenarios), ``full_gradient_bytes``
(test_auto_coalesces_zero_2_3_when_the_gradients_fit_the_budget, ZeRO 2 and 3) and
``flat_fp32_masters`` (test_bf16_within_tolerance on stage 0). The scaler's inf check and
``torch.compile``'s ``_orig_mod`` are reached here too, and in tests/multiprocess/test_amp.py and
tests/multiprocess/test_compile.py.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import RandomSampler

from gradsync import _torch_compat
from gradsync.backends import _deepspeed_compat

from scenarios.common import make_model


class Bare:
    """An object without any of the attributes the compat modules look for."""


def test_missing_torch_attribute_names_the_supported_versions():
    with pytest.raises(RuntimeError) as err:
        _torch_compat.sampler_num_samples(Bare())  # type: ignore[arg-type]
    message = str(err.value)
    assert "Bare._num_samples" in message
    assert f"torch {torch.__version__} does not have" in message
    assert f"supports torch {_torch_compat.SUPPORTED_TORCH}" in message


def test_missing_fsdp_attribute_names_the_supported_versions():
    from gradsync.backends import _fsdp_compat

    with pytest.raises(
        RuntimeError, match=r"FSDP2 .*Bare\.fsdp_params.*supports torch 2\.6 to 2\.13"
    ):
        _fsdp_compat._require(Bare(), "fsdp_params", "parameters of a group")


def test_missing_deepspeed_attribute_names_the_supported_versions():
    class Engine:
        optimizer = Bare()

    with pytest.raises(
        RuntimeError,
        match=r"deepspeed's engine config \(Engine\._config\).*supports deepspeed 0\.19",
    ):
        _deepspeed_compat.set_clipping(Engine(), 1.0)
    assert not _deepspeed_compat.can_coalesce(Engine())


def test_random_sampler_num_samples():
    data = list(range(10))
    assert _torch_compat.sampler_num_samples(RandomSampler(data)) is None
    assert _torch_compat.sampler_num_samples(RandomSampler(data, num_samples=4)) == 4


def test_single_tensor_collectives_of_the_wrapped_group():
    from torch._C._distributed_c10d import AllgatherOptions, ReduceScatterOptions

    store = dist.HashStore()
    pg = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=30))
    inp = torch.arange(4.0)
    out = torch.empty(4)
    _torch_compat.allgather_base(pg, out, inp, AllgatherOptions()).wait()
    assert torch.equal(out, inp)
    red = torch.empty(4)
    _torch_compat.reduce_scatter_base(pg, red, inp, ReduceScatterOptions()).wait()
    assert torch.equal(red, inp)


def test_nccl_options_timeout():
    if not hasattr(dist, "ProcessGroupNCCL"):
        pytest.skip(
            "this torch has no NCCL (CPU build); tests/multiprocess/test_gpu.py covers it on GPUs"
        )
    opts = dist.ProcessGroupNCCL.Options()
    _torch_compat.set_nccl_timeout(opts, timedelta(seconds=7))
    assert opts._timeout == timedelta(seconds=7)


def test_fsdp2_flags_unsharded_grads_and_sizes(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsync.backends import _fsdp_compat

    from scenarios.common import make_model

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    model = make_model()
    sizes = [p.numel() for p in model.parameters()]
    mesh = init_device_mesh("cpu", (1,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert [_fsdp_compat.unsharded_numel(p) for p in model.parameters()] == sizes
    groups = list(_fsdp_compat.param_groups(model))
    assert len(groups) == 3  # the two blocks and the root's own parameters

    before = _fsdp_compat.save_flags(model)
    assert [flags[1:3] for flags in before] == [(True, True)] * 3
    model.set_requires_gradient_sync(False)
    assert all(not g.reduce_grads for g in groups)
    model(torch.randn(2, 8)).sum().backward()
    held = [
        fp
        for g in groups
        for fp in g.fsdp_params
        if fp.unsharded_accumulated_grad is not None or fp._unsharded_param.grad is not None
    ]
    assert held, "a deferred backward leaves unsharded gradients inside FSDP2"
    _fsdp_compat.clear_unsharded_grads(model)
    assert all(
        fp.unsharded_accumulated_grad is None and fp._unsharded_param.grad is None
        for g in groups
        for fp in g.fsdp_params
    )
    _fsdp_compat.restore_flags(before)
    assert [flags[1:3] for flags in _fsdp_compat.save_flags(model)] == [(True, True)] * 3


def test_fsdp2_keep_gathered_lazy_init_and_reshard(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsync.backends import _fsdp_compat

    from scenarios.common import make_model

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    model = make_model()
    mesh = init_device_mesh("cpu", (1,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    groups = list(_fsdp_compat.param_groups(model))  # the root's first, then the blocks'
    assert all(g.post_forward_mesh_info is not None for g in groups)
    _fsdp_compat.lazy_init(model)  # what the first forward would do: the root stops resharding
    saved = _fsdp_compat.save_flags(model)
    assert [flags[4] is None for flags in saved] == [True, False, False]
    _fsdp_compat.keep_gathered(model, after_forward=True, after_backward=True)
    assert all(g.post_forward_mesh_info is None and not g.reshard_after_backward for g in groups)
    model(torch.randn(2, 8)).sum().backward()
    assert all(g.is_unsharded for g in groups), "kept gathered through forward and backward"
    _fsdp_compat.restore_flags(saved)
    assert _fsdp_compat.save_flags(model) == saved
    _fsdp_compat.reshard(model)
    assert not any(g.is_unsharded for g in groups)


def test_ddp_unfinished_reduction_message_names_the_parameters(tmp_path):
    """torch's own error text, from a real 1-rank DDP whose `side` head got no gradient."""
    from torch import nn

    from gradsync.backends import _ddp_compat

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.head = nn.Linear(4, 1)
            self.side = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    model = nn.parallel.DistributedDataParallel(Two())
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError) as err:
        model(torch.randn(2, 4))
    assert _ddp_compat.is_unfinished_reduction(err.value)
    assert _ddp_compat.unused_parameters(str(err.value), model.module) == (
        0,
        ["side.weight", "side.bias"],
    )
    # the names torch gives under TORCH_DISTRIBUTED_DEBUG=INFO, and a format it no longer has
    named = "... Parameters which did not receive grad for rank 1: side.weight, side.bias\n..."
    assert _ddp_compat.unused_parameters(named, model.module) == (1, ["side.weight", "side.bias"])
    assert _ddp_compat.unused_parameters(
        "Expected to have finished reduction in the prior iteration", model.module
    ) == (None, None)
    assert not _ddp_compat.is_unfinished_reduction(RuntimeError("something else"))


def test_ddp_reducer_order_skips_frozen_ignored_and_shared():
    from torch import nn

    from gradsync.backends._ddp_compat import reducer_parameter_names

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].weight.requires_grad_(False)
    model[2].weight = model[0].weight  # shared: counted once, where it appears first
    assert reducer_parameter_names(model, frozenset({"2.bias"})) == ["0.weight", "0.bias", "1.bias"]


def test_compat_scaler_found_inf_and_uncompiled():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(F.mse_loss(model(torch.randn(2, 8)), torch.randn(2, 1))).backward()
    scaler.unscale_(opt)
    assert _torch_compat.scaler_found_inf(scaler, opt) is False
    next(model.parameters()).grad.view(-1)[0] = float("nan")
    scaler.update()
    scaler.unscale_(opt)
    assert _torch_compat.scaler_found_inf(scaler, opt) is True
    compiled = torch.compile(model)  # wrapping only: nothing is compiled yet
    assert _torch_compat.uncompiled(compiled) is model
    assert _torch_compat.uncompiled(model) is model


def test_compat_scaler_names_what_is_missing():
    with pytest.raises(
        RuntimeError, match=r"GradScaler's per-optimizer inf check \(Bare\._found_inf_per_device\)"
    ):
        _torch_compat.scaler_found_inf(Bare(), torch.optim.SGD(make_model().parameters(), lr=0.1))  # type: ignore[arg-type]
