"""The trackers on a real 2-rank gloo group: rank 0 alone creates and writes every tracker's
files (each once), the other rank's calls do nothing, and no tracker call issues a
collective (ranks that log a different number of times never wait for each other)."""

from __future__ import annotations

import csv
import json

import pytest

from harness import Scenario, Shared
from scenarios import tracking

SHARED = Shared("gloo2", lambda folder: {"ranks": Scenario(tracking.ranks, folder=str(folder))})


@pytest.fixture(scope="module")
def run(shared):
    results = shared(SHARED)
    return results.folder, results["ranks"]


def test_only_rank_0_starts_trackers_and_no_call_is_a_collective(run):
    _, (zero, one) = run
    assert zero["started"] == tracking.NAMES and one["started"] == []
    assert zero["writer"] == "SummaryWriter" and one["writer"] == "_NullTracker"
    assert zero["collectives"] == [] and one["collectives"] == []


def test_each_file_is_written_once_with_rank_0s_values(run):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, _ = run
    logs = tracking.LOGS[0]
    project = folder / "proj"
    with open(project / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["loss"], r["rank"]) for r in rows] == [
        (str(i), str(float(i)), "0") for i in range(logs)
    ]
    lines = [json.loads(line) for line in (project / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["loss"], x["rank"]) for x in lines] == [
        (i, float(i), 0) for i in range(logs)
    ]
    assert len(list(project.glob("events.out.tfevents.*"))) == 1  # one writer: rank 0
    acc = EventAccumulator(str(project))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(i, float(i)) for i in range(logs)]
    assert [(e.step, e.value) for e in acc.Scalars("extra")] == [(7, 1.5)]
    assert len(list((folder / "wandb").glob("offline-run-*"))) == 1
    client = MlflowClient(f"sqlite:///{folder.resolve() / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "proj"]
    (mlrun,) = client.search_runs([experiment.experiment_id])
    assert mlrun.info.status == "FINISHED" and mlrun.data.params == {"lr": "0.5", "world": "2"}
    history = client.get_metric_history(mlrun.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(i, float(i)) for i in range(logs)]
