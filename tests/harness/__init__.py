"""The parent side of the multi-process tests: run scenarios in ONE real process group and hand
back what each rank wrote.

Starting a group costs seconds, so a test module launches its scenarios once (a
module-scoped fixture) and its tests assert on the results here, in the parent
(``harness.checks`` holds the shared assertions). A scenario is a function of a
``scenarios.*`` module, referenced as the function itself::

    SCENARIOS = {"k4": Scenario(ddp.train_ddp, steps=4, loop=Loop(samples=44, micro_batch=2))}
    results = run_scenarios(SCENARIOS)

Test modules whose scenarios can share a group do more: each names its scenarios and a pool
(``SHARED = Shared("gloo2", SCENARIOS)``) and its fixture asks the session for them
(``shared(SHARED)``, tests/conftest.py): the first module of a pool that needs its results
launches the groups for the scenarios of every collected module of that pool (one, or on more
than 2 ranks one per ``CHUNK`` scenarios, in order), and each module reads its own part back
(``PartOf``). The conftest sends a pool's modules to one xdist worker.

``Scenario`` checks, when the test module is imported (so at collection), that the function
can be found again by its module and qualified name and that the parameters bind to its
signature; the workers (``mp_worker.py``) get the function's module and name and the
parameters pickled, so tuples, dataclasses and the like arrive as they were given.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]  # tests/: scenarios and mp_worker.py live there
WORKER = HERE / "mp_worker.py"


class ScenarioError(AssertionError):
    pass


def reference_to(fn: Callable[..., Any]) -> tuple[str, str]:
    """(module, qualified name) of a module-level function of a ``scenarios.*`` module, the
    way a worker finds it again; a ``TypeError`` names what is wrong otherwise."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not callable(fn) or not module or not name:
        raise TypeError(f"a scenario must be a function, not {fn!r}")
    if not module.startswith("scenarios.") or "<locals>" in name or "." in name:
        raise TypeError(
            f"scenario {module}.{name} must be a module-level function of a "
            "scenarios.* module (the workers import it by name)"
        )
    if getattr(importlib.import_module(module), name, None) is not fn:
        raise TypeError(f"{module}.{name} is not that module's attribute {name!r}")
    return module, name


@dataclass(frozen=True)
class Scenario:
    """One scenario: ``fn(**params)`` on every rank; what it returns (JSON) goes to the parent."""

    fn: Callable[..., Any]
    params: Mapping[str, Any] = field(default_factory=dict)

    def __init__(self, fn: Callable[..., Any], /, **params: Any) -> None:
        reference_to(fn)
        try:
            inspect.signature(fn).bind(**params)
        except TypeError as err:
            raise TypeError(f"Scenario({fn.__module__}.{fn.__qualname__}, ...): {err}") from None
        pickle.dumps(params)  # they travel pickled: fail here, not in a worker
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "params", dict(params))

    def with_params(self, **params: Any) -> Scenario:
        """The same function with ``params`` added to (or replacing) the current ones."""
        return Scenario(self.fn, **{**self.params, **params})


class Results:
    """results[name] -> list of per-rank dicts; raises with the worker's traceback on failure."""

    def __init__(self, by_rank: list[dict[str, Any]], log: str) -> None:
        self.by_rank = by_rank
        self.log = log

    def __getitem__(self, name: str) -> list[dict[str, Any]]:
        out = []
        for rank, results in enumerate(self.by_rank):
            if name not in results:
                raise ScenarioError(
                    f"rank {rank} wrote no result for {name!r}; log:\n{self.log[-4000:]}"
                )
            entry = results[name]
            if not entry["ok"]:
                raise ScenarioError(f"scenario {name!r} failed on rank {rank}:\n{entry['error']}")
            out.append(entry["result"])
        return out

    def error(self, name: str) -> list[str]:
        """The error text each rank recorded for a scenario expected to fail."""
        return [results[name]["error"] or "" for results in self.by_rank]


def group_setup(scenarios: Mapping[str, Scenario]) -> Callable[[], None]:
    """The ``setup_process_group`` the scenarios' modules define (one for all of them), or the
    audited gloo group (``scenarios.common.audited_gloo_group``)."""
    from scenarios.common import audited_gloo_group

    setups = {
        getattr(sys.modules[s.fn.__module__], "setup_process_group", audited_gloo_group)
        for s in scenarios.values()
    }
    if len(setups) > 1:
        names = sorted(f"{f.__module__}.{f.__qualname__}" for f in setups)
        raise ValueError(
            f"these scenarios want different process groups ({', '.join(names)}): "
            "run them in separate run_scenarios calls"
        )
    return setups.pop() if setups else audited_gloo_group


