"""Accelerate's own test scripts, shipped in its wheel (``accelerate/test_utils/scripts/``
``test_script.py``, ``test_ops.py``, ``test_sync.py``), run against ``gradsync.accelerate``
on 2 CPU ranks in ONE ``gradsync launch``.

Each script is read from the installed wheel and respelled in memory: every name it imports
from ``accelerate`` comes from the same path under ``gradsync.accelerate`` (Accelerate's
private submodules ``accelerate.utils.operations`` / ``.dataclasses`` from
``gradsync.accelerate.utils``), except the test fixtures, which stay Accelerate's (see
``KEPT``). A name gradsync lacks becomes a stand-in that raises when used, so only the test
functions that use it fail. The test functions each script's ``main()`` calls on several
processes (and the ``split_batches`` / ``sync_each_batch`` variants ``main()`` runs on GPUs
only) are each either in ``PASSING`` (they must pass on both ranks) or in ``EXCLUDED``, with
the reason gradsync differs.

This file is also the script every rank runs (``__main__`` below).
"""

from __future__ import annotations

import ast
import importlib
import itertools
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = ("test_script", "test_ops", "test_sync")

#: Names imported from ``accelerate`` that stay Accelerate's: they make the data or probe the
#: machine, they are not what the scripts test. ``are_the_same_tensors`` is replaced by
#: ``same_on_every_rank`` (Accelerate's reads Accelerate's own process state, which
#: ``gradsync launch`` never creates).
KEPT = {
    "RegressionDataset",
    "RegressionModel",
    "assert_exception",
    # probes of the machine and of installed packages
    "is_bf16_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_fp16_available",
    "is_hpu_available",
    "is_mps_available",
    "is_pytest_available",
    # a torch Sampler the test builds its own DataLoader with (not prepared by it)
    "SeedableRandomSampler",
}

#: (script, call) that pass against gradsync.accelerate; ``accelerator`` is an Accelerator
#: and ``state`` a PartialState, as in the scripts' ``main()``.
PASSING: list[tuple[str, str]] = [
    ("test_script", "init_state_check()"),
    ("test_script", "process_execution_check()"),
    ("test_script", "test_split_between_processes_list()"),
    ("test_script", "test_split_between_processes_nested_dict()"),
    ("test_script", "test_split_between_processes_tensor()"),
    ("test_script", "test_split_between_processes_evenly()"),
    ("test_script", "check_seedable_sampler()"),
    ("test_script", "check_seedable_sampler_with_data_seed()"),
    # one process's training equals 2 ranks', with and without split_batches, fp32/bf16/fp16
    ("test_script", "training_check(use_seedable_sampler=False)"),
    ("test_script", "training_check(use_seedable_sampler=True)"),
    ("test_script", "test_trigger()"),
    *[
        ("test_ops", f"{name}(state)")
        for name in (
            "test_gather",
            "test_gather_object",
            "test_gather_non_contiguous",
            "test_broadcast",
            "test_pad_across_processes",
            "test_reduce_sum",
            "test_reduce_mean",
            "test_reduce_max",
        )
    ],
    ("test_sync", "test_distributed_sync(accelerator)"),
    # the LR after every step and the gradients' sync points equal Accelerate's
    *[
        ("test_sync", f"test_gradient_accumulation_with_opt_and_scheduler({split}, False, {each})")
        for split, each in itertools.product((True, False), (True, False))
    ],
]

DISPATCH = (
    "DataLoaderConfiguration(dispatch_batches=True) is refused: every rank reads its "
    "own batches, none is sent from rank 0"
)
NO_LOADER_FUNCTION = (
    "accelerate.data_loader.prepare_data_loader (the function form, building "
    "Accelerate's DataLoaderShard) is not in gradsync.accelerate: loaders are "
    "prepared by Accelerator.prepare"
)
WINDOW_CLEARS = (
    "gradsync clears the gradients when a window opens; the test never calls "
    "zero_grad, so under Accelerate the second window's gradients still hold the "
    "first's and the test's single-process reference accumulates them too"
)

