"""fp16 with the window-aware GradScaler, accel.autocast, clipping, activation checkpointing
and their settings, in one process (backend "single"), against the same loop written by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gradsync import Accelerator, ConfigError
from gradsync.backends import _amp
from gradsync.backends._deepspeed_config import fill_precision
from gradsync.config import load_config

from harness.checks import max_diff, reference
from scenarios.amp import saved_bytes
from scenarios.common import Indexed, Loop, make_model, to_lists, train

DATA = Indexed(32)
K = 4


def batch(i):
    return DATA.x[2 * i : 2 * i + 2], DATA.y[2 * i : 2 * i + 2]


def by_hand(*, spike_at=None, clip=None, clip_value=None, grad_scaler=None):
    """The fp16 accumulation loop written by hand with torch's GradScaler."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    scaler = torch.amp.GradScaler("cpu", **(grad_scaler or {}))
    skipped, scales = [], []
    for w in range(16 // K):
        opt.zero_grad()
        for i in range(w * K, w * K + K):
            x, y = batch(i)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x), y) * (1e9 if i == spike_at else 1)
            scaler.scale(loss / K).backward()
        scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
        if not skipped[-1]:
            sched.step()
        scales.append(scaler.get_scale())
    return {
        "state": to_lists(model.state_dict()),
        "skipped": skipped,
        "scales": scales,
        "last_epoch": sched.last_epoch,
    }


def with_gradsync(*, spike_at=None, clip=None, clip_value=None, grad_scaler=None, clip_twice=False):
    accel = Accelerator(
        backend="single",
        gradient_accumulation_steps=K,
        mixed_precision="fp16",
        grad_scaler=grad_scaler,
    )
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = accel.prepare(model, opt, sched)
    skipped, scales = [], []
    for i in range(16):
        x, y = batch(i)
        with accel.accumulate(model):
            loss = F.mse_loss(model(x), y) * (1e9 if i == spike_at else 1)
            accel.backward(loss)
            for _ in range(2 if clip_twice else 1):
                if clip is not None:
                    accel.clip_grad_norm_(model.parameters(), clip)
                if clip_value is not None:
                    accel.clip_grad_value_(model.parameters(), clip_value)
            opt.step()
            sched.step()
            opt.zero_grad()
        if accel.sync_gradients:
            skipped.append(accel.optimizer_step_was_skipped)
            scales.append(accel.scaler.get_scale())
    return {
        "state": to_lists(accel.get_state_dict(model)),
        "skipped": skipped,
        "scales": scales,
        "last_epoch": sched.last_epoch,
        "accel": accel,
    }


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"clip": 0.5},
        {"clip_value": 0.01},
        {"clip": 0.5, "clip_value": 0.01},
        {"clip": 0.5, "clip_twice": True},
        {"grad_scaler": {"init_scale": 2.0**10, "growth_interval": 2}},
    ],
    ids=["plain", "clip", "clip_value", "clip_both", "clip_twice", "scaler_settings"],
)
def test_fp16_equals_the_hand_written_loop(clean_env, kwargs):
    want = by_hand(**{k: v for k, v in kwargs.items() if k != "clip_twice"})
    got = with_gradsync(**kwargs)
    assert got["skipped"] == want["skipped"] == [False] * 4
    assert got["scales"] == want["scales"]
    # clipping twice rescales by max_norm / (norm + 1e-6) once more; unscaling twice would be
    # off by the whole scale (65536)
    assert max_diff(got["state"], want["state"]) <= (1e-6 if "clip_twice" in kwargs else 0.0)
    if "grad_scaler" in kwargs:
        assert want["scales"] == [2.0**10, 2.0**11, 2.0**11, 2.0**12]  # the settings are used


def test_fp16_overflow_skips_the_step_and_the_scheduler_and_halves_the_scale(clean_env):
    want = by_hand(spike_at=6)  # a loss spike in window 1's third micro-step
    got = with_gradsync(spike_at=6)
    assert got["skipped"] == want["skipped"] == [False, True, False, False]
    assert got["scales"] == want["scales"] == [65536.0, 32768.0, 32768.0, 32768.0]
    assert got["last_epoch"] == want["last_epoch"] == 3
    assert got["accel"].optimizer_steps == 3
    assert max_diff(got["state"], want["state"]) == 0.0


def test_scaler_state_round_trips(clean_env):
    got = with_gradsync(spike_at=6)
    state = got["accel"].scaler.state_dict()
    assert state["scale"] == 32768.0 and state["_growth_tracker"] == 2
    fresh = Accelerator(backend="single", mixed_precision="fp16")
    assert fresh.scaler.get_scale() == 65536.0
    fresh.scaler.load_state_dict(state)
    assert fresh.scaler.state_dict() == state
    assert Accelerator(backend="single").scaler is None


