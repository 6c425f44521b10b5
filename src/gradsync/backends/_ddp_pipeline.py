"""The ddp backend's pipeline: ``parallelism={"pp": P, "dp_replicate": R}`` cuts the model into
P stages (``_pipeline``), pp outermost, and wraps each rank's stage in
``DistributedDataParallel`` over the R data-parallel ranks of its pipeline coordinate. DDP
replicates: ``dp_shard`` and ``tp`` stay 1 on this backend (refused with the settings).

A schedule step's reduction follows the micro-step's ``no_sync()`` (``_pipeline_sync.DDPSync``):
one all-reduce per window under "defer", one per schedule step under "every_step". The
stages' checkpoints go through ``torch.distributed.checkpoint`` as the FSDP2 stages' do
(``_fsdp_checkpoint``): each stage writes its own parameters and optimizer state, keyed by
the whole model's names, and an open window's local gradients are written per rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync import audit
from gradsync import mesh as nd_mesh
from gradsync._plan.batch_plan import BatchPlan
from gradsync._support import dist
from gradsync.backends import _modules, _pipeline, _pipeline_sync, _tensor_parallel
from gradsync.config import Config
from gradsync.errors import ConfigError

__all__ = ["DDPPipeline"]


class DDPPipeline:
    """The pipeline's settings on ddp, its mesh and this rank's data-parallel ranks."""

    def __init__(self, dims: nd_mesh.Parallelism, settings: _pipeline.Settings) -> None:
        self.dims = dims
        self.settings = settings
        self.mesh: Any = None  # the named mesh (pp, dp_replicate, dp_shard, tp) (build)
        self.data: dist.DataParallel | None = None  # this rank's data-parallel ranks (build)

    @classmethod
    def of(cls, config: Config) -> DDPPipeline | None:
        """The pipeline when ``parallelism`` has pp > 1 (None without one); one ConfigError
        line, before any collective, for what ddp cannot pipeline."""
        if config.parallelism is None and config.pp_split is None:
            return None
        given = nd_mesh.parse(config.parallelism or {"pp": 1, "dp_replicate": -1})
        dims = given.resolve(dist.world_size())
        settings = _pipeline.Settings.of(config, dims)
        if settings is None:
            return None
        if settings.per_rank > 1:
            raise ConfigError(
                f"pp_stages_per_rank={settings.per_rank} runs several stages on each rank, which "
                "backend='ddp' does not (one DDP-wrapped stage per rank); use backend='fsdp' "
                "for Interleaved1F1B, or pp_stages_per_rank=1"
            )
        return cls(dims, settings)

    def build(self, device: torch.device) -> None:
        """The named mesh, the pipeline's group and this rank's data-parallel group, labelled
        for the audit (collective: every rank builds them, in the same order)."""
        self.mesh = nd_mesh.build(self.dims, device.type)
        self.settings.bind(self.mesh)
        data_rank, group = nd_mesh.data_group(self.dims, dist.rank())
        audit.label_group(group, "dp")
        self.data = dist.DataParallel(data_rank, self.dims.data_parallel, group)

    def wrap(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        plan: BatchPlan,
        device: torch.device,
        **ddp_kwargs: Any,
    ) -> DDP:
        """This rank's stage of ``model`` in DDP over its data-parallel ranks, running the
        pipeline; the other stages' parameters leave the optimizers."""
        assert self.data is not None, "build() first"
        stage = self.settings.stage(model, plan, device, optimizers)
        held = {id(p): n for n, p in stage.named_parameters()}
        _modules.repoint(optimizers, held, dict(stage.named_parameters()), self.settings.dropped)
        wrapped = DDP(stage, process_group=self.data.group, **ddp_kwargs)
        self.settings.start(wrapped, device, _pipeline_sync.DDPSync())
        return wrapped

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        """The global norm: every stage's gradients (each replicated over its data ranks)."""
        found = _tensor_parallel.clip_grad_norm_(
            parameters, max_norm, norm_type, self.settings.group
        )
        return found.detach()
