"""Loading a checkpoint never runs code from it, on every backend's format (2 ranks, one
process group): DDP's plain files, FSDP2's DCP metadata and a non-tensor item of its shards,
DeepSpeed ZeRO 2 and 3 model and optimizer states (rank 1's own file too), fairscale's
gathered optimizer state. Each is rewritten with a payload and a manifest that matches."""

from __future__ import annotations

import pytest

from harness import Scenario, Shared
from scenarios import safety

TARGETS = {
    "ddp": (["model_0.pt", "optimizer_0.pt", "rng_rank1.pt"], None),
    "fsdp": (["pickle:dcp_0/.metadata", "dcp-item:dcp_optimizer_0", "schedulers.pt"], None),
    "zero2": (
        [
            "deepspeed/state/mp_rank_00_model_states.pt",
            "deepspeed/state/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        ],
        2,
    ),
    "zero3": (
        [
            "deepspeed/state/zero_pp_rank_0_mp_rank_00_model_states.pt",
            "deepspeed/state/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ],
        3,
    ),
    "fairscale": (["model_0.pt", "optimizer_0.pt"], None),
}
BACKEND = {
    "ddp": "ddp",
    "fsdp": "fsdp",
    "zero2": "deepspeed",
    "zero3": "deepspeed",
    "fairscale": "fairscale",
}
CASES = [(name, target) for name, (targets, _) in TARGETS.items() for target in targets]


def scenarios(root):
    return {
        name: Scenario(
            safety.tampered_loads,
            backend=BACKEND[name],
            folder=str(root / name),
            targets=targets,
            stage=stage,
        )
        for name, (targets, stage) in TARGETS.items()
    }


SHARED = Shared("gloo2", scenarios, timeout=900)


@pytest.fixture(scope="module")
def results(shared):
    return shared(SHARED)


@pytest.mark.parametrize(
    "name, target", CASES, ids=[f"{n}-{t.rpartition('/')[2]}" for n, t in CASES]
)
def test_a_payload_never_runs_and_the_load_names_the_file(results, name, target):
    for rank, out in enumerate(results[name]):
        file = target.partition(":")[2] if ":" in target else target
        if target.startswith("pickle:") or not target.startswith("dcp-item:"):
            assert file in out["files"], (file, out["files"])
        seen = out[target]
        error = seen["error"]
        assert error, f"rank {rank}: the tampered checkpoint loaded"
        assert "\n" not in error and "payload.plant" in error, error
        where = file if not target.startswith("dcp-item:") else f"{file}/"
        assert where in error, error
        assert not seen["ran_when_refused"], f"rank {rank}: the payload ran"
        assert seen["unchanged"], f"rank {rank}: the model changed although the load was refused"
        assert seen["ran_when_trusted"] and seen["trusted_loads_the_training"], seen
        assert seen["steps_after_trusted"] == 2
