"""The metrics record: its JSON keys are its FIELDS, and every writer takes it."""

from __future__ import annotations

import pytest

from disttrain.monitor import MetricsRecord, MetricsWriter, read_metrics
from disttrain.monitor import record as rec
from disttrain.monitor.metrics import truncate_metrics
from disttrain.monitor.telemetry import TensorBoardWriter


def _full() -> MetricsRecord:
    """A record with every field set (a number, or a string / list / dict by type)."""
    values = {"sync": "local_sgd", "shares": [4, 4], "stragglers": [1],
              "memory_mb": {"params": 1.5},
              "ranks": [{k: 0.5 for k in rec.RANK_FIELDS} | {rec.RANK: 0}]}
    return MetricsRecord(**{name: values.get(name, i + 1)
                            for i, name in enumerate(rec.FIELDS)})


def test_json_keys_are_the_fields(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write(_full())
    writer.write(MetricsRecord(step=2, loss=1.25))
    writer.close()
    full, sparse = read_metrics(path)
    assert list(full) == sorted(rec.FIELDS)  # sort_keys: the same order every run
    assert sparse == {"step": 2, "loss": 1.25}  # unset fields are not written


def test_a_strategys_own_figures_are_written_beside_the_fields(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write({"step": 1, "lr": 0.5, "plugin_bytes": 3})
    writer.write(MetricsRecord(step=2).with_figures({"sync_rounds": 4, "plugin_bytes": 5}))
    writer.close()
    assert path.read_text() == ('{"lr": 0.5, "plugin_bytes": 3, "step": 1}\n'
                                '{"plugin_bytes": 5, "step": 2, "sync_rounds": 4}\n')
    assert MetricsRecord.from_dict({"step": 1, "lr": 0.5, "x": 1}).extra == {"x": 1}


def test_a_figure_named_like_a_field_must_be_the_field():
    with pytest.raises(ValueError, match="loss"):
        MetricsRecord(step=1, extra={"loss": 2.0})


def test_truncation_keeps_records_up_to_the_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    for step in (1, 2, 3):
        writer.write(MetricsRecord(step=step))
    writer.close()
    truncate_metrics(path, 2)
    assert [r[rec.STEP] for r in read_metrics(path)] == [1, 2]


def test_reader_keys_and_rank_keys_are_record_names():
    assert {rec.LOSS, rec.EVAL_LOSS, rec.MFU, rec.STEP_TIME_S, rec.RANKS} <= set(rec.FIELDS)
    assert rec.MEM_PEAK_MB in rec.RANK_FIELDS and rec.RANK in rec.RANK_FIELDS


class _Scalars:
    """Stands in for torch's SummaryWriter: remembers add_scalar calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.calls.append((tag, value, step))

    def flush(self) -> None:
        pass


def test_tensorboard_gets_every_number_but_the_step_under_its_field_name():
    board = TensorBoardWriter(None)
    board.writer = _Scalars()
    board.write(MetricsRecord(step=7, loss=2.0, sync="diloco", ranks=[], sync_rounds=3))
    assert sorted(board.writer.calls) == [("loss", 2.0, 7), ("sync_rounds", 3, 7)]
