"""The experiment trackers (gradsync.tracking) with the real libraries: what each one wrote is
read back with that library's own reader (TensorBoard's EventAccumulator, W&B's record
protobuf, MLflow's client) or as the file it is (CSV, JSON lines).

One process, no process group; W&B and MLflow are started once each (a second or two).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gradsync.errors import ConfigError, UsageError
from gradsync.tracking import (
    BUILTIN_TRACKERS,
    CSVTracker,
    Tracker,
    Trackers,
    WandBTracker,
    plain,
    tracker_available,
)

from harness.trackers import wandb_records


@pytest.fixture(autouse=True)
def _one_process(clean_env):
    """Rank 0 of one, with no tracker library told where to go by the environment."""
    for key in (
        "WANDB_MODE",
        "WANDB_DIR",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
        "MLFLOW_RUN_ID",
        "MLFLOW_TAGS",
    ):
        clean_env.delenv(key, raising=False)


def _trackers(log_with: Any, project_dir: Path | None, step: int = 0) -> Trackers:
    return Trackers(log_with, None if project_dir is None else str(project_dir), step=lambda: step)


# -- TensorBoard ---------------------------------------------------------------------------
def test_tensorboard_events_read_back_exactly(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    t = _trackers(["tensorboard"], tmp_path, step=3)
    t.init("proj", config={"lr": 0.5, "optimizer": "adam", "betas": (0.9, 0.99)})
    t.log({"loss": torch.tensor(0.5)})  # no step: the step callable's (3)
    t.log({"loss": 0.25, "note": "warming up"}, step=5)
    t.log({"loss": np.float32(1 / 3), "weights": torch.arange(6.0)}, step=6)
    writer = t.get("tensorboard", unwrap=True)
    assert type(writer).__name__ == "SummaryWriter" and t.get("tensorboard") is t.started[0]
    t.finish()

    run = tmp_path / "proj"
    events = EventAccumulator(str(run), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [3, 5, 6]
    assert [e.value for e in loss] == [0.5, 0.25, float(np.float32(1 / 3))]
    (text,) = events.Tensors("note/text_summary")
    assert (text.step, text.tensor_proto.string_val) == (5, [b"warming up"])
    (hist,) = events.Histograms("weights")
    assert (hist.step, hist.histogram_value.num, hist.histogram_value.sum) == (6, 6.0, 15.0)
    start = next(
        plugin_data_pb2.HParamsPluginData.FromString(v).session_start_info
        for k, v in events.PluginTagToContent("hparams").items()
        if "start" in k
    )
    assert start.hparams["lr"].number_value == 0.5
    assert start.hparams["optimizer"].string_value == "adam"
    assert start.hparams["betas"].string_value == "(0.9, 0.99)"


# -- Weights & Biases ----------------------------------------------------------------------
def test_wandb_offline_run_has_one_history_record_per_log(tmp_path):
    t = _trackers(["wandb"], tmp_path)
    t.init("proj", config={"lr": 0.5}, init_kwargs={"wandb": {"name": "first"}})
    run = t.get("wandb", unwrap=True)
    assert run.settings.mode == "offline" and run.name == "first"
    for step in range(3):
        t.log(
            {"loss": torch.tensor(1.0 / (step + 1), dtype=torch.float64), "phase": f"p{step}"},
            step=step,
        )
    t.finish()

    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    (log_file,) = folder.glob("run-*.wandb")
    # W&B's service process writes the file: it may end it a moment after finish() returns.
    deadline = time.monotonic() + 60
    while True:
        records = wandb_records(log_file)
        if (
            any(r.WhichOneof("record_type") == "exit" for r in records)
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.1)
    history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    assert len(history) == 3, [r.WhichOneof("record_type") for r in records]
    rows = [{item.nested_key[0]: json.loads(item.value_json) for item in h.item} for h in history]
    assert [h.step.num for h in history] == [0, 1, 2]
    assert [row["loss"] for row in rows] == [1.0, 0.5, 1 / 3]
    assert [row["phase"] for row in rows] == ["p0", "p1", "p2"]
    config = [
        item for r in records if r.WhichOneof("record_type") == "config" for item in r.config.update
    ]
    assert any(item.key == "lr" and json.loads(item.value_json) == 0.5 for item in config)
    # W&B's error reporting is off in the suite (tests/conftest.py): no OpenTelemetry thread is
    # left in this process for a later test's forked DataLoader worker to start again
    assert not [t.name for t in threading.enumerate() if t.name.startswith("Otel")]


def test_wandb_respects_wandb_mode(monkeypatch, tmp_path):
    assert WandBTracker("p", str(tmp_path)).kwargs["mode"] == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert "mode" not in WandBTracker("p", str(tmp_path)).kwargs  # wandb reads the variable
    assert WandBTracker("p", str(tmp_path), mode="online").kwargs["mode"] == "online"
    assert WandBTracker("p", str(tmp_path)).kwargs["dir"] == str(tmp_path)


# -- MLflow --------------------------------------------------------------------------------
def test_mlflow_local_store_has_one_metric_record_per_step(tmp_path, caplog):
    from mlflow.tracking import MlflowClient

    t = _trackers(["mlflow"], tmp_path, step=7)
    t.init("proj", config={"lr": 0.5, "layers": 4}, init_kwargs={"mlflow": {"run_name": "first"}})
    tracker = t.get("mlflow")
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        for step in range(3):
            t.log(
                {
                    "loss": torch.tensor(1.0 / (step + 1), dtype=torch.float64),
                    "lr": {"group0": 0.1 * step},
                    "phase": "train",
                },
                step=step,
            )
        t.log({"loss": 2.0})  # no step: the step callable's
    assert [r.getMessage() for r in caplog.records if "phase" in r.getMessage()] == [
        "gradsync: the mlflow tracker cannot record values['phase'] (a str): it is left out; "
        "it records numbers (and dicts of numbers)"
    ]  # once, not per call
    assert t.get("mlflow", unwrap=True) is tracker.client
    t.finish()

    assert (tmp_path / "mlflow.db").is_file()
    client = MlflowClient(f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}")
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "first"
    assert run.data.params == {"lr": "0.5", "layers": "4"}
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    assert run.info.artifact_uri.startswith((tmp_path.resolve() / "mlartifacts").as_uri())
    history = sorted((m.step, m.value) for m in client.get_metric_history(tracker.run_id, "loss"))
    assert history == [(0, 1.0), (1, 0.5), (2, 1 / 3), (7, 2.0)]
    group = sorted(
        (m.step, m.value) for m in client.get_metric_history(tracker.run_id, "lr/group0")
    )
    assert group == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert "phase" not in run.data.metrics


def test_mlflow_rejects_an_argument_it_does_not_take(tmp_path):
    t = _trackers(["mlflow"], tmp_path)
    with pytest.raises(
        ConfigError, match=r"init_kwargs\['mlflow'\] has 'nested_run'.*use tracking_uri"
    ):
        t.init("proj", init_kwargs={"mlflow": {"nested_run": True}})


# -- CSV and JSON lines --------------------------------------------------------------------
def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_rows_grow_columns_and_survive_a_crash(tmp_path):
    t = _trackers(["csv"], tmp_path, step=2)
    t.init("proj", config={"lr": 0.5})
    path = Path(t.get("csv", unwrap=True))
    assert path == tmp_path / "proj" / "metrics.csv"
    t.log({"loss": torch.tensor(0.5, dtype=torch.float64)})
    t.log({"loss": 0.25, "acc": {"top1": 0.75, "top5": 1}, "note": "a,b"}, step=3)
    t.log({"grad_norm": None, "weights": torch.ones(3)}, step=4)
    # Not finished: every row is already in the file (a crashed run keeps them).
    rows = _rows(path)
    assert list(rows[0]) == [
        "step",
        "wall_time",
        "loss",
        "acc/top1",
        "acc/top5",
        "note",
        "grad_norm",
    ]
    assert [(r["step"], r["loss"], r["acc/top1"], r["acc/top5"], r["note"]) for r in rows] == [
        ("2", "0.5", "", "", ""),
        ("3", "0.25", "0.75", "1", "a,b"),
        ("4", "", "", "", ""),
    ]
    assert all(float(r["wall_time"]) > 1e9 for r in rows)
    assert json.loads((path.parent / "config.json").read_text()) == {"lr": 0.5}
    t.finish()

    again = _trackers(["csv"], tmp_path)  # a resumed run continues the file
    again.init("proj")
    again.log({"loss": 0.125, "lr": 0.01}, step=5)
    again.finish()
    rows = _rows(path)
    assert len(rows) == 4 and list(rows[0])[-1] == "lr"
    assert (rows[3]["step"], rows[3]["loss"], rows[3]["lr"], rows[0]["lr"]) == (
        "5",
        "0.125",
        "0.01",
        "",
    )


def test_csv_continues_a_file_of_other_columns(tmp_path):
    path = tmp_path / "proj" / "metrics.csv"
    path.parent.mkdir()
    path.write_text("loss\n0.5\n")
    t = _trackers(["csv"], tmp_path)
    t.init("proj")
    t.log({"loss": 0.25}, step=1)
    t.finish()
    assert [(r["loss"], r["step"]) for r in _rows(path)] == [("0.5", ""), ("0.25", "1")]
    path.write_text("\n\n1,2\n")
    with pytest.raises(
        ConfigError, match=r"metrics.csv exists and does not start with a CSV header"
    ):
        _trackers(["csv"], tmp_path).init("proj")


def test_jsonl_one_line_per_log(tmp_path):
    t = _trackers(["jsonl"], tmp_path, step=9)
    t.init("proj")
    t.log({"loss": torch.tensor([0.5]), "acc": {"top1": 0.75}, "tags": ["a", "b"], "x": None})
    t.log({"loss": math.nan, "big": math.inf, "obj": object()}, step=10)
    path = Path(t.get("jsonl", unwrap=True))
    lines = [json.loads(line) for line in path.read_text().splitlines()]  # before finish
    assert [{k: v for k, v in line.items() if k != "wall_time"} for line in lines[:1]] == [
        {"step": 9, "loss": 0.5, "acc": {"top1": 0.75}, "tags": ["a", "b"], "x": None}
    ]
    assert lines[1]["step"] == 10 and math.isnan(lines[1]["loss"]) and lines[1]["big"] == math.inf
    assert "obj" not in lines[1]
    t.finish()


def test_a_key_the_file_uses_itself_is_refused_before_anything_is_written(tmp_path):
    t = _trackers(["jsonl", "csv"], tmp_path)
    t.init("proj")
    with pytest.raises(
        ConfigError,
        match=r"values\['step'\]: the jsonl tracker writes 'step' itself; "
        r"rename the value \(for the step: accel.log\(values, step=N\)\)",
    ):
        t.log({"step": 3, "loss": 1.0})
    t.finish()
    assert (tmp_path / "proj" / "metrics.jsonl").read_text() == ""


def test_a_step_value_equal_to_the_step_is_written_once(tmp_path):
    """Accelerate's examples log {"step": n} at step=n: the files write the step once."""
    t = _trackers(["jsonl", "csv"], tmp_path)
    t.init("proj")
    t.log({"step": 3, "loss": 1.0}, step=3)
    with pytest.raises(
        ConfigError, match=r"values\['step'\]: the jsonl tracker writes 'step' itself"
    ):
        t.log({"step": 4, "loss": 1.0}, step=3)  # another number: still refused
    t.finish()
    lines = [
        json.loads(line) for line in (tmp_path / "proj" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [(line["step"], line["loss"]) for line in lines] == [(3, 1.0)]


# -- "all", tracker objects, values --------------------------------------------------------
def test_all_starts_every_installed_tracker(tmp_path, monkeypatch):
    assert all(tracker_available(n) for n in BUILTIN_TRACKERS)  # the test extras install them
    assert _trackers(["all"], tmp_path).names == ["tensorboard", "wandb", "mlflow", "csv", "jsonl"]
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    assert not tracker_available("wandb")
    t = _trackers(["csv", "all"], tmp_path)
    assert t.names == ["csv", "tensorboard", "mlflow", "jsonl"]


class Recorder:
    """A user's tracker: only ``log`` is required; the rest is called where present."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def start(self) -> None:
        self.calls.append(("start",))

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.calls.append(("config", values))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.calls.append(("log", values, step, kwargs))

    def finish(self) -> None:
        self.calls.append(("finish",))

    @property
    def tracker(self) -> str:
        return "the library object"


class LogOnly:
    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, Any], int]] = []

    def log(self, values: dict[str, Any], step: int) -> None:
        self.seen.append((values, step))


def test_tracker_objects_are_used_as_given(tmp_path):
    rec, bare = Recorder(), LogOnly()
    assert isinstance(rec, Tracker) and not isinstance(bare, Tracker)
    t = _trackers([rec, bare], None, step=4)
    assert t.names == ["recorder", "LogOnly"]
    t.init("proj", config={"lr": 0.5})
    t.log({"loss": torch.tensor(2.0)}, log_kwargs={"recorder": {"commit": False}})
    t.log({"loss": 1.0}, step=5)
    t.finish()
    t.finish()  # once
    assert rec.calls == [
        ("start",),
        ("config", {"lr": 0.5}),
        ("log", {"loss": 2.0}, 4, {"commit": False}),
        ("log", {"loss": 1.0}, 5, {}),
        ("finish",),
    ]
    assert type(rec.calls[2][1]["loss"]) is float
    assert bare.seen == [({"loss": 2.0}, 4), ({"loss": 1.0}, 5)]
    assert t.started == [rec, bare]
    assert t.get("recorder") is rec and t.get("recorder", unwrap=True) == "the library object"
    assert t.get("LogOnly", unwrap=True) is bare


def test_an_accelerate_tracker_fits():
    from accelerate.tracking import GeneralTracker

    class Mine(GeneralTracker):
        name = "mine"
        requires_logging_directory = False

        def __init__(self) -> None:
            super().__init__()
            self.seen: list[Any] = []

        @property
        def tracker(self) -> list[Any]:
            return self.seen

        def start(self) -> None:
            self.seen.append("start")

        def store_init_configuration(self, values: dict[str, Any]) -> None:
            self.seen.append(values)

        def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
            self.seen.append((values, step))

        def finish(self) -> None:
            self.seen.append("finish")

    mine = Mine()
    t = _trackers([mine], None, step=3)
    t.init("proj", config={"lr": 0.5})
    t.log({"loss": torch.tensor(2.0)})
    t.finish()
    assert mine.seen == ["start", {"lr": 0.5}, ({"loss": 2.0}, 3), "finish"]
    assert t.get("mine", unwrap=True) is mine.seen


class FailsOnce(Recorder):
    name = "fails_once"
    failed = False

    def start(self) -> None:
        if not FailsOnce.failed:
            FailsOnce.failed = True
            raise RuntimeError("the tracking server is down")
        super().start()


def test_a_failed_init_closes_what_it_opened_and_can_be_retried(tmp_path):
    rec, flaky = Recorder(), FailsOnce()
    t = _trackers([rec, flaky, "csv"], tmp_path)
    with pytest.raises(RuntimeError, match="server is down"):
        t.init("proj")
    assert rec.calls == [("start",), ("finish",)] and t.started == []
    t.init("proj")
    assert [x.name for x in t.started] == ["recorder", "fails_once", "csv"]
    t.finish()


def test_plain_values():
    assert plain(torch.tensor(3)) == 3 and type(plain(torch.tensor(3))) is int
    assert plain(torch.tensor([[0.5]], dtype=torch.float64, requires_grad=True)) == 0.5
    assert plain(torch.tensor(True)) is True
    assert plain(np.float64(0.25)) == 0.25 and type(plain(np.int64(2))) is int
    assert plain({"a": torch.tensor(1.5), "b": {"c": np.array([2.0])}}) == {
        "a": 1.5,
        "b": {"c": 2.0},
    }
    many = torch.ones(2)
    assert plain(many) is many and plain("s") == "s"


# -- other ranks ---------------------------------------------------------------------------
def test_another_rank_writes_nothing_and_gets_a_tracker_that_does_nothing(tmp_path, monkeypatch):
    for key, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(key, value)
    rec = Recorder()
    t = _trackers(["tensorboard", "csv", rec], tmp_path / "runs")
    t.init("proj", config={"lr": 0.5})
    t.log({"loss": torch.tensor(1.0)})
    assert t.started == [] and rec.calls == []
    writer = t.get("tensorboard", unwrap=True)
    assert writer.add_scalar("loss", 1.0, 3) is None and writer.flush() is None
    assert t.get("recorder").log({"x": 1}) is None
    with pytest.raises(ConfigError, match="get_tracker\\('wandb'\\): no such tracker"):
        t.get("wandb")
    t.finish()
    assert not (tmp_path / "runs").exists()


# -- mistakes: one line each, naming the value and the fix ----------------------------------
def test_log_before_init_and_after_finish(tmp_path):
    t = _trackers(["csv"], tmp_path)
    with pytest.raises(
        UsageError,
        match=r"accel.log\(...\) before init_trackers\(\): start the "
        r"trackers first, e.g. accel.init_trackers\('my_project'\)",
    ):
        t.log({"loss": 1.0})
    with pytest.raises(UsageError, match=r"get_tracker\('csv'\) before init_trackers\(\)"):
        t.get("csv")
    t.init("proj")
    t.finish()
    with pytest.raises(UsageError, match=r"after end_training\(\)"):
        t.log({"loss": 1.0})


def test_init_twice(tmp_path):
    t = _trackers(["jsonl"], tmp_path)
    t.init("proj")
    with pytest.raises(
        UsageError,
        match=r"init_trackers\('again'\): the trackers were already "
        r"started \(project 'proj'\); call init_trackers once",
    ):
        t.init("again")
    t.finish()


def test_get_tracker_of_a_name_not_started_lists_the_started(tmp_path):
    t = _trackers(["csv", "jsonl"], tmp_path)
    t.init("proj")
    with pytest.raises(
        ConfigError,
        match=r"get_tracker\('wandb'\): no such tracker; the started "
        r"ones: 'csv', 'jsonl'",
    ):
        t.get("wandb")
    t.finish()


@pytest.mark.parametrize(
    ("name", "module", "extra"),
    [
        ("tensorboard", "tensorboard", "tensorboard"),
        ("wandb", "wandb", "wandb"),
        ("mlflow", "mlflow", "mlflow"),
        ("mlflow", "sqlalchemy", "mlflow"),
    ],
)
def test_a_missing_library_names_the_pip_command(tmp_path, monkeypatch, name, module, extra):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(
        ConfigError,
        match=rf"log_with='{name}' needs {module}\b.*, which is not "
        rf"installed: pip install 'gradsync\[{extra}\]'$",
    ):
        _trackers([name], tmp_path)


def test_a_tracking_server_needs_no_sql_store(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert _trackers(["mlflow"], tmp_path).names == ["mlflow"]  # nothing is contacted here


def test_file_trackers_need_a_project_dir():
    with pytest.raises(
        ConfigError,
        match=r"log_with='tensorboard', 'csv' writes files into "
        r"project_dir, which is not set: pass project_dir='runs'",
    ):
        _trackers(["tensorboard", "wandb", "csv"], None)
    with pytest.raises(ConfigError, match=r"log_with='all' writes files into project_dir"):
        _trackers(["all"], None)
    assert _trackers(["wandb", "mlflow"], None).names == ["wandb", "mlflow"]


def test_the_names_log_with_accepts_are_the_built_in_trackers():
    from gradsync.tracking._names import BUILTIN_NAMES, TRACKER_NAMES

    assert tuple(BUILTIN_TRACKERS) == BUILTIN_NAMES and TRACKER_NAMES == (*BUILTIN_NAMES, "all")


def test_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="log_with got a int, which is neither"):
        _trackers([3], tmp_path)
    with pytest.raises(ConfigError, match=r"log_with='tensorbord' is not a tracker"):
        _trackers(["tensorbord"], tmp_path)
    t = _trackers(["csv"], tmp_path)
    with pytest.raises(ConfigError, match=r"init_kwargs\['tensorbaord'\]: no tracker of that name"):
        t.init("proj", init_kwargs={"tensorbaord": {}})
    with pytest.raises(
        ConfigError,
        match=r"init_kwargs\['csv'\]=\{'x': 1\}: the csv tracker takes "
        r"no arguments there",
    ):
        CSVTracker("proj", str(tmp_path), x=1)
    with pytest.raises(ConfigError, match=r"project_name=''"):
        t.init("")
    t.init("proj", init_kwargs={"wandb": {"tags": ["a"]}})  # a tracker not chosen: ignored
    with pytest.raises(ConfigError, match=r"accel.log\(values=...\) got list"):
        t.log([("loss", 1.0)])  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=r"log_kwargs\['cvs'\]: no tracker of that name; use one of csv,"
    ):
        t.log({"loss": 1.0}, log_kwargs={"cvs": {}})
    t.log({"loss": 1.0}, log_kwargs={"wandb": {"commit": True}})  # not chosen: ignored
    t.finish()


def test_log_without_trackers_warns_once(caplog):
    t = _trackers(None, None)
    t.init("proj")
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        t.log({"loss": 1.0})
        t.log({"loss": 1.0})
    assert [r.getMessage() for r in caplog.records] == [
        "gradsync: accel.log(...) records nothing: log_with is not set; pass e.g. "
        "Accelerator(log_with='tensorboard', project_dir='runs')"
    ]
    assert t.started == [] and t.names == []
