"""``comm_hook`` without a process group: the settings' one-line refusals, the single process's
warning, DDP's bf16 refusal on a device torch's hooks do not take, every spelling of the
setting, and the torch behaviour gradsync's PowerSGD state handling relies on
(``gradsync.backends._powersgd_compat``). The runs on a real group:
tests/multiprocess/test_comm_hook.py."""

from __future__ import annotations

import enum
import logging

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from gradsync import Accelerator, cli
from gradsync.backends import _ddp_comm, _ddp_compat
from gradsync.backends import _powersgd_compat as compat
from gradsync.config import Config, load_config
from gradsync.errors import ConfigError
from gradsync.launch import Launcher


def _config(**kwargs) -> Config:
    return load_config(environ={}, **kwargs)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (
            {"comm_hook": "power-sgd"},
            ["comm_hook='power-sgd' is unknown", "did you mean power_sgd"],
        ),
        ({"comm_hook": "fp61"}, ["did you mean fp16"]),
        ({"comm_hook": "fp16", "comm_wrapper": "bf16"}, ["is no PowerSGD hook"]),
        ({"comm_hook": "power_sgd", "comm_wrapper": "fp32"}, ["comm_wrapper='fp32' is unknown"]),
        (
            {"comm_hook": "power_sgd", "comm_state_option": {"matrix_rank": 2}},
            ["'matrix_rank' is no PowerSGD option", "did you mean matrix_approximation_rank"],
        ),
        ({"comm_state_option": {"warm_start": False}}, ["comm_hook='no' is no PowerSGD hook"]),
        ({"comm_hook": "power_sgd", "comm_state_option": [1]}, ["must be a dict"]),
    ],
)
def test_a_bad_value_is_one_line_naming_the_fix(clean_env, kwargs, words):
    with pytest.raises(ConfigError) as err:
        _config(**kwargs)
    assert "\n" not in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_an_enum_member_and_any_case_are_the_hook_they_name(clean_env):
    class HookType(str, enum.Enum):  # as gradsync.accelerate's DDPCommunicationHookType
        POWER_SGD = "power_sgd"

    config = _config(comm_hook=HookType.POWER_SGD, comm_wrapper="FP16")
    assert (config.comm_hook, config.comm_wrapper) == ("power_sgd", "fp16")