#: call -> why it is not run against gradsync.accelerate
EXCLUDED: dict[str, str] = {
    "rng_sync_check()": "synchronize_rng_states is refused by gradsync.accelerate.utils: "
    "prepared loaders keep every rank's generator equal themselves",
    "dl_preparation_check()": NO_LOADER_FUNCTION,
    "central_dl_preparation_check()": f"{NO_LOADER_FUNCTION}; and {DISPATCH}",
    "custom_sampler_check()": f"{NO_LOADER_FUNCTION}; and it inspects Accelerate's "
    "dl.batch_sampler.batch_sampler",
    "check_seedable_sampler_in_batch_sampler_shard()": f"{NO_LOADER_FUNCTION}; and it inspects "
    "Accelerate's BatchSamplerShard",
    "test_split_between_processes_dataset(datasets_Dataset)": "needs Hugging Face datasets",
    "test_reinstantiated_state()": "expects Accelerate's AttributeError after "
    "AcceleratorState._reset_state(); gradsync shares no state "
    "between instances, so _reset_state is a no-op",
    "test_op_checker(state)": "Accelerate's debug-mode shape checks (state.debug = True, "
    "DistributedOperationException) are not in gradsync.accelerate",
    "test_copy_tensor_to_devices(state)": "returns at once unless MULTI_GPU or XLA (nothing is "
    "checked on CPU); copy_tensor_to_devices is not in "
    "gradsync.accelerate.utils",
    "test_noop_sync(accelerator)": "main() runs it on one process only (DistributedType.NO)",
    "test_dataloader_break()": "GradientState.active_dataloader (the loader being iterated, "
    "innermost first) is not in gradsync.accelerate",
    "test_distributed_sync_multiple_fwd(accelerator)": (
        "gradsync's no_sync is a whole micro-step: a plain backward after no_sync micro-steps "
        "closes their window and syncs (DDP decides at the forward, under no_sync), and each "
        "next(iter(dataloader)) starts a new pass inside the open window, which is dropped"
    ),
    **{
        f"test_gradient_accumulation({split}, False, {each})": WINDOW_CLEARS
        for split, each in itertools.product((True, False), (True, False))
    },
    **{
        f"{fn}({split}, True, {each})": DISPATCH
        for fn in (
            "test_gradient_accumulation",
            "test_gradient_accumulation_with_opt_and_scheduler",
        )
        for split, each in itertools.product((True, False), (True, False))
    },
}


# -- the respelling ------------------------------------------------------------------------
class Missing:
    """What a script gets for a name gradsync.accelerate lacks: raises when used."""

    def __init__(self, module: str, name: str, why: str) -> None:
        self._what = f"gradsync.accelerate has no {module}.{name}: {why}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ImportError(self._what)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise ImportError(self._what)


def same_on_every_rank(tensor: Any) -> bool:
    """Every rank holds ``tensor`` (what ``are_the_same_tensors`` checks)."""
    import torch

    from gradsync.accelerate import PartialState
    from gradsync.accelerate.utils import gather

    mine = tensor.detach()[None].clone().to(PartialState().device)
    return all(torch.equal(row, mine[0].cpu()) for row in gather(mine).cpu())


def gradsync_module(module: str) -> str:
    """The ``gradsync.accelerate`` module for an ``accelerate`` one (a private submodule
    gradsync does not have: its nearest parent)."""
    parts = ("gradsync." + module).split(".")
    while True:
        try:
            importlib.import_module(".".join(parts))
            return ".".join(parts)
        except ImportError:
            if len(parts) <= 2:
                raise
            parts.pop()


def seeded_dataset(*args: Any, seed: Any = None, **kwargs: Any) -> Any:
    """Accelerate's ``RegressionDataset`` drawn from a fixed seed per rank. Unseeded, it
    draws from the OS's entropy, a new dataset every run: ``test_sync``'s in-sync check
    (rtol 1e-2 between a reference that steps every batch and a model that steps per
    window) then fails on rare draws, under Accelerate as under gradsync, whose gradients
    at every check equal Accelerate's bitwise on the same draw (1,200 draws compared)."""
    from accelerate.test_utils import RegressionDataset

    if seed is None:
        seed = [1234, int(os.environ.get("RANK", "0"))]
    return RegressionDataset(*args, seed=seed, **kwargs)


