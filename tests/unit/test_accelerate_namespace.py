"""gradsync.accelerate in one process: Accelerate's names, its batch dealing compared with
Accelerate's own samplers, its scheduler rule, and the refusals that say what to use."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from gradsync.accelerate.rules import accelerate_rules
from gradsync.data.dealing import BatchDeal, IterableDeal, split_size
from gradsync.errors import ConfigError
from gradsync.rules import GRADSYNC

accelerate_data = pytest.importorskip("accelerate.data_loader")


@pytest.mark.parametrize(
    ("n", "batch", "world", "drop_last", "even"),
    [
        c
        for c in itertools.product(
            [1, 5, 7, 8, 16, 17, 23], [1, 3, 4], [2, 3], [False, True], [True, False]
        )
    ],
)
def test_batches_are_dealt_as_accelerate_deals_them(
    n: int, batch: int, world: int, drop_last: bool, even: bool
) -> None:
    sampler = BatchSampler(SequentialSampler(range(n)), batch, drop_last)
    for rank in range(world):
        theirs = accelerate_data.BatchSamplerShard(
            sampler, world, rank, split_batches=False, even_batches=even
        )
        ours = BatchDeal(sampler, rank=rank, world_size=world, split=False, even=even)
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs)


@pytest.mark.parametrize(
    ("n", "batch", "world", "drop_last", "even"),
    [c for c in itertools.product([1, 5, 8, 13, 16], [2, 4, 6], [2], [False, True], [True, False])],
)
def test_split_batches_are_sliced_as_accelerate_slices_them(
    n: int, batch: int, world: int, drop_last: bool, even: bool
) -> None:
    sampler = BatchSampler(SequentialSampler(range(n)), batch, drop_last)
    for rank in range(world):
        theirs = accelerate_data.BatchSamplerShard(
            sampler, world, rank, split_batches=True, even_batches=even
        )
        ours = BatchDeal(sampler, rank=rank, world_size=world, split=True, even=even)
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs)


@pytest.mark.parametrize(
    ("n", "batch", "world", "split", "drop_last"),
    [
        c
        for c in itertools.product([3, 10, 16, 17], [2, 4], [2, 3], [False, True], [False, True])
        if not (c[3] and c[1] % c[2])
    ],
)
def test_an_iterable_dataset_is_dealt_as_accelerate_deals_it(
    n: int, batch: int, world: int, split: bool, drop_last: bool
) -> None:
    data = list(range(n))
    per_rank = split_size(batch, world) if split else batch
    for rank in range(world):
        theirs = accelerate_data.IterableDatasetShard(
            data,
            batch_size=batch,
            drop_last=drop_last,
            num_processes=world,
            process_index=rank,
            split_batches=split,
        )
        ours = IterableDeal(
            data,
            rank=rank,
            per_rank=per_rank,  # type: ignore[arg-type]
            per_round=batch if split else batch * world,
            drop_last=drop_last,
        )
        assert list(ours) == list(theirs)


def test_a_batch_size_the_processes_do_not_divide_is_accelerates_error() -> None:
    with pytest.raises(
        ConfigError,
        match=r"batch size \(5\) needs to be a round multiple of the number of processes \(2\)",
    ):
        split_size(5, 2)


def test_the_rule_books() -> None:
    assert GRADSYNC.scheduler_steps(4) == 1 and GRADSYNC.loss_divisor == "window"
    rules = accelerate_rules()
    assert (
        rules.scheduler_steps(4) == 4
        and rules.loss_divisor == "steps"
        and rules.dealing == "batches"
    )
    assert accelerate_rules(split_batches=True).scheduler_steps(4) == 1


def test_a_scheduler_steps_once_per_process_per_update_under_accelerates_rule() -> None:
    from gradsync._core.wrappers import PreparedScheduler

    done = [0]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    lambdas = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / 8)
    scheduler = PreparedScheduler(lambdas, lambda: done[0], repeat=2)
    scheduler.step()  # no optimizer step yet: nothing
    assert lambdas.last_epoch == 0
    done[0] = 1
    scheduler.step()
    assert lambdas.last_epoch == 2
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=3)
    capped = PreparedScheduler(one_cycle, lambda: done[0], repeat=2)
    for n in range(2, 5):
        done[0] = n
        capped.step()  # never past total_steps (OneCycleLR would raise)
    assert one_cycle.last_epoch == 3


def test_accelerates_names_import_from_gradsync(clean_env: pytest.MonkeyPatch) -> None:
    from gradsync.accelerate import (  # noqa: F401
        Accelerator,
        DataLoaderConfiguration,
        DistributedDataParallelKwargs,
        DistributedType,
        GradientAccumulationPlugin,
        InitProcessGroupKwargs,
        PartialState,
        ProjectConfiguration,
        find_executable_batch_size,
        skip_first_batches,
    )
    from gradsync.accelerate.logging import get_logger
    from gradsync.accelerate.utils import gather_object, set_seed, tqdm  # noqa: F401

    accelerate = pytest.importorskip("accelerate")
    assert DistributedType.MULTI_CPU == accelerate.DistributedType.MULTI_CPU
    assert DistributedType.FSDP == "FSDP"
    state = PartialState()
    assert (state.num_processes, state.process_index, state.is_main_process) == (1, 0, True)
    logger = get_logger("gradsync-test")
    logger.logger.setLevel(logging.INFO)
    logger.info("main only", main_process_only=True)
    logger.info("in order", main_process_only=False, in_order=True)


def test_an_accelerate_name_gradsync_lacks_is_one_line_saying_what_to_use() -> None:
    with pytest.raises(
        ImportError, match=r"gradsync.accelerate has no notebook_launcher .*gradsync launch"
    ):
        from gradsync.accelerate import notebook_launcher  # noqa: F401
    with pytest.raises(
        ImportError, match=r"gradsync.accelerate.utils has no DummyOptim .*deepspeed_config"
    ):
        from gradsync.accelerate.utils import DummyOptim  # noqa: F401
    with pytest.raises(ImportError, match="cannot import name"):
        from gradsync.accelerate import NoSuchThing  # noqa: F401


def test_accelerator_keywords_gradsync_does_not_take_are_one_line(
    clean_env: pytest.MonkeyPatch,
) -> None:
    from gradsync.accelerate import Accelerator

    with pytest.raises(ConfigError, match=r"fsdp_plugin=.*backend='fsdp'"):
        Accelerator(fsdp_plugin=object())
    with pytest.raises(ConfigError, match="dispatch_batches"):
        from gradsync.accelerate import DataLoaderConfiguration

        Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    with pytest.raises(ConfigError, match="unknown setting.*no_such_keyword"):
        Accelerator(no_such_keyword=1)


def test_a_member_gradsync_lacks_is_one_line(clean_env: pytest.MonkeyPatch) -> None:
    from gradsync.accelerate import Accelerator

    accel = Accelerator()
    with pytest.raises(AttributeError, match="has no lomo_backward .*torch optimizer"):
        accel.lomo_backward  # noqa: B018
    assert not hasattr(accel, "no_such_member")


def test_the_accelerators_state_and_kind(clean_env: pytest.MonkeyPatch) -> None:
    import gradsync
    from gradsync.accelerate import Accelerator, DistributedType

    for cls in (gradsync.Accelerator, Accelerator):
        accel = cls()
        assert accel.distributed_type == DistributedType.NO
        assert accel.state.num_processes == 1 and accel.state.distributed_type == "NO"
        assert "Num processes: 1" in repr(accel.state)


def test_reset_state_is_a_no_op_the_next_accelerator_takes_its_own_settings(
    clean_env: pytest.MonkeyPatch,
) -> None:
    from gradsync.accelerate import Accelerator
    from gradsync.accelerate.state import AcceleratorState, GradientState, PartialState

    first = Accelerator(gradient_accumulation_steps=2)
    AcceleratorState._reset_state()
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()
    GradientState._reset_state()
    assert first.gradient_state.num_steps == 2 and first.state.num_processes == 1
    assert Accelerator(gradient_accumulation_steps=3).gradient_state.num_steps == 3


def test_find_executable_batch_size_halves_until_it_runs() -> None:
    from gradsync.accelerate.utils import find_executable_batch_size

    tried = []

    @find_executable_batch_size(starting_batch_size=16)
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 12:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")
        return batch_size

    assert train() == 12 and tried == [16, 14, 12]  # Accelerate's 90 %
    assert train() == 12 and tried[3:] == [12]  # a later call starts from the size that ran

    @find_executable_batch_size(starting_batch_size=8, reduce_batch_size_fn=lambda: 2)
    def halved(batch_size: int) -> int:
        if batch_size > 2:
            raise RuntimeError("CUDA out of memory.")
        return batch_size

    assert halved() == 2

    @find_executable_batch_size(starting_batch_size=2)
    def never(batch_size: int) -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    with pytest.raises(RuntimeError, match="No executable batch size found"):
        never()


def test_a_loader_is_dealt_one_generator_for_every_rank(clean_env: pytest.MonkeyPatch) -> None:
    from gradsync.data.dealing import deal_batches

    loader = DataLoader(list(range(10)), batch_size=2, shuffle=True)
    torch.manual_seed(0)
    dealt = [
        deal_batches(
            DataLoader(list(range(10)), batch_size=2, shuffle=True),
            rank=r,
            world_size=2,
            split=False,
            even=True,
        )
        for r in range(2)
    ]
    assert isinstance(loader.sampler, RandomSampler)
    seen = sorted(x for d in dealt for b in d for x in b.tolist())
    assert len(seen) == 12  # 10 samples, the last round padded by 2 from the pass's start


def test_every_name_in_the_migration_table_is_accelerates_and_imports_from_gradsync(
    clean_env: pytest.MonkeyPatch,
) -> None:
    import importlib

    from gradsync.accelerate import _names

    for module, names in _names.SUPPORTED.items():
        theirs = importlib.import_module(module)
        ours = importlib.import_module("gradsync." + module)
        for name in names:
            assert hasattr(theirs, name), f"{module}.{name} is not Accelerate's"
            assert hasattr(ours, name), f"gradsync.{module}.{name} is missing"
        for name in getattr(ours, "__all__", []):
            assert name in names, f"gradsync.{module}.{name} is not in the migration table"
    for module, refused in _names.REFUSED.items():
        theirs = importlib.import_module(module)
        for name in refused:
            assert hasattr(theirs, name), f"{module}.{name} is not Accelerate's"
            with pytest.raises(ImportError, match=f"has no {name} "):
                exec(f"from gradsync.{module} import {name}")
    member_names = {n.strip() for key in _names.MEMBERS for n in key.split("/")}
    from gradsync.accelerate import Accelerator

    set_in_init = {
        "state",
        "gradient_state",
        "deepspeed_engine_wrapped",
    }  # Accelerate's instance attributes
    for name in (member_names | set(_names.REFUSED_MEMBERS)) - set_in_init:
        assert hasattr(importlib.import_module("accelerate").Accelerator, name), name
    ours = Accelerator()
    for name in member_names:
        assert hasattr(ours, name), name


def test_a_schedule_sized_for_accelerates_rule_is_said_when_the_run_ends() -> None:
    from transformers import get_scheduler

    from gradsync._plan.planned_steps import sized_per_process, warn_unfinished

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sized = get_scheduler("linear", optimizer, num_warmup_steps=2, num_training_steps=10)
    message = sized_per_process(sized, 6, 2)
    assert (
        message is not None
        and "ended after 6 optimizer steps" in message
        and "built for 10 steps" in message
    )
    assert "gradsync.accelerate" in message
    assert sized_per_process(sized, 10, 2) is None  # the schedule ran to its end
    assert sized_per_process(sized, 9, 2) is None  # nearly so: not Accelerate's sizing
    assert sized_per_process(sized, 6, 1) is None  # one process: both rules agree
    said: list[str] = []
    warn_unfinished([sized], lambda: 6, 2, False, said.append)
    assert said == []  # said on the main process only
    warn_unfinished([sized, sized], lambda: 6, 2, True, said.append)
    assert len(said) == 1


def test_the_logger_prefixes_the_rank_and_logs_in_order(caplog: pytest.LogCaptureFixture) -> None:
    from gradsync.accelerate.logging import get_logger

    logger = get_logger("gradsync-test-prefix", log_level="INFO")
    with caplog.at_level(logging.INFO, logger="gradsync-test-prefix"):
        logger.info("main only")
        logger.info("every rank", main_process_only=False)
        logger.info("in order", in_order=True)
    assert [r.getMessage() for r in caplog.records] == [
        "[RANK 0] main only",
        "[RANK 0] every rank",
        "[RANK 0] in order",
    ]


def test_all_means_the_installed_tracker_libraries_as_in_accelerate() -> None:
    from gradsync.accelerate.config import accelerate_trackers
    from gradsync.accelerate.utils import LoggerType
    from gradsync.tracking import tracker_available

    installed = [t for t in ("tensorboard", "wandb", "mlflow") if tracker_available(t)]
    assert accelerate_trackers("all") == installed
    assert accelerate_trackers(LoggerType.ALL) == installed
    assert accelerate_trackers(["all", "csv"]) == [*installed, "csv"]
    assert accelerate_trackers("tensorboard") == "tensorboard"


def test_local_sgd_in_one_process_does_nothing_and_a_sharding_backend_refuses_it(
    clean_env: pytest.MonkeyPatch,
) -> None:
    from gradsync.accelerate import Accelerator
    from gradsync.accelerate.local_sgd import LocalSGD
    from gradsync.backends.fsdp import FSDPBackend

    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    before = [p.detach().clone() for p in model.parameters()]
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=1) as local_sgd:
        local_sgd.step()
    assert not local_sgd.enabled and local_sgd.num_steps == 1  # Accelerate's counting
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(ConfigError, match=r"^LocalSGD needs every process .*the fsdp backend"):
        FSDPBackend().pause_sync(model)
