"""Metrics loggers: callbacks that copy each logged record somewhere else.

``metrics.jsonl`` stays the run's canonical record (``disttrain report`` and resuming
read it); ``monitor.loggers`` adds copies, written on rank 0 from each record's scalar
figures (its numbers but the step, under their field names; lists and mappings such as
``ranks`` stay in ``metrics.jsonl`` only):

- ``csv``: ``metrics.csv`` in the run directory, one row per record; the columns are
  the figures seen so far (a figure that first appears later, e.g. ``eval_loss``,
  widens the file).
- ``tensorboard``: event files under ``tensorboard/`` (also on by default, when the
  package is installed, through ``monitor.tensorboard``).
- ``wandb``: a Weights & Biases run in offline mode under ``wandb/`` (nothing leaves
  the machine; ``wandb sync`` uploads it later), with the resolved config.
- ``mlflow``: an MLflow run in the file store ``mlruns/`` (experiment ``disttrain``),
  with the config as parameters (``section.key``) and the figures as metrics by step.

wandb and mlflow are imported only when chosen (the ``wandb`` / ``mlflow`` extras);
the config's validation refuses a logger whose package is missing.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import Config
from ..names import (
    CSV_FILE,
    LOGGER_CSV,
    LOGGER_MLFLOW,
    LOGGER_TENSORBOARD,
    LOGGER_WANDB,
    MLFLOW_DIR,
    TENSORBOARD_DIR,
)
from .callbacks import Callback, Trainer
from .record import STEP, MetricsRecord

EXPERIMENT = "disttrain"  # the W&B project and the MLflow experiment


def scalars(record: MetricsRecord) -> dict[str, float]:
    """The record's numbers but the step, by field name (booleans and lists left out)."""
    return {k: v for k, v in record.to_dict().items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != STEP}


class CSVLogger(Callback):
    """``metrics.csv``: a ``step`` column, then each figure in order of first sight."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.columns: list[str] = [STEP]

    def on_train_start(self, trainer: Trainer) -> None:
        """A resumed run keeps the rows up to its checkpoint (later ones are redone)."""
        kept = [r for r in self._rows() if int(r[STEP]) <= trainer.start_step]
        for row in kept:
            self.columns += [k for k in row if k not in self.columns]
        self._rewrite(kept)

    def on_log(self, trainer: Trainer, record: MetricsRecord) -> None:
        row = {STEP: record.step} | scalars(record)
        new = [k for k in row if k not in self.columns]
        if new:  # rewrite the file under the wider header
            self.columns += new
            self._rewrite(self._rows() + [row])
            return
        with self.path.open("a", newline="") as fh:
            csv.DictWriter(fh, self.columns, restval="").writerow(row)

    def _rows(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        with self.path.open(newline="") as fh:
            return list(csv.DictReader(fh))

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        staged = self.path.with_name(self.path.name + ".tmp")
        with staged.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, self.columns, restval="")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(staged, self.path)


class TensorBoardLogger(Callback):
    """Scalars to a ``torch.utils.tensorboard.SummaryWriter`` (or anything with its
    ``add_scalar`` / ``flush`` / ``close``)."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def on_log(self, trainer: Trainer, record: MetricsRecord) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, record.step)
        self.writer.flush()

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any] | None) -> None:
        self.writer.close()


class WandbLogger(Callback):
    """Records to a W&B run (``wandb.init``'s), finished with the run's outcome."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def on_log(self, trainer: Trainer, record: MetricsRecord) -> None:
        self.run.log(scalars(record), step=record.step)

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any] | None) -> None:
        if summary is not None:
            self.run.summary.update({k: v for k, v in summary.items()
                                     if isinstance(v, (int, float, str))})
        self.run.finish(exit_code=0 if summary is not None else 1)


class MLflowLogger(Callback):
    """Records as the metrics of one MLflow run, through an ``MlflowClient``."""

    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    def on_log(self, trainer: Trainer, record: MetricsRecord) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(key, float(value), now, record.step)
            for key, value in scalars(record).items()])

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any] | None) -> None:
        self.client.set_terminated(self.run_id,
                                   "FINISHED" if summary is not None else "FAILED")


def _open_tensorboard(run_dir: Path, config: Config) -> Callback:
    from torch.utils.tensorboard import SummaryWriter

    return TensorBoardLogger(SummaryWriter(str(run_dir / TENSORBOARD_DIR)))


def _open_wandb(run_dir: Path, config: Config) -> Callback:
    """An offline run under ``run_dir/wandb``: nothing is sent, no login is needed."""
    import wandb

    settings = wandb.Settings(mode="offline", silent=True, console="off",
                              x_disable_stats=True, disable_git=True, save_code=False)
    run = wandb.init(project=EXPERIMENT, name=run_dir.name, dir=str(run_dir),
                     config=config.to_dict(), settings=settings)
    return WandbLogger(run)


def _open_mlflow(run_dir: Path, config: Config) -> Callback:
    """A run in the file store ``run_dir/mlruns``, the config as its parameters."""
    # MLflow 3 refuses new file stores unless told they are wanted: they are here (a
    # run directory is self-contained; `mlflow ui --backend-store-uri` reads it)
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / MLFLOW_DIR).resolve().as_uri())
    experiment = client.get_experiment_by_name(EXPERIMENT)
    experiment_id = (experiment.experiment_id if experiment is not None
                     else client.create_experiment(EXPERIMENT))
    run_id = client.create_run(experiment_id, run_name=run_dir.name).info.run_id
    params = [Param(f"{section}.{key}", str(value))
              for section, table in config.to_dict().items() for key, value in table.items()]
    for start in range(0, len(params), 100):  # the most one call may carry
        client.log_batch(run_id, params=params[start:start + 100])
    return MLflowLogger(client, run_id)


_OPENERS: dict[str, Callable[[Path, Config], Callback]] = {
    LOGGER_TENSORBOARD: _open_tensorboard,
    LOGGER_CSV: lambda run_dir, config: CSVLogger(run_dir / CSV_FILE),
    LOGGER_WANDB: _open_wandb,
    LOGGER_MLFLOW: _open_mlflow,
}


def logger_names(config: Config) -> list[str]:
    """``monitor.loggers`` without repeats, with ``tensorboard`` added when
    ``monitor.tensorboard`` is on and the package is installed."""
    names = list(dict.fromkeys(config.monitor.loggers))
    if (config.monitor.tensorboard and LOGGER_TENSORBOARD not in names
            and importlib.util.find_spec("tensorboard") is not None):
        names.append(LOGGER_TENSORBOARD)
    return names


def open_loggers(config: Config, run_dir: Path, say: Callable[[str], None]
                 ) -> list[Callback]:
    """The config's loggers on ``run_dir`` (rank 0 only). One that fails to open is
    reported in one warning line and left out: the run goes on without it."""
    out = []
    for name in logger_names(config):
        try:
            out.append(_OPENERS[name](run_dir, config))
        except Exception as exc:  # a logger's own failure (its package, its files)
            say(f"warning: the {name} logger could not start ({type(exc).__name__}: "
                f"{exc}); the run goes on without it")
    return out