def resolve(module: str, name: str) -> Any:
    if name == "are_the_same_tensors":
        return same_on_every_rank
    if name == "RegressionDataset":
        return seeded_dataset
    if module.startswith("accelerate.test_utils") or name in KEPT:
        return getattr(importlib.import_module(module), name)
    target = importlib.import_module(gradsync_module(module))
    try:
        return getattr(target, name)
    except (ImportError, AttributeError) as error:
        return Missing(module, name, str(error).splitlines()[0])


def respelled(script: str) -> types.ModuleType:
    """Accelerate's ``script``, read from the installed wheel, with its Accelerate imports
    served by ``resolve`` (its ``main()`` is not run)."""
    import accelerate.test_utils.scripts as shipped

    tree = ast.parse((Path(shipped.__file__).parent / f"{script}.py").read_text())
    body: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "accelerate":
            body += [
                ast.parse(f"{a.asname or a.name} = __resolve__({node.module!r}, {a.name!r})").body[
                    0
                ]
                for a in node.names
            ]
        else:
            body.append(node)
    tree.body = body
    module = types.ModuleType(f"accelerate_{script}_on_gradsync")
    module.__dict__["__resolve__"] = resolve
    exec(compile(tree, f"<accelerate {script}.py on gradsync>", "exec"), module.__dict__)
    return module


def main_calls(script: str) -> set[str]:
    """The test functions ``script``'s ``main()`` calls (by name)."""
    import accelerate.test_utils.scripts as shipped

    tree = ast.parse((Path(shipped.__file__).parent / f"{script}.py").read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    return {
        c.func.id
        for c in ast.walk(main)
        if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in defined
    }


# -- the ranks -----------------------------------------------------------------------------
def run_on_this_rank(out: Path) -> None:
    import faulthandler
    import traceback

    from gradsync.accelerate import Accelerator, PartialState

    accelerator = Accelerator()
    state = PartialState()
    modules = {script: respelled(script) for script in SCRIPTS}
    results = []
    for script, call in PASSING:
        faulthandler.dump_traceback_later(120, exit=True)  # a rank left waiting: end the run
        try:
            eval(call, {**vars(modules[script]), "accelerator": accelerator, "state": state})
            results.append({"call": f"{script}:{call}", "error": None})
        except Exception as error:
            where = [f"{f.filename}:{f.lineno}" for f in traceback.extract_tb(error.__traceback__)][
                -3:
            ]
            results.append(
                {
                    "call": f"{script}:{call}",
                    "error": f"{type(error).__name__}: {error} at {' > '.join(where)}",
                }
            )
        faulthandler.cancel_dump_traceback_later()
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    run_on_this_rank(Path(sys.argv[1]))
    sys.exit(0)


# -- the tests -----------------------------------------------------------------------------
shipped_scripts = pytest.importorskip("accelerate.test_utils.scripts")


def test_every_test_function_main_calls_is_run_or_excluded() -> None:
    covered = {call.split("(")[0] for _, call in PASSING} | {
        call.split("(")[0] for call in EXCLUDED
    }
    for script in SCRIPTS:
        assert main_calls(script) <= covered, (script, main_calls(script) - covered)
    assert not {call for _, call in PASSING} & EXCLUDED.keys()


def test_accelerates_own_test_functions_pass_against_gradsync_accelerate(tmp_path: Path) -> None:
    repo_src = Path(__file__).resolve().parents[2] / "src"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GRADSYNC_DEVICE": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(repo_src), os.environ.get("PYTHONPATH")])),
    }
    cmd = [
        str(Path(sys.executable).parent / "gradsync"),
        "launch",
        "--nproc-per-node",
        "2",
        __file__,
        str(tmp_path),
    ]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    log = (done.stdout + done.stderr)[-6000:]
    for rank in (0, 1):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no results (exit {done.returncode}):\n{log}"
        results = json.loads(path.read_text())
        assert [r["call"] for r in results] == [f"{s}:{c}" for s, c in PASSING]
        failed = {r["call"]: r["error"] for r in results if r["error"]}
        assert not failed, f"rank {rank}: {json.dumps(failed, indent=1)}"
    assert done.returncode == 0, log
