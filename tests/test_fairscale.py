"""fairscale (legacy ShardedDataParallel + OSS) on a real 2-rank gloo group, checked against one
process on the same global windows. The tests that need fairscale skip where it is absent."""

from __future__ import annotations

import importlib.util
import re
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gradsync import Accelerator, ConfigError, audit

from harness import run_scenarios
from scenarios.common import (
    DROPS,
    Indexed,
    assert_clipping_matches_one_process,
    assert_dropped_window_leaks_nothing,
    assert_export_is_the_gathered_model,
    assert_matches_one_process,
    assert_mid_window_save_refused,
    make_model,
    make_optimizer,
    make_scheduler,
    max_diff,
    reference,
)

SKIP_REASON = "fairscale is not installed: pip install 'gradsync[fairscale]'"
SAMPLES = 44  # 22 per rank, 11 micro-batches of 2: not a multiple of 4
MICRO = 2
BF16_TOLERANCE = 5e-3  # bf16 autocast against the fp32 reference (measured: see docs/fairscale.md)
GRAD_BYTES = 4 * sum(p.numel() for p in make_model().parameters())
PARAMS = len(list(make_model().parameters()))


def _run(steps: int, policy: str = "auto", **extra):
    return {"fn": "train_fs", "steps": steps, "policy": policy, "samples": SAMPLES, "micro_batch": MICRO, **extra}


ADAM_CLIP = {"optimizer": "adam", "lr": 0.01, "clip": 0.5}
SCENARIOS = {
    "k1": _run(1),
    "k4": _run(4),
    "k4_every_step": _run(4, "every_step"),
    "k4_no_buckets": _run(4, "defer", buckets=False),
    "k4_no_buckets_every_step": _run(4, "every_step", buckets=False),
    "k4_zero_grad_first": _run(4, zero_grad_first=True),
    "k4_after_block": _run(4, after_block=True),
    "k4_to_3": _run(4, change_steps_at=[2, 3]),
    "k4_adam_clip": _run(4, **ADAM_CLIP),
    "k4_every_step_adam_clip": _run(4, "every_step", **ADAM_CLIP),
    "k4_bf16": _run(4, mixed_precision="bf16"),
    **{f"drop_{how}_{policy}{'_no_buckets' if not buckets else ''}": _run(4, policy, buckets=buckets, **kw)
       for how, kw in DROPS.items() for policy in ("defer", "every_step") for buckets in (True, False)},
    # the boundary micro-step of the 2nd window (the 8th) fails inside its backward
    **{f"drop_in_backward_{policy}{'_no_buckets' if not buckets else ''}":
       {**_run(4, policy, buckets=buckets), "fn": "drop_in_backward", "fail_at": 8}
       for policy in ("defer", "every_step") for buckets in (True, False)},
    **{f"abort{'_no_buckets' if not buckets else ''}": {"fn": "abort_clears_the_window", "buckets": buckets}
       for buckets in (True, False)},
    "optimizer_state": {"fn": "optimizer_state", "steps": 4, "samples": SAMPLES, "micro_batch": MICRO,
                        "optimizer": "adam", "lr": 0.01},
    "buckets": {"fn": "grads_stay_in_buckets", "steps": 4},
    "misuse": {"fn": "misuse"},
    "export": {"fn": "export_model"},
    "mid_window_save": {"fn": "mid_window_save"},
}
EQUIV = ["k1", "k4", "k4_every_step", "k4_no_buckets", "k4_no_buckets_every_step",
         "k4_zero_grad_first", "k4_after_block", "k4_to_3"]


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("fairscale", reason=SKIP_REASON)
    return run_scenarios("scenarios.fairscale", SCENARIOS)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", EQUIV)
def test_equivalence_with_one_process(results, name):
    assert_matches_one_process(results[name], samples=SAMPLES)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [n for n in SCENARIOS if n.startswith("drop_")])
def test_a_dropped_window_leaks_nothing(results, name):
    assert_dropped_window_leaks_nothing(results[name], samples=SAMPLES)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["abort", "abort_no_buckets"])
def test_abort_window_clears_the_gradients(results, name):
    for r in results[name]:
        assert r["before"] > 0 and r["after"] == 0.0, r


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["k1", "k4", "k4_every_step"])
def test_windows_include_the_partial_last_one(results, name):
    k = SCENARIOS[name]["steps"]
    per_epoch = [k] * (11 // k) + ([11 % k] if 11 % k else [])
    assert results[name][0]["sizes"] == per_epoch * 2


@pytest.mark.multiprocess
def test_policies_are_resolved_and_explained(results):
    auto = results["k4"][0]
    assert auto["policy"] == "defer" and auto["reason"].startswith("auto -> defer")
    assert results["k4_every_step"][0]["policy"] == "every_step"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["k4_adam_clip", "k4_every_step_adam_clip"])
