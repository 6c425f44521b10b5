"""The Backend protocol: what every adapter offers the Accelerator, and nothing more."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

    from gradsync.config import Config


@runtime_checkable
class Backend(Protocol):
    """One distributed backend, seen through the five things accumulation needs.

    ``policy`` is the resolved sync policy: "defer" (no gradient collective off the
    boundary), "every_step" (reduce on every micro-step) or "native" (whatever the
    backend does by itself).
    """

    name: ClassVar[str]
    policy: str

    def setup(self, config: Config) -> None:
        """Join (or create) the process group and pick the device."""

    @property
    def device(self) -> torch.device: ...

    def prepare(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
        """Wrap the model (DDP / FSDP2 / engine) and return the optimizer over its parameters."""

    def accumulate(self, model: torch.nn.Module, *, sync: bool) -> AbstractContextManager[None]:
        """Inside: backward accumulates locally unless ``sync``; the prior state is restored on exit."""

    def backward(self, loss: torch.Tensor) -> None:
        """Run the backward pass of an already scaled loss."""

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Apply the optimizer step at a boundary; return whether it was really applied."""

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        """Clear the gradients after a step."""

    def clip_grad_norm_(
        self, model: torch.nn.Module, parameters: Iterable[torch.Tensor], max_norm: float
    ) -> torch.Tensor:
        """Clip to ``max_norm`` and return the GLOBAL gradient norm (equal on all ranks)."""

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module inside whatever wrapper ``prepare`` put around it."""

    def state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """The full, unsharded state dict on CPU (at least on rank 0)."""

    def barrier(self) -> None:
        """Wait until every rank reaches this point."""