def run_scenarios(
    scenarios: Mapping[str, Scenario],
    *,
    nproc: int = 2,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> Results:
    """Launch ``nproc`` ranks in one process group that run ``scenarios`` (name -> Scenario) in
    order; the group is the scenarios' module's ``setup_process_group`` if it has one."""
    for name, scenario in scenarios.items():
        if not isinstance(scenario, Scenario):
            raise TypeError(f"scenario {name!r} is {scenario!r}, not a Scenario")
    setup = group_setup(scenarios)
    out = Path(tempfile.mkdtemp(prefix="gradsync-mp-"))
    spec = out / "scenarios.pickle"
    spec.write_bytes(
        pickle.dumps(
            {
                "setup": (setup.__module__, setup.__qualname__),
                "scenarios": {
                    name: (*reference_to(s.fn), dict(s.params)) for name, s in scenarios.items()
                },
            }
        )
    )
    cmd = [
        sys.executable,
        str(WORKER),
        str(nproc),
        str(spec),
        str(out),
    ]  # the agent forks the ranks
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    full_env.update(
        {
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(HERE) + os.pathsep + full_env.get("PYTHONPATH", ""),
        }
    )
    full_env.update(env or {})
    try:
        proc = _run_whole(cmd, timeout=timeout, env=full_env)
        log = proc.stdout + proc.stderr
        by_rank = []
        for rank in range(nproc):
            path = out / f"rank{rank}.jsonl"  # a line per scenario (mp_worker.py)
            if not path.exists():
                raise ScenarioError(
                    f"rank {rank} wrote no results (exit {proc.returncode}); log:\n{log[-6000:]}"
                )
            by_rank.append(_scenario_lines(path))
    finally:
        shutil.rmtree(out, ignore_errors=True)  # what the ranks wrote is read (megabytes a pool)
    # A worker may abort at exit after writing everything (seen with DeepSpeed): the files decide.
    return Results(by_rank, log)


def _run_whole(cmd: list[str], *, timeout: float, env: dict[str, str]) -> Any:
    """``cmd`` in a session of its own; past ``timeout`` every process of it is killed (the
    forked ranks too, which would otherwise outlive their agent) and a ``ScenarioError``
    gives the log's end."""
    with subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=HERE,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise ScenarioError(
                f"the launch ran past {timeout:.0f} s and was killed; log:\n{(out + err)[-6000:]}"
            ) from None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # what the agent left behind
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _scenario_lines(path: Path) -> dict[str, Any]:
    """Scenario name -> what a rank wrote (``mp_worker.py``: a JSON line each); a last line
    cut short by a crash is left out."""
    entries: dict[str, Any] = {}
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            break
        entries[entry.pop("name")] = entry
    return entries


@dataclass(frozen=True)
class Shared:
    """A test module's scenarios that run in one process group with the other collected
    modules' of the same ``pool`` (their group's setup, ``nproc`` and ``env`` must agree).

    ``scenarios`` is the mapping, or a function of a folder of the module's own (for
    scenarios that write files); ``timeout`` is this module's share of the group's time;
    ``requires``: modules that must be importable, else the module is left out of the group
    (its fixture skips it)."""

    pool: str
    scenarios: Mapping[str, Scenario] | Callable[[Path], Mapping[str, Scenario]]
    nproc: int = 2
    timeout: float = 600
    env: Mapping[str, str] = field(default_factory=dict)
    requires: tuple[str, ...] = ()

    def available(self) -> bool:
        return all(importlib.util.find_spec(name) is not None for name in self.requires)


class PartOf(Results):
    """One module's part of a shared group's results: its scenario names, the whole log."""

    def __init__(self, whole: Results, prefix: str, folder: Path) -> None:
        super().__init__(whole.by_rank, whole.log)
        self.prefix = prefix
        self.folder = folder

    def __getitem__(self, name: str) -> list[dict[str, Any]]:
        return super().__getitem__(self.prefix + name)

    def error(self, name: str) -> list[str]:
        return super().error(self.prefix + name)


def run_shared(members: Mapping[str, Shared], root: Path) -> dict[str, PartOf]:
    """Run the scenarios of ``members`` (a key per test module -> its ``Shared``, all of one
    pool) in that order, ``CHUNK`` to a group; each module's folder is ``root / key``."""
    handles = list(members.values())
    nprocs = {h.nproc for h in handles}
    if len(nprocs) != 1:
        raise ValueError(f"pool {handles[0].pool!r} mixes group sizes {sorted(nprocs)}")
    env: dict[str, str] = {}
    for handle in handles:
        for key, value in handle.env.items():
            if env.setdefault(key, value) != value:
                raise ValueError(f"pool {handle.pool!r}: {key} is both {env[key]!r} and {value!r}")
    merged: dict[str, Scenario] = {}
    folders: dict[str, Path] = {}
    for key, handle in members.items():
        folders[key] = root / "".join(c if c.isalnum() else "_" for c in key)
        folders[key].mkdir(parents=True, exist_ok=True)
        scenarios = (
            handle.scenarios(folders[key]) if callable(handle.scenarios) else handle.scenarios
        )
        merged.update({f"{key}::{name}": scenario for name, scenario in scenarios.items()})
    nproc, timeout = nprocs.pop(), sum(h.timeout for h in handles)
    names = list(merged)
    size = CHUNK if nproc > 2 else len(names)  # 2 ranks: a world-sized mesh makes no group
    chunks = [names[i : i + size] for i in range(0, len(names), size)]
    parts = [
        run_scenarios({n: merged[n] for n in chunk}, nproc=nproc, env=env, timeout=timeout)
        for chunk in chunks
    ]
    by_rank = [{k: v for part in parts for k, v in part.by_rank[r].items()} for r in range(nproc)]
    whole = Results(by_rank, "".join(part.log for part in parts))
    return {key: PartOf(whole, f"{key}::", folders[key]) for key in members}


#: The most scenarios one launch of a pool of more than 2 ranks runs; a longer pool runs in
#: several launches, one after the other, in order. A scenario's meshes and pipelines make
#: process groups that live as long as the ranks (torch's DTensor caches hold meshes by value,
#: so they cannot be destroyed between scenarios), and each gloo group keeps a network loop
#: thread that wakes every 10 ms: 200 idle groups cost a rank a fifth of a core
#: (the ranks give those threads timer slack, which cuts that: mp_worker.LOOP_SLACK_NS).
#: One launch of the 170 scenarios of the 4-rank pool ended with some 1,400 threads per rank
#: and spent three quarters of the CPU in the kernel (463 s for test_hsdp,
#: test_pipeline_parallel_dp and test_tensor_parallel); in launches of 40 the same took
#: 199 s, of 20 165 s.
CHUNK = 20