def test_step_twice_in_one_fp16_window_is_an_error(clean_env):
    accel = Accelerator(backend="single", mixed_precision="fp16")
    model = make_model()
    model, opt = accel.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with accel.accumulate(model):
        accel.backward(F.mse_loss(model(DATA.x[:2]), DATA.y[:2]))
        opt.step()
        with pytest.raises(
            RuntimeError, match="step\\(\\) was called twice in one accumulation window"
        ):
            opt.step()


@pytest.mark.parametrize(
    ("setting", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16), ("no", torch.float32)]
)
def test_accel_autocast_is_the_one_accumulate_uses(clean_env, setting, dtype):
    accel = Accelerator(backend="single", mixed_precision=setting)
    model = accel.prepare(make_model())
    with accel.accumulate(model):
        inside = model(DATA.x[:2]).dtype
    with torch.no_grad(), accel.autocast():
        outside = model(DATA.x[:2]).dtype
    assert inside == outside == dtype
    assert model(DATA.x[:2]).dtype == torch.float32  # nothing leaks out of the blocks


def test_clip_grad_value_acts_only_at_the_boundary(clean_env):
    accel = Accelerator(backend="single", gradient_accumulation_steps=2)
    model = make_model()
    model, _ = accel.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for i in range(2):
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(DATA.x[:2]) * 100, DATA.y[:2]))
            before = [p.grad.clone() for p in model.parameters()]
            accel.clip_grad_value_(model.parameters(), 0.01)
            after = [p.grad for p in model.parameters()]
            if i == 0:
                assert all(torch.equal(a, b) for a, b in zip(before, after))
            else:
                assert max(float(g.abs().max()) for g in after) == pytest.approx(0.01)
                assert max(float(g.abs().max()) for g in before) > 0.01


def test_clip_grad_norm_takes_the_norm_type(clean_env):
    accel = Accelerator(backend="single")
    model = make_model()
    model, _ = accel.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with accel.accumulate(model):
        accel.backward(F.mse_loss(model(DATA.x[:2]), DATA.y[:2]))
        want = max(float(p.grad.abs().max()) for p in model.parameters())
        norm = accel.clip_grad_norm_(model.parameters(), 1e9, norm_type=float("inf"))
    assert float(norm) == pytest.approx(want)


@pytest.mark.parametrize("kind", ["names", "name", "classes", "callable"])
def test_activation_checkpointing_changes_nothing_and_keeps_less(clean_env, kind):
    from scenarios.common import Block

    spec = {
        "names": ["Block"],
        "name": "Block",
        "classes": [Block],
        "callable": lambda m: isinstance(m, Block),
    }[kind]
    runs = {}
    for name, ac in (("plain", None), ("checkpointed", spec)):
        accel = Accelerator(
            backend="single", gradient_accumulation_steps=4, seed=0, activation_checkpointing=ac
        )
        runs[name] = train(accel, Loop(samples=22, micro_batch=2))
        model = accel.prepare(make_model())
        with accel.accumulate(model):
            runs[name]["saved"], loss = saved_bytes(
                lambda m=model: F.mse_loss(m(DATA.x[:2]), DATA.y[:2])
            )
            accel.backward(loss)
        with torch.no_grad():  # evaluation runs the forward once, without checkpointing
            model(DATA.x[:2])
    assert max_diff(runs["plain"]["state"], runs["checkpointed"]["state"]) < 1e-6
    assert (
        max_diff(
            runs["checkpointed"]["state"], reference([runs["checkpointed"]], samples=22)["state"]
        )
        < 1e-6
    )
    assert runs["checkpointed"]["saved"] < runs["plain"]["saved"]


# -- bad input --------------------------------------------------------------------------
def _one_line(err):
    assert "\n" not in str(err.value), str(err.value)
    return str(err.value)


def test_fp16_on_a_device_without_autocast_is_one_line():
    with pytest.raises(ConfigError) as err:
        _amp.check_autocast(torch.device("meta"), "fp16")
    assert _one_line(err).startswith(
        "mixed_precision='fp16' needs autocast, which the 'meta' device"
    )
    assert _amp.check_autocast(torch.device("cpu"), "fp16") == torch.float16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mixed_precision": "fp8"}, "mixed_precision='fp8' is unknown; use one of no, bf16, fp16"),
        (
            {"mixed_precision": "fp16", "grad_scaler": torch.amp.GradScaler("cpu")},
            "grad_scaler=GradScaler(...): gradsync runs one scaler per run",
        ),
        (
            {"grad_scaler": {"init_scale": 8.0}},
            "grad_scaler={'init_scale': 8.0} with mixed_precision='no'",
        ),
        (
            {"mixed_precision": "fp16", "grad_scaler": {"scale": 8.0}},
            "grad_scaler={'scale': 8.0} must be a dict with keys",
        ),
        ({"activation_checkpointing": 3}, "activation_checkpointing=3 must be a module class name"),
        ({"compile": "yes"}, "compile='yes' must be True, False or a dict"),
    ],
)
def test_bad_settings_name_key_and_value(clean_env, kwargs, message):
    with pytest.raises(ConfigError) as err:
        Accelerator(backend="single", **kwargs)
    assert message in _one_line(err)