def test_clipping_returns_the_global_norm(results, name):
    assert_clipping_matches_one_process(results[name], SAMPLES)


@pytest.mark.multiprocess
def test_bf16_autocast_is_in_effect_and_close_to_fp32(results):
    ranks = results["k4_bf16"]
    ref = reference(ranks, samples=SAMPLES)
    diff = max_diff(ranks[0]["state"], ref["state"])
    assert 1e-6 < diff < BF16_TOLERANCE, diff
    assert max_diff(ranks[0]["state"], ranks[1]["state"]) == 0.0


def _reductions_at_the_boundary(name: str) -> int:
    """One reduce per owning rank's bucket; without buckets one per parameter."""
    return PARAMS if "no_buckets" in name else 2


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["k4", "k4_no_buckets"])
def test_defer_issues_nothing_off_the_boundary_and_one_reduction_at_it(results, name):
    for r in results[name]:
        records = r["audit"]
        assert len(records) == sum(r["sizes"]), "audit must record every micro-step"
        for rec in records:
            if rec["boundary"]:
                assert rec["reductions"] == rec["ops"]["reduce"] == _reductions_at_the_boundary(name), rec
                assert rec["reduction_bytes"] == GRAD_BYTES, rec
            else:  # no gradient reduction, and no collective of any kind
                assert rec["reductions"] == 0 and rec["bytes"] == 0, rec


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["k4_every_step", "k4_no_buckets_every_step"])
def test_every_step_reduces_on_every_micro_step(results, name):
    for r in results[name]:
        assert any(not rec["boundary"] for rec in r["audit"])
        for rec in r["audit"]:
            assert rec["reductions"] == _reductions_at_the_boundary(name), rec
            assert rec["reduction_bytes"] == GRAD_BYTES, rec


@pytest.mark.multiprocess
def test_the_consolidated_optimizer_state_is_the_full_one(results):
    ranks = results["optimizer_state"]
    ref_state = _reference_optimizer_state(ranks)
    held = [set(r["held"]) for r in ranks]
    assert held[0] and held[1] and not held[0] & held[1], "each rank keeps its own shard"
    assert len(held[0] | held[1]) == PARAMS
    assert_matches_one_process(ranks, samples=SAMPLES, optimizer="adam", lr=0.01)
    for r in ranks:
        assert sorted(r["consolidated"], key=int) == [str(i) for i in range(PARAMS)]
        for i, state in r["consolidated"].items():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                ref = torch.as_tensor(ref_state[int(i)][key], dtype=torch.float32)
                assert float((torch.tensor(state[key]) - ref).abs().max()) < 1e-5, (i, key)
        assert r["intact_after_load"], "load_state_dict must leave the caller's dict intact"
        assert r["reloaded"] == r["consolidated"]
        assert r["reloaded_lr"] == r["lr"] != 0.5


def _reference_optimizer_state(ranks):
    """Adam's state after one process trained on the same windows, as ``reference`` trains."""
    data = Indexed(SAMPLES)
    model = make_model()
    opt = make_optimizer(model.parameters(), "adam", 0.01)
    sched = make_scheduler(opt)
    for w in range(len(ranks[0]["windows"])):
        micro = [mb for r in ranks for mb in r["windows"][w]]
        opt.zero_grad()
        loss = sum(F.mse_loss(model(data.x[mb]), data.y[mb]) for mb in micro) / len(micro)
        loss.backward()
        opt.step()
        sched.step()
    return opt.state_dict()["state"]


@pytest.mark.multiprocess
def test_window_clears_keep_gradients_inside_the_reduce_buckets(results):
    for r in results["buckets"]:
        assert r["bucketed"] == r["params"] == PARAMS
        assert r["in_bucket"] == PARAMS


@pytest.mark.multiprocess
def test_misuse_gives_clear_errors(results):
    for m in results["misuse"]:
        assert m["unprepared"].startswith("UsageError") and "not the ShardedDataParallel model" in m["unprepared"]
        assert m["clip_subset"].startswith("ConfigError") and "pass model.parameters()" in m["clip_subset"]
        assert m["no_optimizer"].startswith("ConfigError") and "needs the optimizer" in m["no_optimizer"]
        for key in ("oss", "sdp"):
            assert m[key].startswith("ConfigError") and "pass the plain model and the plain torch optimizer" in m[key]
        assert m["optimizer_with_state"].startswith("ConfigError")
        assert "prepare before the first optimizer step" in m["optimizer_with_state"]
        fsdp = m["fairscale_fsdp"]
        assert fsdp.startswith("ConfigError") and "FullyShardedDataParallel" in fsdp
        assert "backend='fsdp'" in fsdp
        for text in m.values():
            assert "\n" not in text, text


