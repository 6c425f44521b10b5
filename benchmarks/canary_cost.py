"""What the FSDP2 canary costs beside the prepare it runs in (on a torch newer than the tested
range only; on the tested releases it does not run).

    python benchmarks/canary_cost.py --out bench-out          # about a minute on 2 cores

On 2 ranks, in one run: ``accel.prepare`` of the sync-overhead benchmark's MLP (4.2 M
parameters) and its optimizer on ``backend="fsdp"``, a fresh model each time, and the canary's
check (``backends/_fsdp_canary.check``: a tiny module sharded over the same mesh, a window's
gradients saved, cleared and restored, compared with the uninterrupted window), alternating;
the medians and their ratio (target: <= 1 %). With ``--mesh 2d`` the mesh is 1 x 2 (HSDP),
where the canary also checks the partial buffers.

Writes canary_cost.json and canary_cost.md to --out.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from small_bench import QUICK_SIZES, SIZES, parser, run_workers, write  # noqa: E402


def worker(spec: dict[str, Any], out: Path) -> None:
    import json

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from bench_cells import Sizes, sgd

    from gradsync import Accelerator
    from gradsync.backends import _fsdp_canary

    torch.set_num_threads(1)
    sizes = Sizes(**spec["sizes"])
    options = {"fsdp_mesh": [1, 2]} if spec["mesh"] == "2d" else {}
    accel = Accelerator(backend="fsdp", gradient_accumulation_steps=spec["k"], **options)
    backend = accel._backend
    times: dict[str, list[float]] = {"prepare_ms": [], "canary_ms": []}
    for rep in range(spec["reps"]):
        for what in ("prepare_ms", "canary_ms") if rep % 2 == 0 else ("canary_ms", "prepare_ms"):
            dist.barrier()
            start = time.perf_counter()
            if what == "prepare_ms":
                model = sizes.model(seed=rep)
                accel.prepare(model, sgd(model.parameters()))
            else:
                failed = _fsdp_canary.check(backend._mesh, backend._device)
                assert failed == [], failed
            times[what].append((time.perf_counter() - start) * 1000)
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps({"times": times}))


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0], "a tiny model and a few repetitions (a smoke run)")
    p.add_argument("--reps", type=int, default=10, help="prepares and checks, alternating")
    p.add_argument("--mesh", choices=("1d", "2d"), default="1d")
    args = p.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else SIZES
    spec = {"sizes": sizes, "k": args.k, "reps": 2 if args.quick else args.reps, "mesh": args.mesh}
    raw = run_workers(__file__, spec, f"canary cost: FSDP2 ({args.mesh}), 2 ranks")
    if raw is None:
        return 1
    prepare = statistics.median(raw["times"]["prepare_ms"])
    canary = statistics.median(raw["times"]["canary_ms"])
    result = {
        "mesh": args.mesh,
        "sizes": sizes,
        "prepare_ms_median": prepare,
        "canary_ms_median": canary,
        "ratio": canary / prepare,
        **raw["times"],
    }
    table = (
        f"| FSDP2 mesh | prepare (median ms) | canary (median ms) | canary / prepare |\n"
        f"|---|---|---|---|\n"
        f"| {args.mesh} | {prepare:.1f} | {canary:.1f} | {canary / prepare:.2%} |\n"
    )
    write(args.out, "canary_cost", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
