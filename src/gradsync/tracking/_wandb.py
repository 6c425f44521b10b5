"""The Weights & Biases tracker."""

from __future__ import annotations

import os
from typing import Any, ClassVar

from gradsync.tracking._values import plain


class WandBTracker:
    """Weights & Biases, offline unless told otherwise: ``mode="offline"`` when neither
    ``WANDB_MODE`` nor ``init_kwargs["wandb"]["mode"]`` says another; its files go to
    ``project_dir/wandb/`` (``wandb sync`` uploads them later).

    Args:
        project_name: the W&B project.
        logging_dir: the folder W&B writes its ``wandb/`` folder into (None: W&B's own
            choice, ``WANDB_DIR`` or the current folder).
        **kwargs: passed to ``wandb.init`` (e.g. ``name``, ``tags``, ``entity``).
    """

    name: ClassVar[str] = "wandb"
    modules: ClassVar[tuple[str, ...]] = ("wandb",)
    needs_dir: ClassVar[bool] = False

    def __init__(self, project_name: str, logging_dir: str | None, **kwargs: Any) -> None:
        self.kwargs = {"project": project_name, **kwargs}
        if logging_dir is not None:
            self.kwargs.setdefault("dir", logging_dir)
        if "mode" not in self.kwargs and not os.environ.get("WANDB_MODE"):
            self.kwargs["mode"] = "offline"
        self.run: Any = None

    @property
    def tracker(self) -> Any:
        """The ``wandb`` Run."""
        return self.run

    def start(self) -> None:
        """``wandb.init``."""
        import wandb

        self.run = wandb.init(**self.kwargs)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Add ``values`` to the run's config.

        Args:
            values: the config.
        """
        self.run.config.update({k: plain(v) for k, v in values.items()}, allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``run.log(values, step=step)``: W&B takes numbers, strings, nested dicts and its
        own media types; calls at one step make one history row.

        Args:
            values: name -> value.
            step: the step (W&B ignores, with a warning, a step below its last).
            **kwargs: passed to ``run.log`` (e.g. ``commit``).
        """
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        """``run.finish()``."""
        if self.run is not None:
            self.run.finish()
