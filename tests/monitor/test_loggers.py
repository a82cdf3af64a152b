"""Callbacks on the Trainer, and the metrics loggers built on them (monitor.loggers)."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from support import SyntheticTokens, tiny_config

import disttrain
from disttrain.config import load_config
from disttrain.config.consistency import check_sections
from disttrain.errors import ConfigError
from disttrain.monitor import MetricsRecord
from disttrain.monitor.loggers import EXPERIMENT, CSVLogger
from disttrain.names import CSV_FILE, METRICS_FILE, MLFLOW_DIR, TENSORBOARD_DIR, WANDB_DIR
from disttrain.testing import run_distributed

STEPS = 6


class Recorder(disttrain.Callback):
    """Remembers every call, in order."""

    def __init__(self, all_ranks: bool = False) -> None:
        self.all_ranks = all_ranks
        self.calls: list[tuple] = []

    def on_train_start(self, trainer):
        self.calls.append(("start", trainer.start_step))

    def on_step_end(self, trainer, record):
        self.calls.append(("step", record.step, record.loss, record.lr))

    def on_log(self, trainer, record):
        self.calls.append(("log", record.step, record.loss))

    def on_eval(self, trainer, step, eval_loss):
        self.calls.append(("eval", step, eval_loss))

    def on_checkpoint(self, trainer, step, path):
        self.calls.append(("checkpoint", step, str(path), Path(path).is_dir()))

    def on_train_end(self, trainer, summary):
        self.calls.append(("end", None if summary is None else summary["steps"]))


class Broken(Recorder):
    """Raises at step 2: it is disabled, the run goes on, and it still hears the end."""

    def on_step_end(self, trainer, record):
        super().on_step_end(trainer, record)
        if record.step == 2:
            raise RuntimeError("broken callback")


def _fit(run_dir: str, loggers: list[str]) -> dict[str, list[tuple]]:
    from disttrain.data import collate_token_batch
    from disttrain.models import GPT, token_loss

    cfg = tiny_config({"every": 3}, steps=STEPS, log_every=2, eval_every=3,
                      loggers=loggers, tensorboard=False)
    torch.manual_seed(cfg.train.seed)
    main, everywhere, broken = Recorder(), Recorder(all_ranks=True), Broken()
    disttrain.Trainer(GPT(cfg.model), SyntheticTokens(), token_loss, cfg,
                      eval_dataset=SyntheticTokens(n=16, seed=1), run_dir=run_dir,
                      collate_fn=collate_token_batch, progress=False,
                      callbacks=[main, everywhere, broken]).fit()
    return {"main": main.calls, "everywhere": everywhere.calls, "broken": broken.calls}


def _installed(*names: str) -> list[str]:
    modules = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
    return [n for n in names if importlib.util.find_spec(modules[n]) is not None]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 2-rank run with every installed logger and three callbacks."""
    run_dir = tmp_path_factory.mktemp("loggers")
    loggers = ["csv", *_installed("tensorboard", "wandb", "mlflow")]
    calls = run_distributed(_fit, 2, args=(str(run_dir), loggers), timeout=180)
    records = [json.loads(line)
               for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    return run_dir, calls, records


def test_a_callback_sees_every_step_once_and_each_point(run):
    run_dir, (rank0, rank1), records = run
    calls = rank0["main"]
    assert calls[0] == ("start", 0) and calls[-1] == ("end", STEPS)
    assert [c[0] for c in calls].count("start") == 1
    assert [c[0] for c in calls].count("end") == 1
    steps = [c for c in calls if c[0] == "step"]
    assert [c[1] for c in steps] == list(range(1, STEPS + 1))
    assert all(c[2] > 0 and c[3] > 0 for c in steps)  # each step's loss and lr
    logged = [c for c in calls if c[0] == "log"]
    assert [(c[1], c[2]) for c in logged] == [(r["step"], r["loss"]) for r in records]
    evals = [c for c in calls if c[0] == "eval"]
    assert [c[1] for c in evals] == [0, 3, 6] and all(c[2] > 0 for c in evals)
    assert [r["eval_loss"] for r in records if "eval_loss" in r] == [c[2] for c in evals[1:]]
    saves = [c for c in calls if c[0] == "checkpoint"]
    assert [c[1] for c in saves] == [3, 6]
    assert [Path(c[2]).name for c in saves] == ["step-00000003", "step-00000006"]
    assert all(c[3] for c in saves)  # the directory exists when the callback hears of it
    assert rank1["main"] == []  # rank 0 only by default


def test_an_all_ranks_callback_runs_everywhere_and_a_failing_one_is_dropped(run, capfd):
    run_dir, (rank0, rank1), _ = run
    steps = [c[1] for c in rank1["everywhere"] if c[0] == "step"]
    assert steps == list(range(1, STEPS + 1))
    assert rank1["everywhere"][-1] == ("end", STEPS)
    broken = rank0["broken"]
    assert [c[1] for c in broken if c[0] == "step"] == [1, 2]  # no calls after raising
    assert broken[-1] == ("end", STEPS)  # but it hears the end, to close what it opened
    assert rank0["main"][-1] == ("end", STEPS)  # the others went on


def test_csv_rows_are_the_logged_records(run):
    run_dir, _, records = run
    with (run_dir / CSV_FILE).open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == [r["step"] for r in records]
    assert [float(r["loss"]) for r in rows] == [r["loss"] for r in records]
    assert [float(r["lr"]) for r in rows] == [r["lr"] for r in records]
    # eval_loss first appears at step 3: the file was widened, earlier rows left blank
    assert [r["eval_loss"] for r in rows] == ["" if "eval_loss" not in r
                                              else repr(r["eval_loss"]) for r in records]


def test_tensorboard_writes_event_files(run):
    if not _installed("tensorboard"):
        pytest.skip("tensorboard is not installed")
    run_dir = run[0]
    assert list((run_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*"))


def test_wandb_writes_an_offline_run(run):
    pytest.importorskip("wandb")
    run_dir = run[0]
    (offline,) = (run_dir / WANDB_DIR).glob("offline-run-*")
    (data,) = offline.glob("run-*.wandb")
    assert data.stat().st_size > 0


def test_mlflow_file_store_holds_the_loss_history_and_the_config(run, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it
    from mlflow.tracking import MlflowClient

    run_dir, _, records = run
    client = MlflowClient(tracking_uri=(run_dir / MLFLOW_DIR).as_uri())
    experiment = client.get_experiment_by_name(EXPERIMENT)
    (found,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(found.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["loss"]) for r in records]
    assert found.data.params["train.steps"] == str(STEPS)
    assert found.info.status == "FINISHED"


class _Start:
    def __init__(self, start_step: int) -> None:
        self.start_step = start_step


def test_csv_logger_keeps_rows_up_to_a_resumed_step(tmp_path):
    path = tmp_path / CSV_FILE
    first = CSVLogger(path)
    first.on_train_start(_Start(0))
    for step in (2, 4, 6):
        first.on_log(None, MetricsRecord(step=step, loss=float(step), lr=0.1))
    resumed = CSVLogger(path)
    resumed.on_train_start(_Start(4))  # the records past the checkpoint are redone
    resumed.on_log(None, MetricsRecord(step=6, loss=7.0, lr=0.1, eval_loss=1.5))
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["step"], r["loss"], r["eval_loss"]) for r in rows] == [
        ("2", "2.0", ""), ("4", "4.0", ""), ("6", "7.0", "1.5")]


def test_loggers_config_is_a_list_of_known_names():
    assert load_config(overrides=['monitor.loggers=["csv","wandb"]']).monitor.loggers == (
        "csv", "wandb")
    assert load_config(overrides=["monitor.loggers=csv,mlflow"]).monitor.loggers == (
        "csv", "mlflow")
    with pytest.raises(ConfigError, match="monitor.loggers='neptune': not a valid choice"):
        load_config(overrides=['monitor.loggers=["csv","neptune"]'])


def test_a_logger_whose_package_is_missing_is_refused_with_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    config = load_config(values={"monitor": {"loggers": ["csv", "wandb"]}})
    with pytest.raises(ConfigError, match=r"monitor.loggers='wandb': needs the wandb "
                       r"package \(pip install -e \"\.\[wandb\]\""):
        check_sections(config)


def test_callbacks_end_once_without_a_summary_after_an_error():
    from disttrain.monitor.callbacks import Callbacks

    said: list[str] = []
    main, everywhere, broken = Recorder(), Recorder(all_ranks=True), Broken()
    on_rank1 = Callbacks([main, everywhere], is_main=False, say=said.append, rank=1)
    assert on_rank1.active == [everywhere]
    callbacks = Callbacks([broken, main], is_main=True, say=said.append)
    for step in (1, 2, 3):
        callbacks.step_end(_Start(0), MetricsRecord(step=step, loss=1.0, lr=0.1))
    callbacks.train_end(_Start(0), None)  # fit()'s clean-up after an error
    callbacks.train_end(_Start(0), None)
    assert [c[1] for c in main.calls if c[0] == "step"] == [1, 2, 3]
    assert [c[1] for c in broken.calls if c[0] == "step"] == [1, 2]
    assert main.calls[-1] == broken.calls[-1] == ("end", None)
    assert [c[0] for c in main.calls].count("end") == 1
    assert said == ["warning: callback Broken.on_step_end raised RuntimeError: broken "
                    "callback; it gets no further calls"]
