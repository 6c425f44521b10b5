"""Accelerate's ``PartialState`` and ``AcceleratorState``: where this process stands.

Not a shared singleton: each instance reads the process group (or, before there is one,
what the launcher set) when asked. ``wait_for_everyone`` and ``main_process_first`` need
the process group: on several processes they create it the way an ``Accelerator`` does,
and a later ``Accelerator`` joins it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from gradsync import processes
from gradsync._support import dist
from gradsync.accelerate.accelerator import GradientState
from gradsync.backends import kinds
from gradsync.backends.kinds import DistributedType

S = TypeVar("S")

__all__ = ["AcceleratorState", "GradientState", "PartialState"]


class PartialState:
    """Where this process stands (Accelerate's ``PartialState``)."""

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        if cpu:
            os.environ["GRADSYNC_DEVICE"] = "cpu"

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Nothing to reset: no state is shared between instances (each reads where the
        process stands when asked), so the next Accelerator takes its own settings anyway."""

    @property
    def num_processes(self) -> int:
        return dist.rank_info()[1]

    @property
    def process_index(self) -> int:
        return dist.rank_info()[0]

    @property
    def local_process_index(self) -> int:
        return dist.rank_info()[2]

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def initialized(self) -> bool:
        return True

    @property
    def debug(self) -> bool:
        return False

    @property
    def device(self) -> torch.device:
        from gradsync.backends._group import local_device

        return local_device()

    @property
    def backend(self) -> str | None:
        if not dist.is_distributed():
            return None
        import torch.distributed

        return str(torch.distributed.get_backend())

    @property
    def distributed_type(self) -> DistributedType:
        backend = "ddp" if self.num_processes > 1 else "single"
        return kinds.distributed_type(backend, self.device.type, self.num_processes)

    def _group(self) -> None:
        if self.num_processes > 1 and not dist.is_distributed():
            from gradsync.backends._group import ensure_process_group

            ensure_process_group("ddp", want_audit=False, self_check=True)

    def wait_for_everyone(self) -> None:
        self._group()
        dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        self._group()
        with processes.goes_first(self.is_main_process, dist.barrier):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        self._group()
        with processes.goes_first(self.is_local_main_process, dist.barrier):
            yield

    @contextlib.contextmanager
    def split_between_processes(self, inputs: S, apply_padding: bool = False) -> Iterator[S]:
        yield processes.process_share(inputs, self.process_index, self.num_processes, apply_padding)

    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return processes.on_main_process(function)

    def on_local_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return processes.on_local_main_process(function)

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return processes.on_last_process(function)

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    def destroy_process_group(self, group: Any = None) -> None:
        if dist.is_distributed():
            import torch.distributed

            torch.distributed.destroy_process_group(group)

    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type.value}\n"
            f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\nDevice: {self.device}\n"
        )


class AcceleratorState(PartialState):
    """``PartialState`` plus the settings of a run: ``accel.state`` of an Accelerator
    gives them for that run; a bare ``AcceleratorState()`` reports what the launcher set."""

    @property
    def mixed_precision(self) -> str:
        return os.environ.get("GRADSYNC_MIXED_PRECISION", "no")

    @property
    def deepspeed_plugin(self) -> Any:
        return None

    @property
    def fsdp_plugin(self) -> Any:
        return None
