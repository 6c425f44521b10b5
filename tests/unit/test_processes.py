"""gradsync.processes in one process: each rank's share of split_between_processes (computed
for any rank and world, as Accelerate splits), the on_*_process decorators against given
rank facts, goes_first, and every bad input. The same functions on 2 real ranks:
tests/multiprocess/test_processes.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from gradsync import Accelerator, ConfigError, processes
from gradsync.processes import process_share, split_between_processes


def shares(inputs, world, apply_padding=False):
    return [process_share(inputs, rank, world, apply_padding) for rank in range(world)]


# -- split_between_processes --------------------------------------------------------------


def test_the_first_ranks_get_one_more_as_in_accelerates_example():
    assert shares(["A", "B", "C"], 2) == [["A", "B"], ["C"]]
    assert shares(["A", "B", "C"], 2, apply_padding=True) == [["A", "B"], ["C", "C"]]
    assert shares(list(range(5)), 3) == [[0, 1], [2, 3], [4]]
    assert shares(list(range(5)), 3, apply_padding=True) == [[0, 1], [2, 3], [4, 4]]
    assert shares(list(range(6)), 3, apply_padding=True) == [[0, 1], [2, 3], [4, 5]]


def test_fewer_inputs_than_processes():
    assert shares(["A"], 3) == [["A"], [], []]
    assert shares(["A"], 3, apply_padding=True) == [["A"], ["A"], ["A"]]
    assert shares([], 2, apply_padding=True) == [[], []]


def test_every_input_lands_once_in_rank_order():
    for n in range(0, 12):
        for world in (2, 3, 4):
            parts = shares(list(range(n)), world)
            assert [x for p in parts for x in p] == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
            padded = shares(list(range(n)), world, apply_padding=True)
            assert len({len(p) for p in padded}) == 1
            assert [p[: len(q)] for p, q in zip(padded, parts)] == parts


def test_a_tuple_stays_a_tuple():
    assert shares(("a", "b", "c"), 2, apply_padding=True) == [("a", "b"), ("c", "c")]


def test_a_tensor_is_split_along_its_first_dimension():
    t = torch.arange(10).reshape(5, 2)
    parts = shares(t, 2)
    assert [p.tolist() for p in parts] == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9]]]
    padded = shares(t, 2, apply_padding=True)
    assert padded[1].tolist() == [[6, 7], [8, 9], [8, 9]]
    assert padded[1].dtype == t.dtype
    assert shares(torch.tensor([7.0]), 2, apply_padding=True)[1].tolist() == [7.0]


def test_a_dict_is_split_value_by_value_and_left_as_it_was():
    data = {"prompt": ["a", "b", "c"], "id": torch.tensor([1, 2, 3])}
    first, second = shares(data, 2, apply_padding=True)
    assert first["prompt"] == ["a", "b"] and first["id"].tolist() == [1, 2]
    assert second["prompt"] == ["c", "c"] and second["id"].tolist() == [3, 3]
    assert data["prompt"] == ["a", "b", "c"], "the caller's dict is not changed"
    assert shares({}, 2) == [{}, {}]


class Rows:
    """A dataset with select(), as a Hugging Face datasets.Dataset has."""

    def __init__(self, rows):
        self.rows = list(rows)

    def __len__(self):
        return len(self.rows)

    def select(self, indices):
        return Rows(self.rows[i] for i in indices)


def test_a_dataset_with_select():
    parts = shares(Rows("abc"), 2, apply_padding=True)
    assert [p.rows for p in parts] == [["a", "b"], ["c", "c"]]


def test_one_process_gets_its_inputs_themselves():
    data = ["a", "b"]
    with split_between_processes(data) as mine:  # no process group: one process
        assert mine is data
    with split_between_processes(data, apply_padding=True) as mine:
        assert mine is data
    with split_between_processes(data, rank=1, world=2) as mine:
        assert mine == ["b"]


def test_what_cannot_be_split():
    with pytest.raises(ConfigError, match="cannot split the inputs, a str"):
        process_share("abc", 0, 2)
    with pytest.raises(ConfigError, match="cannot split the inputs, a str"):
        process_share("abc", 0, 1)  # one process checks too
    with pytest.raises(ConfigError, match="a 0-d tensor"):
        process_share(torch.tensor(1.0), 0, 2)
    with pytest.raises(ConfigError, match=r"one length; these have 'a': 2, 'b': 3"):
        process_share({"a": [1, 2], "b": [1, 2, 3]}, 0, 2)
    with pytest.raises(ConfigError, match=r"the value of 'a', a int"):
        process_share({"a": 3}, 0, 2)
    with pytest.raises(ConfigError, match="rank 2 is not one of the 2 process"):
        process_share([1, 2], 2, 2)
    with pytest.raises(ConfigError, match="rank -1 is not one of"):
        with split_between_processes([1], rank=-1, world=2):
            pass


# -- on_*_process ---------------------------------------------------------------------------


@dataclass
class Where:
    """Rank facts as an Accelerator gives them."""

    rank: int
    local_rank: int
    world_size: int


def runs(decorate, where) -> bool:
    calls = []

    def record(x: int, *, y: int = 0) -> int:
        """Record a call."""
        calls.append((x, y))
        return x + y

    wrapped = decorate(record, where)
    out = wrapped(2, y=3)
    assert (out == 5) == bool(calls) and (out is None) != bool(calls)
    assert wrapped.__name__ == "record" and wrapped.__doc__ == "Record a call."
    return bool(calls)


DECORATORS = {
    "main": lambda fn, w: processes.on_main_process(fn, ranks=w),
    "local_main": lambda fn, w: processes.on_local_main_process(fn, ranks=w),
    "last": lambda fn, w: processes.on_last_process(fn, ranks=w),
    "process_1": lambda fn, w: processes.on_process(process_index=1, ranks=w)(fn),
    "local_process_1": lambda fn, w: processes.on_local_process(local_process_index=1, ranks=w)(fn),
}


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        # 2 machines with 2 processes each: ranks 0..3, local ranks 0, 1, 0, 1
        (Where(0, 0, 4), {"main", "local_main"}),
        (Where(1, 1, 4), {"process_1", "local_process_1"}),
        (Where(2, 0, 4), {"local_main"}),
        (Where(3, 1, 4), {"last", "local_process_1"}),
        (Where(0, 0, 1), set(DECORATORS)),  # one process runs everything, as in Accelerate
    ],
)
def test_each_decorator_runs_where_it_says(where, expected):
    assert {name for name, d in DECORATORS.items() if runs(d, where)} == expected


def test_the_ranks_are_read_at_each_call():
    where = Where(1, 1, 2)
    calls = []
    wrapped = processes.on_main_process(lambda: calls.append(where.rank), ranks=where)
    wrapped()
    where.rank = 0
    wrapped()
    assert calls == [0]


def test_the_function_given_directly_and_through_the_decorator_form():
    where = Where(1, 0, 2)
    assert processes.on_process(lambda: "ran", process_index=1, ranks=where)() == "ran"
    assert processes.on_local_process(lambda: "ran", local_process_index=1, ranks=where)() is None


def test_an_accelerator_is_a_ranks_object(clean_env):
    accel = Accelerator(backend="single")
    assert processes.on_main_process(lambda: "ran", ranks=accel)() == "ran"
    assert processes.on_process(process_index=3, ranks=accel)(lambda: "ran")() == "ran"


def test_by_default_the_ranks_come_from_the_launch_environment(clean_env):
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    assert processes.on_main_process(lambda: "ran")() is None
    assert processes.on_last_process(lambda: "ran")() == "ran"
    assert processes.on_process(process_index=1)(lambda: "ran")() == "ran"
    with split_between_processes(["a", "b", "c"]) as mine:
        assert mine == ["c"]


def test_bad_process_indices():
    with pytest.raises(
        ConfigError, match=r"on_process needs process_index: write @on_process\(process_index=N\)"
    ):
        processes.on_process(lambda: None)
    with pytest.raises(ConfigError, match=r"on_process\(process_index=-1\) is not a process index"):
        processes.on_process(process_index=-1)
    with pytest.raises(ConfigError, match=r"on_local_process\(local_process_index=True\) is not"):
        processes.on_local_process(local_process_index=True)
    with pytest.raises(ConfigError, match="needs local_process_index"):
        processes.on_local_process(lambda: None)
    wrapped = processes.on_process(process_index=2, ranks=Where(0, 0, 2))(lambda: None)
    with pytest.raises(
        ConfigError,
        match=r"on_process\(process_index=2\) names no process: there are 2 "
        r"\(indices 0 to 1\)",
    ):
        wrapped()
    local = processes.on_local_process(local_process_index=5, ranks=Where(0, 0, 4))(lambda: None)
    with pytest.raises(ConfigError, match=r"local_process_index=5\) names no process"):
        local()
    with pytest.raises(ConfigError, match="takes a function, not 3"):
        processes.on_main_process(3)  # type: ignore[arg-type]


# -- goes_first -------------------------------------------------------------------------------


def test_goes_first_without_and_with_a_one_rank_group(clean_env, tmp_path):
    with processes.goes_first(True):
        pass
    with processes.goes_first(False):
        pass
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    with pytest.raises(KeyError):
        with processes.goes_first(True):  # the barrier runs after the block, also when it raises
            raise KeyError("x")
    with processes.goes_first(False):
        pass