# -- without a process group -----------------------------------------------------------------
def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"sync_policy": "native"}, "sync_policy='native' is DeepSpeed's; with backend='fairscale' use"),
        ({"mixed_precision": "fp16"}, "mixed_precision='fp16' is not supported with backend='fairscale'"),
        ({"fairscale_kwargs": [1]}, "fairscale_kwargs=[1] must be a dict of ShardedDataParallel arguments"),
    ],
)
def test_bad_settings_are_config_errors(clean_env, options, match):
    pytest.importorskip("fairscale", reason=SKIP_REASON)
    with pytest.raises(ConfigError, match=re.escape(match)) as err:
        Accelerator(backend="fairscale", **options)
    _one_line(err.value)


def _forget_the_adapter(monkeypatch):
    for name in ("gradsync.backends.fairscale", "gradsync.backends._fairscale_compat"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_missing_fairscale_says_how_to_install_it(clean_env, monkeypatch):
    _forget_the_adapter(monkeypatch)
    monkeypatch.setitem(sys.modules, "fairscale", None)  # `import fairscale` now fails
    with pytest.raises(ImportError) as err:
        Accelerator(backend="fairscale")
    text = _one_line(err.value)
    assert "backend='fairscale' needs fairscale, which is not installed" in text
    assert "pip install 'gradsync[fairscale]'" in text and "backend='fsdp'" in text


def test_a_fairscale_that_does_not_import_with_this_torch_says_so(clean_env, monkeypatch):
    pytest.importorskip("fairscale", reason=SKIP_REASON)
    _forget_the_adapter(monkeypatch)
    monkeypatch.setitem(sys.modules, "fairscale.optim", None)  # as if it failed to import
    with pytest.raises(ImportError) as err:
        Accelerator(backend="fairscale")
    text = _one_line(err.value)
    assert f"does not import with torch {torch.__version__}" in text
    assert "pip install 'gradsync[fairscale]'" in text and "backend='fsdp'" in text


def test_an_old_fairscale_is_refused(clean_env, monkeypatch):
    fairscale = pytest.importorskip("fairscale", reason=SKIP_REASON)
    _forget_the_adapter(monkeypatch)
    monkeypatch.setattr(fairscale, "__version__", "0.4.6")
    with pytest.raises(ImportError) as err:
        Accelerator(backend="fairscale")
    text = _one_line(err.value)
    assert "supports fairscale 0.4.13, not 0.4.6" in text and "pip install 'gradsync[fairscale]'" in text


def test_gradsync_env_lists_the_backend():
    proc = subprocess.run([sys.executable, "-m", "gradsync", "env"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("backend fairscale:"))
    if importlib.util.find_spec("fairscale") is None:  # what `gradsync env` looks at
        assert "not installed (pip install 'gradsync[fairscale]')" in line
    else:
        assert "available (legacy" in line and "backend='fsdp'" in line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("backend", ["fairscale", "ddp", "fsdp", "deepspeed"])
def test_the_group_gradsync_creates_has_the_configured_timeout(clean_env, backend):
    """``timeout=`` reaches the process group gradsync creates on every backend (fairscale
    once created its group with torch's default and ignored it). One rank, in this process."""
    if backend in ("fairscale", "deepspeed"):
        pytest.importorskip(backend)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port())}.items():
        clean_env.setenv(key, value)
    Accelerator(backend=backend, timeout=7)
    group = dist.group.WORLD
    assert isinstance(group, audit.AuditProcessGroup)  # gloo under the self-check's counting wrapper
    assert group.inner.options._timeout == timedelta(seconds=7)


def test_a_missing_private_attribute_names_the_supported_version():
    pytest.importorskip("fairscale", reason=SKIP_REASON)
    from gradsync.backends import _fairscale_compat

    class Bare:
        pass

    with pytest.raises(RuntimeError, match=r"Bare\._should_accumulate_grads.*supports fairscale 0\.4\.13"):
        with _fairscale_compat.no_sync(Bare()):
            pass
    with pytest.raises(RuntimeError, match=r"Bare\._work_handles.*supports fairscale 0\.4\.13"):
        _fairscale_compat.finish_reductions(Bare())


def test_a_mid_window_save_is_refused_on_every_rank_and_a_boundary_save_works(results):
    assert_mid_window_save_refused(results["mid_window_save"], "fairscale")


def test_save_model_writes_the_gathered_weights_once_on_rank_0(results):
    """``save_model`` of a tied model after one window."""
    assert_export_is_the_gathered_model(results["export"])
