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

import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import RandomSampler

from gradsync._support import torch_compat as _torch_compat
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
        RuntimeError,
        match=rf"FSDP2 .*Bare\.fsdp_params.*supports torch {re.escape(_torch_compat.SUPPORTED_TORCH)}",
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


# -- what gradsync relies on in FSDP2's private state, not only that it exists ---------------


def _one_rank_fsdp(tmp_path, shape=(1,)):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    names = ("replicate", "shard") if len(shape) == 2 else None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)

    def sharded():
        torch.manual_seed(1)
        model = make_model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    return mesh, sharded


def _local_grads(model):
    return [p.grad.to_local().clone() for p in model.parameters()]


def test_fsdp2_flags_gradsync_writes_are_plain_settable_attributes(tmp_path):
    """restore_flags writes these four per group: none may become a read-only property."""
    from gradsync.backends import _fsdp_compat

    _, sharded = _one_rank_fsdp(tmp_path)
    for group in _fsdp_compat.param_groups(sharded()):
        for name in (
            "reduce_grads",
            "all_reduce_grads",
            "reshard_after_backward",
            "post_forward_mesh_info",
            "_partial_reduce_output",
        ):
            found = getattr(type(group), name, None)
            assert not isinstance(found, property) or found.fset is not None, name
            assert name in vars(group), f"{name} is no longer the group's own attribute"


def test_fsdp2_window_gradients_live_where_the_compat_module_says(tmp_path):
    """Before torch 2.15 a deferred window's gradients may sit in ``unsharded_accumulated_grad``,
    a settable buffer; from 2.15 it is a read-only view of the unsharded parameter's ``.grad``.
    ``grads_live_on_leaf`` must tell which, and writing follows it."""
    from gradsync.backends import _fsdp_compat

    _, sharded = _one_rank_fsdp(tmp_path)
    model = sharded()
    model.set_requires_gradient_sync(False)
    model(torch.randn(2, 8)).sum().backward()
    for fp in (fp for g in _fsdp_compat.param_groups(model) for fp in g.fsdp_params):
        if _fsdp_compat.grads_live_on_leaf(fp):
            assert fp.unsharded_accumulated_grad is fp._unsharded_param.grad
            assert fp._unsharded_param.grad is not None
            with pytest.raises(AttributeError):
                fp.unsharded_accumulated_grad = None
        else:
            assert "unsharded_accumulated_grad" in vars(fp), "a settable attribute of its own"


def test_fsdp2_window_gradients_restore_into_a_freshly_loaded_model(tmp_path):
    """A mid-window load gives the window's gradients to a model that never ran a forward
    (torch 2.15 on: no unsharded parameter exists yet to hold them); the boundary then
    reduces exactly what the uninterrupted window reduces."""
    from gradsync.backends import _fsdp_compat

    _, sharded = _one_rank_fsdp(tmp_path)
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    plain, first, fresh = sharded(), sharded(), sharded()
    for model in (plain, first):
        model.set_requires_gradient_sync(False)
        model(x1).sum().backward()
    saved = _fsdp_compat.window_grads(first)
    assert all(g is not None for g in saved)
    _fsdp_compat.clear_unsharded_grads(first)
    assert all(g is None for g in _fsdp_compat.window_grads(first)), "a dropped window leaves none"
    _fsdp_compat.put_window_grads(fresh, saved, torch.device("cpu"))
    for model in (plain, fresh):
        model.set_requires_gradient_sync(True)
        model(x2).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(_local_grads(plain), _local_grads(fresh)))


def _partial_window(sharded, restore):
    """An HSDP window whose all-reduce is deferred, broken off after its first micro-step and
    given to a fresh model by ``restore(first, fresh)``; -> (uninterrupted, restored) grads."""
    from gradsync.backends import _fsdp_compat

    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    plain, first, fresh = sharded(), sharded(), sharded()
    for model in (plain, first):
        model.set_requires_all_reduce(False)
        model(x1).sum().backward()
    assert all(b is not None for b in _fsdp_compat.partial_buffers(first))
    restore(first, fresh)
    for model in (plain, fresh):
        model.set_requires_all_reduce(True)
        model(x2).sum().backward()
    return _local_grads(plain), _local_grads(fresh)


