"""The multi-process harness, in this process: a scenario is a function of a ``scenarios.*``
module whose parameters bind to its signature, checked when a test module builds it (at
collection), and the parameters reach the worker as given."""

from __future__ import annotations

import pickle

import pytest

from harness import Scenario, group_setup, reference_to
from scenarios import common, ddp, deepspeed, pipelines
from scenarios.common import DROPS, Loop


def test_a_scenario_is_sent_as_its_module_and_name():
    scenario = Scenario(ddp.train_ddp, steps=4, loop=Loop(samples=8, micro_batch=2))
    assert reference_to(scenario.fn) == ("scenarios.ddp", "train_ddp")


def test_a_misspelt_or_missing_parameter_fails_when_built():
    with pytest.raises(TypeError, match=r"scenarios\.ddp\.train_ddp.*'polcy'"):
        Scenario(ddp.train_ddp, steps=4, loop=Loop(samples=8, micro_batch=2), polcy="defer")
    with pytest.raises(TypeError, match=r"scenarios\.ddp\.train_ddp.*loop"):
        Scenario(ddp.train_ddp, steps=4)
    with pytest.raises(TypeError):
        Loop(samples=8, micro_batch=2, after_block=True)  # a Loop field that does not exist


def test_only_module_level_functions_of_scenarios_modules():
    def local(**params):
        return params

    with pytest.raises(TypeError, match="module-level function of a scenarios"):
        Scenario(local)
    with pytest.raises(TypeError, match="module-level function of a scenarios"):
        Scenario(test_a_scenario_is_sent_as_its_module_and_name)
    with pytest.raises(TypeError, match="must be a function"):
        Scenario("train_ddp")  # type: ignore[arg-type]


def test_parameters_travel_as_given():
    loop = Loop(samples=8, micro_batch=2, change_steps_at=(2, 3), **DROPS["raise"])
    sent = pickle.loads(pickle.dumps(dict(Scenario(ddp.train_ddp, steps=4, loop=loop).params)))
    assert sent["loop"] == loop and sent["loop"].change_steps_at == (2, 3)
    assert sent["loop"].raise_at == (1, 1)


def test_one_process_group_per_run():
    assert group_setup({"a": Scenario(ddp.misuse)}) is common.audited_gloo_group
    # DeepSpeed adopts the audited gloo group: its scenarios share it with DDP's
    assert group_setup({"a": Scenario(ddp.misuse), "b": Scenario(deepspeed.clip_twice)}) is common.audited_gloo_group
    assert group_setup({"a": Scenario(pipelines.self_check, loop="plain")}) is pipelines.setup_process_group
    with pytest.raises(ValueError, match="different process groups"):
        group_setup({"a": Scenario(ddp.misuse), "b": Scenario(pipelines.self_check, loop="plain")})
