"""One scenario run: N ranks in one process group run each scenario and write their results.

    python mp_worker.py NPROC SPEC OUT

This process is the run's torchrun agent (``torch.distributed.launcher.elastic_launch``, the
API behind ``torchrun --standalone``): it imports torch, gradsync and the scenarios' modules
once, then forks the ranks, which start with everything imported. A fresh interpreter per
rank would import the same modules again, seconds of CPU each on a small machine; how
``gradsync launch`` starts real workers is tested by the launch tests, not here.

SPEC is what ``harness.run_scenarios`` pickled: the group's setup function and, per scenario
name, the function's module, its qualified name and its parameters.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import pickle
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gradsync import audit


def find(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


#: prctl(2)'s options for a thread's timer slack: how late the kernel may end its timed waits
PR_SET_TIMERSLACK, PR_GET_TIMERSLACK = 29, 30
#: The slack each gloo group's network loop gets (the default is 50 us). The loop waits on
#: its sockets with a 10 ms timeout, then waits again: an idle group wakes its rank 100 times
#: a second, and a pool's meshes and pipelines leave up to some hundred groups per rank
#: (harness.CHUNK). With 20 ms of slack the kernel wakes them together, and less often;
#: the data they wait for still wakes them at once. Tearing a group down waits for its
#: loop's timeout, so it takes longer (40 groups: about 1.2 s instead of 0.5 s). Measured on
#: the 4-rank pool (test_hsdp, test_pipeline_parallel_dp, test_tensor_parallel,
#: test_deepspeed_hpz): 144 to 153 s of CPU and 109 to 114 s of wall, against 159 to 195 s
#: and 122 to 134 s without.
LOOP_SLACK_NS = 20_000_000


def _slack_for_group_loops() -> None:
    """Give the threads each process group starts from now on (gloo's network loop and its two
    worker threads) ``LOOP_SLACK_NS``: a thread starts with its creator's slack, and the slack
    is set only while a group is made, so this rank's other timed waits keep theirs."""
    from torch.distributed import distributed_c10d as c10d

    make = getattr(c10d, "_new_process_group_helper", None)
    if make is None:  # (prctl is Linux's, as sched_setaffinity in rank_main is)
        return  # the groups then cost more CPU, nothing else
    import ctypes

    prctl = ctypes.CDLL(None).prctl

    def made_with_slack(*args: Any, **kwargs: Any) -> Any:
        before = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0)
        prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(LOOP_SLACK_NS), 0, 0, 0)
        try:
            return make(*args, **kwargs)
        finally:
            prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(before), 0, 0, 0)

    c10d._new_process_group_helper = made_with_slack


def rank_main(spec_path: str, out_dir: str) -> None:
    """One rank: join the group, run each scenario, write what it returned (or its error)."""
    # Each rank on one core of those allowed (rank r on the r-th, round robin), as a launcher
    # binds ranks to cores: with more ranks than cores (4 on 2), gloo's many small wake-ups
    # then stay on one core, and a 4-rank run takes about a seventh less CPU.
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[int(os.environ["LOCAL_RANK"]) % len(cpus)]})
    spec = pickle.loads(Path(spec_path).read_bytes())
    find(*spec["setup"])()
    _slack_for_group_loops()
    rank = dist.get_rank()
    # A line per scenario, written when it ends, so a crash later keeps what was done (the
    # whole mapping rewritten after each would be megabytes of JSON each time).
    with open(Path(out_dir, f"rank{rank}.jsonl"), "a") as lines:
        for name, (module, qualname, params) in spec["scenarios"].items():
            start = time.perf_counter()
            try:
                entry = {"ok": True, "result": find(module, qualname)(**params), "error": None}
            except Exception:
                entry = {"ok": False, "result": None, "error": traceback.format_exc()}
            entry["seconds"] = time.perf_counter() - start  # the suite's cost, by scenario
            recorder = audit.recorder_of()
            if recorder is not None:
                recorder.clear()
            dist.barrier()
            lines.write(json.dumps({"name": name, **entry}) + "\n")
            lines.flush()
    dist.barrier()
    dist.destroy_process_group()


def agent(nproc: int, spec_path: str, out_dir: str) -> None:
    """Import what the ranks need, then start them as forks of this process (fresh
    interpreters where CUDA is present: a process that asked for devices cannot fork ranks
    that use them)."""
    import torch
    import torch._dynamo  # what every optimizer imports on first use
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    import gradsync.accelerator  # noqa: F401

    spec = pickle.loads(Path(spec_path).read_bytes())
    fork = not torch.cuda.is_available()
    for name in {spec["setup"][0], *(entry[0] for entry in spec["scenarios"].values())}:
        module = importlib.import_module(name)
        # What the module's scenarios import on first use, seconds each (DeepSpeed imports
        # MLflow where it is installed and compiles its Muon kernels' wrappers): once, here.
        for heavy in getattr(module, "PRELOAD", ()) if fork else ():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the ranks' group setup does
            try:
                importlib.import_module(heavy)
            except ImportError:  # its tests are skipped, or fail in the ranks with the reason
                pass
    # What is imported stays: the collector need not walk it again in every rank (with
    # torch, dynamo and DeepSpeed, each full collection walks a million objects, and DeepSpeed
    # collects on every ZeRO-3 setup), and the forked ranks leave its pages shared.
    gc.freeze()
    # The ranks are forks of this process, which has threads by now. By default the ranks
    # connect to the agent's rendezvous store, whose server thread looks up each peer's name
    # (c10d's formatSockAddr: getnameinfo) while the next rank is forked: a fork taken while
    # it held glibc's resolver lock left that rank waiting on it for good at its first lookup
    # (1 launch in 80; a rank stuck in getaddrinfo inside init_process_group, its peers timed
    # out). The ranks get a store of their own (rank 0 hosts it) and need no name: the store's
    # address is numeric and gloo takes the loopback interface by name.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        local_addr="127.0.0.1",
        max_restarts=0,
        start_method="fork" if fork else "spawn",
    )
    elastic_launch(config, rank_main)(spec_path, out_dir)


if __name__ == "__main__":
    agent(int(sys.argv[1]), sys.argv[2], sys.argv[3])