def test_every_spelling_reaches_the_workers(clean_env, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    args = cli.build_parser().parse_args(
        [
            "launch",
            "--comm-hook",
            "power_sgd",
            "--comm_wrapper",
            "fp16",
            "--comm-state-option",
            '{"matrix_approximation_rank": 2}',
            str(script),
        ]
    )
    worker = load_config(environ=Launcher(cli.launch_config(args)).worker_env())
    assert worker.comm_hook == "power_sgd" and worker.comm_wrapper == "fp16"
    assert worker.comm_state_option == {"matrix_approximation_rank": 2}
    assert load_config(environ={"GRADSYNC_COMM_HOOK": "fp16"}).comm_hook == "fp16"
    (tmp_path / "c.yaml").write_text("comm_hook: bf16\n")
    assert load_config(environ={}, config_file=tmp_path / "c.yaml").comm_hook == "bf16"


def test_one_process_says_the_hook_does_nothing(clean_env, caplog):
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        accel = Accelerator(backend="single", comm_hook="fp16")
    assert accel.config.comm_hook == "fp16"
    assert "comm_hook='fp16' does nothing in one process" in caplog.text


def test_ddp_refuses_bf16_where_torchs_hooks_cannot_take_it(clean_env):
    """On the CPU (gloo) torch's DDP bf16 hooks cannot run, on a CUDA build of torch too;
    on a GPU whose NCCL takes them, they are registered."""
    config = _config(backend="ddp", comm_hook="bf16")
    if _ddp_compat.bf16_hooks_run() and torch.cuda.is_available():
        assert _ddp_comm.settings(config, torch.device("cuda")) is not None
    with pytest.raises(ConfigError, match="comm_hook='bf16' on backend='ddp' needs bf16"):
        _ddp_comm.settings(config, torch.device("cpu"))
    power = _config(backend="ddp", comm_hook="power_sgd", comm_wrapper="bf16")
    with pytest.raises(ConfigError, match="comm_wrapper='bf16' on backend='ddp'"):
        _ddp_comm.settings(power, torch.device("cpu"))


def test_torchs_refusal_of_powersgd_options_is_one_line(clean_env):
    config = _config(
        backend="ddp", comm_hook="power_sgd", comm_state_option={"start_powerSGD_iter": 0}
    )
    with pytest.raises(ConfigError, match="comm_state_option=.*start_powerSGD_iter"):
        _ddp_comm.settings(config, torch.device("cpu"))


# -- what gradsync relies on in torch's PowerSGD (the compat module's list) ---------------
def test_powersgd_state_has_the_fields_gradsync_reads_and_writes():
    state = compat.make_state({"matrix_approximation_rank": 2, "start_powerSGD_iter": 3})
    for name in ("iter", "rng", "error_dict", "p_memory_dict", "q_memory_dict", "warm_start"):
        assert hasattr(state, name), name
    for name in ("total_numel_before_compression", "total_numel_after_compression"):
        assert isinstance(getattr(state, name), int)
    state.rng.randint(10)
    saved = compat.capture(state, {}, [])
    again = compat.make_state({"matrix_approximation_rank": 2, "start_powerSGD_iter": 3})
    compat.restore(again, saved)
    assert again.rng.randint(1_000_000) == state.rng.randint(1_000_000)


@pytest.mark.parametrize("shape", [(16, 16), (16, 8), (1, 16), (16,), (4, 3, 2), (3, 2)])
@pytest.mark.parametrize("rank", [1, 2, 4])
def test_which_parameters_powersgd_compresses_is_torchs_rule(shape, rank):
    state = compat.make_state({"matrix_approximation_rank": rank, "start_powerSGD_iter": 2})
    ours = compat._compressed((("w", shape),), state)
    n = shape[0]
    m = torch.zeros(shape).view(n, -1).shape[1]
    r = min(n, m, rank)
    torchs = powerSGD_hook._should_compress(n, m, r, state.min_compression_rate)[0]
    assert bool(ours) == torchs
    if ours:
        assert ours == [("w", n * r, m * r)]


def test_state_saved_under_one_bucket_layout_is_put_back_per_parameter_under_another():
    """The P and Q of each parameter go where the other layout's hook reads them: grouped by
    shape in the order each shape first occurs, and the error in the bucket's order."""
    state = compat.make_state({"matrix_approximation_rank": 1, "start_powerSGD_iter": 2})
    a: compat.Layout = (("w1", (8, 8)), ("b1", (8,)), ("w2", (8, 8)), ("w3", (8, 12)))
    b: compat.Layout = (("w3", (8, 12)), ("w2", (8, 8)), ("b1", (8,)), ("w1", (8, 8)))
    size = {name: torch.zeros(shape).numel() for name, shape in a}
    error = {name: torch.full((size[name],), float(i)) for i, name in enumerate(size)}
    # a's order: shape (8, 8) first (w1, w2), then (8, 12) (w3); P is 8 x 1, Q is m x 1; the
    # bias (8 x 1) is sent whole
    p = {n: torch.full((8,), float(i)) for i, n in enumerate(("w1", "w2", "w3"))}
    q = {
        n: torch.full((m,), float(i)) for i, (n, m) in enumerate((("w1", 8), ("w2", 8), ("w3", 12)))
    }
    pending = [
        {
            "layout": a,
            "error": torch.cat([error[n] for n, _ in a]),
            "p": torch.cat([p["w1"], p["w2"], p["w3"]]),
            "q": torch.cat([q["w1"], q["w2"], q["w3"]]),
        }
    ]
    compat.install(state, 0, b, pending, batched=False, device=torch.device("cpu"))
    assert torch.equal(state.error_dict[0], torch.cat([error[n] for n, _ in b]))
    # b's order: shape (8, 12) first (w3), then (8, 8) (w2, w1)
    assert torch.equal(state.p_memory_dict[0], torch.cat([p["w3"], p["w2"], p["w1"]]))
    assert torch.equal(state.q_memory_dict[0], torch.cat([q["w3"], q["w2"], q["w1"]]))
    compat.install(state, 1, a, pending, batched=False, device=torch.device("cpu"))
    assert torch.equal(state.p_memory_dict[1], pending[0]["p"])  # the same layout: as saved
    assert state.p_memory_dict[1] is not pending[0]["p"]  # a copy: the hook writes in place


def test_a_dropped_window_puts_every_part_of_the_state_back():
    state = compat.make_state({"start_powerSGD_iter": 2})
    state.error_dict[0] = torch.ones(3)
    state.p_memory_dict[0] = torch.ones(2)
    state.q_memory_dict[0] = torch.ones(2)
    snap = compat.snapshot(state)
    draw = state.rng.randint(1_000_000)
    state.iter += 1
    state.error_dict[0] = torch.zeros(3)
    state.p_memory_dict[0].mul_(5)  # the hook writes P and Q in place
    state.q_memory_dict[1] = torch.ones(1)
    compat.put_back(state, snap)
    assert state.iter == 0 and set(state.q_memory_dict) == {0}
    assert torch.equal(state.error_dict[0], torch.ones(3))
    assert torch.equal(state.p_memory_dict[0], torch.ones(2))
    assert state.rng.randint(1_000_000) == draw


# -- gradsync.accelerate: Accelerate's DistributedDataParallelKwargs and hook names ---------
def test_accelerates_hook_names_import_from_both_modules():
    from gradsync.accelerate import DDPCommunicationHookType as top
    from gradsync.accelerate.utils import DDPCommunicationHookType

    assert top is DDPCommunicationHookType
    assert DDPCommunicationHookType.list() == [
        "no",
        "fp16",
        "bf16",
        "power_sgd",
        "batched_power_sgd",
    ]
    assert str(DDPCommunicationHookType("power_sgd")) == "power_sgd"


@pytest.mark.parametrize(
    "given, settings",
    [
        ({}, {}),
        ({"comm_hook": "FP16"}, {"comm_hook": "fp16"}),
        (  # Accelerate registers nothing for "no", whatever the wrapper and options say
            {"comm_wrapper": "FP16", "comm_state_option": {"warm_start": False}},
            {},
        ),
        (  # the options reach only PowerSGD (Accelerate builds its state for it alone)
            {"comm_hook": "FP16", "comm_state_option": {"warm_start": False}},
            {"comm_hook": "fp16"},
        ),
        (
            {
                "comm_hook": "POWER_SGD",
                "comm_wrapper": "BF16",
                "comm_state_option": {"matrix_approximation_rank": 2},
            },
            {
                "comm_hook": "power_sgd",
                "comm_wrapper": "bf16",
                "comm_state_option": {"matrix_approximation_rank": 2},
            },
        ),
    ],
)
def test_ddp_kwargs_hook_fields_become_the_settings(clean_env, given, settings):
    from gradsync.accelerate.config import translate
    from gradsync.accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    fields = {
        k: DDPCommunicationHookType[v] if k != "comm_state_option" else v for k, v in given.items()
    }
    handler = DistributedDataParallelKwargs(bucket_cap_mb=50, **fields)
    out = translate(
        split_batches=None,
        cpu=False,
        dataloader_config=None,
        project_dir=None,
        project_config=None,
        gradient_accumulation_steps=1,
        gradient_accumulation_plugin=None,
        kwargs_handlers=[handler],
        dynamo_backend=None,
    ).settings
    assert out.pop("ddp_kwargs") == {"bucket_cap_mb": 50}  # DDP's own arguments only
    assert out == settings
    load_config(environ={}, backend="ddp", **out)  # and gradsync takes them
