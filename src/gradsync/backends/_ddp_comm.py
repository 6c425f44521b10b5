"""``comm_hook`` on DDP: torch's communication hooks (``ddp_comm_hooks``) registered on the
prepared model, and PowerSGD's state kept per optimizer step.

DDP runs a communication hook where it would all-reduce a bucket: never under ``no_sync()``,
so under ``sync_policy="defer"`` the hook runs once per window, at the boundary, and
PowerSGD's error feedback and warm-start matrices move once per optimizer step. gradsync
wraps the PowerSGD hooks to keep that true when a window is dropped (the state goes back to
where the window found it), when DDP rebuilds its buckets and when a checkpoint is loaded
(the state follows the parameters, not the bucket numbers: ``_powersgd_compat``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync.backends import _compression, _ddp_compat
from gradsync.backends import _powersgd_compat as compat
from gradsync.errors import ConfigError
from gradsync.options.compression import POWER_SGD

if TYPE_CHECKING:
    from gradsync.config import Config

log = logging.getLogger("gradsync")

HOOKS = ("fp16", "bf16", "power_sgd", "batched_power_sgd")
_HALF_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
_WRAPPERS = {
    "fp16": default_hooks.fp16_compress_wrapper,
    "bf16": default_hooks.bf16_compress_wrapper,
}


@dataclass(frozen=True)
class HookSettings:
    """What ``comm_hook``, ``comm_wrapper`` and ``comm_state_option`` ask of DDP."""

    hook: str
    wrapper: str = "no"
    options: dict[str, Any] = field(default_factory=dict)


def settings(config: Config, device: torch.device) -> HookSettings | None:
    """The hook settings of ``config`` (None: no hook), checked at setup: a device without
    bf16 collectives, or PowerSGD options torch refuses, are one line each."""
    hook = _compression.supported(config, "ddp", HOOKS, "DDP communication hooks")
    if hook == "no":
        return None
    _compression.half_dtype(hook, device)
    _compression.half_dtype(config.comm_wrapper, device)
    gpu = device.type in ("cuda", "xpu") and _ddp_compat.bf16_hooks_run()
    if "bf16" in (hook, config.comm_wrapper) and not gpu:  # a CUDA build on CPU cannot either
        what = "comm_hook" if hook == "bf16" else "comm_wrapper"
        raise ConfigError(
            f"{what}='bf16' on backend='ddp' needs bf16 collectives that torch's DDP hooks "
            f"accept (NCCL 2.10+ on a GPU), and this {device.type!r} run has none; use "
            f"{what}='fp16', or backend='fsdp' (its bf16 reduce dtype runs here)"
        )
    options = dict(config.comm_state_option or {})
    if hook in POWER_SGD:
        state = compat.make_state(options)  # torch's own checks, before any collective
        if hook == "batched_power_sgd" and not compat.batched_hook_works():
            log.warning("gradsync: %s", _batched_broken(state.start_powerSGD_iter))
    return HookSettings(hook, config.comm_wrapper, options)


def _batched_broken(start: int) -> str:
    return (
        f"comm_hook='batched_power_sgd': torch {torch.__version__}'s batched PowerSGD hook fails "
        f"once it compresses (from optimizer step start_powerSGD_iter={start} on: its "
        "orthogonalization takes no 2-D matrix); use comm_hook='power_sgd'"
    )


class Hooked:
    """The hook registered on one prepared DDP model; for PowerSGD, its state and what it
    needs to stay per optimizer step (a copy taken when a window first runs the hook, each
    bucket's layout, the buckets loaded from a checkpoint and not yet met again)."""

    def __init__(self, model: DDP, chosen: HookSettings) -> None:
        self.hook = chosen.hook
        self.state: Any = None
        if chosen.hook not in POWER_SGD:
            # The hook's state is the group it all-reduces over: the model's own (under pp, a
            # stage's data-parallel ranks), never the world's default.
            model.register_comm_hook(model.process_group, _HALF_HOOKS[chosen.hook])
            return
        self._names = {id(p): name for name, p in model.module.named_parameters()}
        self._batched = chosen.hook == "batched_power_sgd"
        self._broken = self._batched and not compat.batched_hook_works()
        inner = (
            powerSGD_hook.batched_powerSGD_hook if self._batched else powerSGD_hook.powerSGD_hook
        )
        self._inner = _WRAPPERS[chosen.wrapper](inner) if chosen.wrapper != "no" else inner
        self.state = compat.make_state(chosen.options, model.process_group)
        # torch's PowerSGD hook chains a bucket's all-reduces by callbacks, which gloo may run
        # after the next bucket's hook on one rank and before it on the other: a hang or an
        # abort ("Received data size doesn't match") once there are two buckets. On gloo each
        # bucket's reduction ends before the next bucket's hook starts.
        self._serial = "gloo" in str(dist.get_backend(model.process_group))
        self._layouts: dict[int, compat.Layout] = {}
        self._pending: list[dict[str, Any]] = []
        self._copy: tuple[dict[str, Any], dict[int, compat.Layout], list[Any]] | None = None
        model.register_comm_hook(self.state, self._run)

    def _run(self, state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        if self._broken and state.iter >= state.start_powerSGD_iter:  # every rank alike
            raise RuntimeError(_batched_broken(state.start_powerSGD_iter))
        if self._copy is None:  # the window's first hook: what a dropped window goes back to
            self._copy = (compat.snapshot(state), dict(self._layouts), list(self._pending))
        index = bucket.index()
        layout = tuple((self._names[id(p)], tuple(p.shape)) for p in bucket.parameters())
        if self._layouts.get(index, layout) != layout:  # DDP rebuilt its buckets
            self._pending += compat.take(state, self._layouts)
            self._layouts = {}
        if self._pending:
            compat.install(
                state,
                index,
                layout,
                self._pending,
                batched=self._batched,
                device=bucket.buffer().device,
            )
        self._layouts[index] = layout
        if bucket.is_last():  # every bucket of this backward has its state
            self._pending = []
        future: torch.futures.Future[torch.Tensor] = self._inner(state, bucket)
        if self._serial:
            future.wait()
        return future

    def window_ended(self) -> None:
        """The window's update is made: its state is the next window's starting point."""
        if self.state is not None:
            self._copy = None

    def window_dropped(self) -> None:
        """The window is dropped: the state as the window found it."""
        if self.state is not None and self._copy is not None:
            snap, self._layouts, self._pending = self._copy
            compat.put_back(self.state, snap)
            self._copy = None

    def state_dict(self) -> dict[str, Any] | None:
        """PowerSGD's state as plain data and CPU tensors (None for a stateless hook)."""
        if self.state is None:
            return None
        return {"hook": self.hook, **compat.capture(self.state, self._layouts, self._pending)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Take back what ``state_dict`` gave; the buckets' state is put in place as the hook
        meets each bucket (whatever DDP's bucket layout is then)."""
        self._pending = compat.restore(self.state, saved)
        self._layouts = {}
        self._copy = None


# DDP checks a hook's annotations as objects, and this module's are text (postponed).
Hooked._run.__annotations__.update(
    {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}  # type: ignore[attr-defined]
)


def load_saved(hooked: Hooked, saved: dict[str, Any], file: Any) -> None:
    """Load one model's saved hook state from the checkpoint ``file``: a state of the other
    PowerSGD hook starts this one afresh, said once."""
    if saved.get("hook") != hooked.hook:
        log.warning(
            "gradsync: %s holds %s's state and this run uses comm_hook=%r: it starts afresh",
            file,
            saved.get("hook"),
            hooked.hook,
        )
        return
    hooked.load_state_dict(saved)
