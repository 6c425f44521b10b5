"""``accel.state``: where the run stands, in the names of Accelerate's ``AcceleratorState``.

A view over one Accelerator (never a shared singleton): every attribute is read from it
when asked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from gradsync.backends.kinds import DistributedType


class _Run(Protocol):
    """What ``RunState`` reads of an Accelerator."""

    @property
    def num_processes(self) -> int: ...

    @property
    def process_index(self) -> int: ...

    @property
    def local_process_index(self) -> int: ...

    @property
    def is_main_process(self) -> bool: ...

    @property
    def is_local_main_process(self) -> bool: ...

    @property
    def is_last_process(self) -> bool: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def distributed_type(self) -> DistributedType: ...

    @property
    def mixed_precision(self) -> str: ...

    @property
    def gradient_accumulation_steps(self) -> int: ...

    @property
    def deepspeed_plugin(self) -> Any: ...

    def wait_for_everyone(self) -> None: ...

    def main_process_first(self) -> contextlib.AbstractContextManager[None]: ...

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]: ...

    def print(self, *args: Any, **kwargs: Any) -> None: ...


class RunState:
    """What Accelerate's ``AcceleratorState`` tells a script, for one Accelerator."""

    def __init__(self, accel: _Run) -> None:
        self._accel = accel

    @property
    def num_processes(self) -> int:
        return self._accel.num_processes

    @property
    def process_index(self) -> int:
        return self._accel.process_index

    @property
    def local_process_index(self) -> int:
        return self._accel.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self._accel.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self._accel.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self._accel.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self._accel.num_processes > 1

    @property
    def initialized(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return self._accel.device

    @property
    def distributed_type(self) -> DistributedType:
        return self._accel.distributed_type

    @property
    def mixed_precision(self) -> str:
        return self._accel.mixed_precision

    @property
    def num_steps(self) -> int:
        """The accumulation steps (Accelerate's ``GradientState.num_steps``)."""
        return self._accel.gradient_accumulation_steps

    @property
    def deepspeed_plugin(self) -> Any:
        """An object with ``deepspeed_config`` under DeepSpeed, else None."""
        return self._accel.deepspeed_plugin

    @property
    def fsdp_plugin(self) -> Any:
        """None: FSDP2 is set with gradsync's ``fsdp_*`` settings (``accel.config``)."""
        return None

    def wait_for_everyone(self) -> None:
        self._accel.wait_for_everyone()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        with self._accel.main_process_first():
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        with self._accel.local_main_process_first():
            yield

    def print(self, *args: Any, **kwargs: Any) -> None:
        self._accel.print(*args, **kwargs)

    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type.value}\n"
            f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\nDevice: {self.device}\n"
            f"Mixed precision type: {self.mixed_precision}\n"
        )
