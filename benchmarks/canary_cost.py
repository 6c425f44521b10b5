"""What the FSDP2 canary costs beside the save inside a window that runs it (on a torch
newer than the tested range only, once per process; on the tested releases it does not run,
and no prepare ever runs it).

    python benchmarks/canary_cost.py --out bench-out          # about a minute on 2 cores

On 2 ranks, in one run: ``accel.prepare`` of the sync-overhead benchmark's MLP (4.2 M
parameters) and its optimizer on ``backend="fsdp"`` (a fresh model each time), a save inside
a window of that model (``accel.save_state`` after one micro-step, the check already run),
and the canary's check (``backends/_fsdp_canary.check``: a tiny module sharded over the same
mesh, a window's gradients saved, cleared and restored, compared with the uninterrupted
window), alternating; the medians and the ratios (target: <= 1 % of a prepare, which now runs
no check at all; the check's own cost is stated against the save that pays it once). With
``--mesh 2d`` the mesh is 1 x 2 (HSDP), where the canary also checks the partial buffers.

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
    import tempfile

    import torch.nn.functional as F

    times: dict[str, list[float]] = {"prepare_ms": [], "canary_ms": [], "save_ms": []}
    folder = Path(tempfile.mkdtemp(prefix="gradsync-canary-")) if dist.get_rank() == 0 else None
    shared = [str(folder)]
    dist.broadcast_object_list(shared)
    order = ("prepare_ms", "save_ms", "canary_ms")
    for rep in range(spec["reps"]):
        for what in order if rep % 2 == 0 else order[::-1]:
            model = sizes.model(seed=rep)
            opt = sgd(model.parameters())
            if what == "save_ms":  # one micro-step, then a save inside the window
                model, opt = accel.prepare(model, opt)
                x, y = sizes.batches(dist.get_rank(), 1, backend._device)[0]
                with accel.accumulate(model):
                    accel.backward(F.mse_loss(model(x), y))
            dist.barrier()
            start = time.perf_counter()
            if what == "prepare_ms":
                accel.prepare(model, opt)
            elif what == "save_ms":
                accel.save_state(f"{shared[0]}/rep{rep}")
            else:
                failed = _fsdp_canary.check(backend._mesh, backend._device)
                assert failed == [], failed
            times[what].append((time.perf_counter() - start) * 1000)
            if what == "save_ms":
                with accel.accumulate(model):  # close the window before the next prepare
                    accel.backward(F.mse_loss(model(x), y))
                accel.free_memory()
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
    save = statistics.median(raw["times"]["save_ms"])
    canary = statistics.median(raw["times"]["canary_ms"])
    result = {
        "mesh": args.mesh,
        "sizes": sizes,
        "prepare_ms_median": prepare,
        "save_ms_median": save,
        "canary_ms_median": canary,
        "prepare_extra": 0.0,  # prepare runs no check
        "ratio_to_save": canary / save,
        "ratio": canary / prepare,  # what it would cost were it run at prepare
        **raw["times"],
    }
    table = (
        "| FSDP2 mesh | prepare (median ms) | of which the check | save inside a window "
        "(median ms) | the check, once (median ms) | check / save | check / prepare, had it run there |\n"
        "|---|---|---|---|---|---|---|\n"
        f"| {args.mesh} | {prepare:.1f} | 0 | {save:.1f} | {canary:.1f} | {canary / save:.1%} "
        f"| {canary / prepare:.1%} |\n"
    )
    write(args.out, "canary_cost", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