def test_a_user_scaler_in_prepare_is_refused(clean_env):
    accel = Accelerator(backend="single", mixed_precision="fp16")
    with pytest.raises(
        ConfigError, match=r"prepare\(\) got a GradScaler: gradsync runs one loss scaler per run"
    ):
        accel.prepare(make_model(), torch.amp.GradScaler("cpu"))


def test_checkpointing_a_class_the_model_lacks_lists_the_ones_it_has(clean_env):
    accel = Accelerator(backend="single", activation_checkpointing=["Block", "Transformer"])
    with pytest.raises(ConfigError) as err:
        accel.prepare(make_model())
    assert _one_line(err) == (
        "activation_checkpointing=['Transformer'] names no module of this Net; use class names "
        "from: Block, Linear, ModuleList, Net (or a callable module -> bool)"
    )


def test_settings_from_env_and_yaml(clean_env, tmp_path):
    clean_env.setenv("GRADSYNC_ACTIVATION_CHECKPOINTING", "Block, Linear")
    clean_env.setenv("GRADSYNC_COMPILE", '{"mode": "reduce-overhead"}')
    clean_env.setenv("GRADSYNC_MIXED_PRECISION", "fp16")
    clean_env.setenv("GRADSYNC_GRAD_SCALER", '{"init_scale": 1024}')
    cfg = load_config()
    assert cfg.activation_checkpointing == ["Block", "Linear"]
    assert cfg.compile == {"mode": "reduce-overhead"}
    assert cfg.grad_scaler == {"init_scale": 1024}
    clean_env.setenv("GRADSYNC_COMPILE", "1")
    assert load_config().compile is True
    for key in (
        "GRADSYNC_ACTIVATION_CHECKPOINTING",
        "GRADSYNC_COMPILE",
        "GRADSYNC_MIXED_PRECISION",
        "GRADSYNC_GRAD_SCALER",
    ):
        clean_env.delenv(key)
    path = tmp_path / "c.yaml"
    path.write_text(
        "mixed_precision: fp16\nactivation_checkpointing: [Block]\ncompile: true\n"
        "grad_scaler: {growth_interval: 10}\n"
    )
    cfg = load_config(config_file=path)
    assert (cfg.activation_checkpointing, cfg.compile, cfg.grad_scaler) == (
        ["Block"],
        True,
        {"growth_interval": 10},
    )
    clean_env.setenv("GRADSYNC_GRAD_SCALER", "{bad")
    with pytest.raises(ConfigError, match="GRADSYNC_GRAD_SCALER='{bad' is not JSON"):
        load_config()


# -- DeepSpeed's config sections (no engine needed) -----------------------------------------
def test_deepspeed_precision_sections():
    assert fill_precision({}, "fp16") == {"fp16": {"enabled": True}}
    assert fill_precision({"bf16": {"enabled": False}}, "fp16")["fp16"] == {"enabled": True}
    assert fill_precision({"fp16": {"loss_scale": 0}}, "fp16")["fp16"] == {
        "loss_scale": 0,
        "enabled": True,
    }
    assert fill_precision({"fp16": {"enabled": True}}, "no") == {"fp16": {"enabled": True}}
    with pytest.raises(ConfigError) as err:
        fill_precision({"bf16": {"enabled": True}}, "fp16")
    assert _one_line(err).startswith(
        "mixed_precision='fp16' contradicts deepspeed_config bf16.enabled=true"
    )
    with pytest.raises(
        ConfigError, match="mixed_precision='bf16' contradicts deepspeed_config fp16.enabled=true"
    ):
        fill_precision({"fp16": {"enabled": "true"}}, "bf16")
    with pytest.raises(ConfigError, match="contradicts deepspeed_config fp16.enabled=false"):
        fill_precision({"fp16": {"enabled": False}}, "fp16")


def test_deepspeed_fp16_where_the_accelerator_cannot_is_one_line(clean_env):
    pytest.importorskip("deepspeed")
    clean_env.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported():
        pytest.skip("this machine's DeepSpeed accelerator runs fp16")
    with pytest.raises(ConfigError) as err:
        Accelerator(backend="deepspeed", mixed_precision="fp16")
    assert (
        "accelerator does not support fp16 on this machine; use mixed_precision='bf16'"
        in _one_line(err)
    )
