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
    assert (
        group_setup({"a": Scenario(ddp.misuse), "b": Scenario(deepspeed.clip_twice)})
        is common.audited_gloo_group
    )
    assert (
        group_setup({"a": Scenario(pipelines.self_check, loop="plain")})
        is pipelines.setup_process_group
    )
    with pytest.raises(ValueError, match="different process groups"):
        group_setup({"a": Scenario(ddp.misuse), "b": Scenario(pipelines.self_check, loop="plain")})


def test_a_pool_refuses_members_that_cannot_share_a_group(tmp_path):
    from harness import Shared, run_shared

    two = Shared("p", {"a": Scenario(ddp.misuse)})
    with pytest.raises(ValueError, match="mixes group sizes"):
        run_shared({"x": two, "y": Shared("p", {"a": Scenario(ddp.misuse)}, nproc=4)}, tmp_path)
    with pytest.raises(ValueError, match="X is both"):
        run_shared(
            {"x": Shared("p", {}, env={"X": "1"}), "y": Shared("p", {}, env={"X": "2"})}, tmp_path
        )
    assert not Shared("p", {}, requires=("no_such_module_here",)).available()


def test_a_module_reads_only_its_part_of_a_shared_run(tmp_path):
    from harness import PartOf, Results, ScenarioError

    ok = {"ok": True, "error": None}
    whole = Results([{"m1::a": {**ok, "result": 1}, "m2::a": {**ok, "result": 2}}] * 2, "log")
    part = PartOf(whole, "m2::", tmp_path)
    assert part["a"] == [2, 2] and part.log == "log" and part.folder == tmp_path
    with pytest.raises(ScenarioError, match="m2::b"):
        part["b"]


def test_xdist_units_are_pools_modules_or_single_tests(tmp_path):
    from conftest import xdist_scope

    (tmp_path / "test_pool.py").write_text('SHARED = Shared("gloo2", SCENARIOS)\n')
    (tmp_path / "test_apart.py").write_text("INDEPENDENT_TESTS = True\n")
    (tmp_path / "test_plain.py").write_text("X = 1\n")
    assert xdist_scope("test_pool.py::test_a[1]", tmp_path) == "pool-gloo2"
    assert xdist_scope("test_apart.py::test_a[1]", tmp_path) == "test_apart.py::test_a[1]"
    assert xdist_scope("test_plain.py::test_a", tmp_path) == "test_plain.py"