def test_hsdp_partial_buffers_restore_with_their_layout(tmp_path):
    """The partial buffers and their layout (torch 2.15 on), saved and given to a fresh model:
    the boundary adds exactly what the uninterrupted window held, with the saved layout and
    with the in-order layout derived for a buffer saved without one."""
    from gradsync.backends import _fsdp_compat

    _, sharded = _one_rank_fsdp(tmp_path, (1, 1))
    cpu = torch.device("cpu")
    for with_layout in (True, False):

        def restore(first, fresh, with_layout=with_layout):
            layouts = _fsdp_compat.partial_layouts(first) if with_layout else None
            buffers = _fsdp_compat.partial_buffers(first)
            _fsdp_compat.reset_iter_state(first)
            assert all(b is None for b in _fsdp_compat.partial_buffers(first))
            _fsdp_compat.put_partial_buffers(fresh, buffers, cpu, layouts)

        plain, restored = _partial_window(sharded, restore)
        assert all(torch.equal(a, b) for a, b in zip(plain, restored)), with_layout


def test_hsdp_a_partial_buffer_without_its_layout_is_what_torch_drops(tmp_path):
    """Why the layout is saved: where torch keeps one (2.15 on), a buffer put back alone is
    repacked into zeros and the window's cross-replica sums are lost. Where it keeps none, the
    buffer alone is the whole state. A torch that changes either fails here by name."""
    from gradsync.backends import _fsdp_compat

    _, sharded = _one_rank_fsdp(tmp_path, (1, 1))
    keeps_layout = any(
        hasattr(g, "_partial_reduce_output_layout") for g in _fsdp_compat.param_groups(sharded())
    )

    def buffer_alone(first, fresh):
        for mine, theirs in zip(_fsdp_compat.param_groups(fresh), _fsdp_compat.param_groups(first)):
            mine._partial_reduce_output = theirs._partial_reduce_output.clone()

    plain, restored = _partial_window(sharded, buffer_alone)
    same = all(torch.equal(a, b) for a, b in zip(plain, restored))
    assert same is not keeps_layout


# -- what the pipeline relies on in torch.distributed.pipelining and FSDP2 ------------------


def _one_stage(tmp_path):
    """A 1-stage pipeline on a 1-rank gloo group: an FSDP2-sharded Sequential, its whole copy."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    _one_rank_fsdp(tmp_path)

    torch.manual_seed(3)
    whole = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    stage = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    stage.load_state_dict(whole.state_dict())
    fully_shard(stage[0])
    fully_shard(stage)
    return whole, stage


def _sse(out, y):
    return (out - y).pow(2).sum()


def test_pipeline_stage_hooks_are_the_methods_torch_schedules_call(tmp_path):
    """gradsync's stage replaces ``perform_reduce_grad``, which torch's schedules must call
    once per schedule step with scale 1 (scale_grads=False), and, where torch has it,
    ``_post_metadata_inference_cleanup``, called once on the first step, after torch's own
    drops the FSDP2 gradients (which is why gradsync puts a resumed window's back). On any
    torch a gradient held before the first step survives it. A torch that renames either
    runs its own instead: the counts or the gradients here fail."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from gradsync.backends import _pipeline_compat

    for name, _ in _pipeline_compat.HOOKS:
        assert callable(getattr(PipelineStage, name, None)), name
    cleans = callable(getattr(PipelineStage, _pipeline_compat.CLEANUP, None))
    _, stage = _one_stage(tmp_path)
    calls: list[str] = []
    held: list[bool] = []
    before = {p: torch.full_like(p, 0.5) for p in stage.parameters()}

    def cleanup():
        calls.append("cleanup")
        held.append(any(p.grad is not None for p in stage.parameters()))
        for p, grad in before.items():  # what gradsync's pipeline does: put them back
            p.grad = grad

    for p, grad in before.items():  # gradients from before the first step (a resumed window)
        p.grad = grad
    built = _pipeline_compat.Stage(
        lambda: calls.append("reduce"), cleanup, stage, 0, 1, torch.device("cpu")
    )
    schedule = ScheduleGPipe(built, n_microbatches=2, loss_fn=_sse, scale_grads=False)
    schedule.step(torch.randn(4, 8), target=torch.randn(4, 1), losses=[])
    assert all(p.grad is grad for p, grad in before.items()), "not dropped"
    schedule.step(torch.randn(4, 8), target=torch.randn(4, 1), losses=[])
    if cleans:
        assert calls == ["cleanup", "reduce", "reduce"]
        assert held == [False], "torch's cleanup drops the stage's gradients"
    else:  # torch 2.10: shapes inferred without a forward and backward, nothing dropped
        assert calls == ["reduce", "reduce"]
    _pipeline_compat.check_hooks()
    with pytest.raises(RuntimeError, match=r"pipelining .*Bare\.perform_reduce_grad"):
        _pipeline_compat._require(Bare(), "perform_reduce_grad", "end of a backward")


def test_pipeline_backward_ends_with_the_flags_gradsync_chose(tmp_path):
    """``end_pipeline_backward`` (FSDP2's ``_state_ctx.all_states``, each group's
    ``post_backward`` and the root's ``_root_post_backward_final_callback``): a schedule step
    with gradient sync off keeps its gradients unsharded and reshards; the next, with sync on,
    reduces both steps' gradients once, equal to the whole model's on both batches."""
    from torch import nn

    from gradsync.backends import _fsdp_compat, _pipeline, _pipeline_sync

    whole, stage = _one_stage(tmp_path)
    pipeline = _pipeline.Pipeline(
        stage,
        index=0,
        stages=1,
        device=torch.device("cpu"),
        group=None,
        schedule="1F1B",
        microbatches=2,
        sync=_pipeline_sync.FSDPSync(),
        names=list(stage.state_dict()),
    )
    batches = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(2)]
    stage.set_requires_gradient_sync(False)
    pipeline.step(*batches[0], _sse, 1.0)
    assert all(p.grad is None for p in stage.parameters()), "nothing reduced off the boundary"
    assert all(g is not None for g in _fsdp_compat.window_grads(stage))
    assert not any(g.is_unsharded for g in _fsdp_compat.param_groups(stage)), "resharded"
    stage.set_requires_gradient_sync(True)
    pipeline.step(*batches[1], _sse, 1.0)
    state = stage._get_fsdp_state()  # the root's: its context lists every module's state
    assert {id(s) for s in state._state_ctx.all_states} == {
        id(m._get_fsdp_state()) for m in (stage, stage[0])
    }
    assert all(callable(g.post_backward) for g in _fsdp_compat.param_groups(stage))
    assert callable(state._root_post_backward_final_callback)
    for x, y in batches:
        _sse(whole(x), y).backward()
    for got, want in zip(stage.parameters(), whole.parameters()):
        torch.testing.assert_close(got.grad.full_tensor(), want.grad, rtol=1e-5, atol=1e-6)
    assert not any(isinstance(m, nn.Linear) and m.weight.grad is None for m in stage)


