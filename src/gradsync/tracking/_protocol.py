"""What gradsync calls on a tracker: the :class:`Tracker` protocol."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tracker(Protocol):
    """What gradsync calls on a tracker, in this order: ``start()``, then
    ``store_init_configuration(config)`` when ``init_trackers`` got a config, ``log(values,
    step)`` for each ``accel.log`` and ``finish()`` at ``end_training()``; all on the main
    process only. An Accelerate ``GeneralTracker`` fits. A tracker object given in ``log_with``
    needs only ``log``: the other methods and attributes are used where it has them (its
    name defaults to its class's name, its ``tracker`` to the object itself).

    Attributes:
        name: the name ``get_tracker`` and ``init_kwargs`` / ``log_kwargs`` know it by.
    """

    name: str

    @property
    def tracker(self) -> Any:
        """The library's own object (a SummaryWriter, a wandb Run, ...)."""
        ...

    def start(self) -> None:
        """Create the run (files, the library's run object)."""
        ...

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the run's configuration (hyperparameters).

        Args:
            values: the ``config`` given to ``init_trackers``.
        """
        ...

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` at ``step``.

        Args:
            values: name -> value (Python numbers, strings, dicts, or the library's types).
            step: the step they belong to.
            **kwargs: this tracker's entry of ``log_kwargs``.
        """
        ...

    def finish(self) -> None:
        """Flush and close the run."""
        ...