def test_a_ddp_stage_all_reduces_in_its_last_backward_only_when_told(tmp_path):
    """torch's ``backward_maybe_with_nosync`` on a stage wrapped in DDP: with
    ``last_backward`` false it runs under ``no_sync()`` (nothing all-reduced, the gradients
    add up), with it true DDP's reducer all-reduces in that backward, even under the
    micro-step's ``no_sync()``. gradsync's stage passes it true only when the micro-step
    syncs; a torch that changed either meaning fails the counts here."""
    from torch import nn
    from torch.distributed.pipelining import ScheduleGPipe
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradsync.backends import _pipeline_compat

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    torch.manual_seed(3)
    ddp = DDP(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)))
    reduced: list[int] = []

    def count(state, bucket):  # DDP's all-reduce, counted (one rank: the mean is the sum)
        reduced.append(bucket.buffer().numel())
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp.register_comm_hook(None, count)
    told = [False]
    built = _pipeline_compat.Stage(
        lambda: None, lambda: None, ddp, 0, 1, torch.device("cpu"), reduces=lambda: told[0]
    )
    schedule = ScheduleGPipe(built, n_microbatches=2, loss_fn=_sse, scale_grads=False)
    batches = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(3)]
    with ddp.no_sync():  # gradsync's micro-step off the boundary
        schedule.step(batches[0][0], target=batches[0][1], losses=[])
    assert reduced == [] and all(p.grad is not None for p in ddp.parameters())
    with ddp.no_sync():  # the last backward told to reduce: DDP does, under no_sync too
        told[0] = True
        schedule.step(batches[1][0], target=batches[1][1], losses=[])
    assert sum(reduced) == sum(p.numel() for p in ddp.parameters()), reduced
    whole = ddp.module
    grads = [p.grad.clone() for p in whole.parameters()]
    for p in whole.parameters():
        p.grad = None
    for x, y in batches[:2]:
        _sse(whole(x), y).backward()
    for got, want in zip(grads, whole.parameters()):
        torch.testing.assert_close(got, want.grad, rtol=1e-5, atol=1e-6)
