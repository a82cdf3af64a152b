"""The metrics record: its JSON keys are its FIELDS, and every writer takes it."""

from __future__ import annotations

import pytest

from disttrain.monitor import MetricsRecord, MetricsWriter, read_metrics
from disttrain.monitor import record as rec
from disttrain.monitor.loggers import TensorBoardLogger
from disttrain.monitor.metrics import truncate_metrics


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
    board = TensorBoardLogger(_Scalars())
    board.on_log(None, MetricsRecord(step=7, loss=2.0, sync="diloco", ranks=[],
                                     sync_rounds=3))
    assert sorted(board.writer.calls) == [("loss", 2.0, 7), ("sync_rounds", 3, 7)]


def _flaky_disk(monkeypatch, fails: int, first_takes: int):
    """os.write for files under test: the first call writes ``first_takes`` bytes, the
    next ``fails`` calls raise ENOSPC, then writes succeed."""
    import errno
    import os

    from disttrain.monitor import metrics

    real, calls = os.write, []

    def write(fd, data):
        if fd <= 2:  # the terminal, pytest's capture
            return real(fd, data)
        calls.append(len(data))
        if len(calls) == 1:
            return real(fd, bytes(data[:first_takes]))
        if len(calls) <= 1 + fails:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)
    monkeypatch.setattr(metrics.os, "write", write)


def test_a_full_disk_holds_records_until_it_has_room(tmp_path, monkeypatch):
    path, said = tmp_path / "metrics.jsonl", []
    _flaky_disk(monkeypatch, fails=2, first_takes=5)
    writer = MetricsWriter(path, said.append)
    for step in (1, 2, 3, 4):
        writer.write(MetricsRecord(step=step))  # 1: 5 bytes, then ENOSPC; 2, 3: ENOSPC
    writer.close()
    assert [r[rec.STEP] for r in read_metrics(path)] == [1, 2, 3, 4]
    assert path.read_text().count("\n") == 4
    assert len(said) == 2 and "No space left on device" in said[0]
    assert "writable again" in said[1]


def test_a_disk_that_stays_full_loses_whole_records_and_says_how_many(tmp_path,
                                                                       monkeypatch):
    path, said = tmp_path / "metrics.jsonl", []
    writer = MetricsWriter(path, said.append)
    writer.write(MetricsRecord(step=1))
    _flaky_disk(monkeypatch, fails=100, first_takes=7)
    for step in (2, 3):
        writer.write(MetricsRecord(step=step))
    writer.close()
    assert path.read_text() == '{"step": 1}\n'  # the partial line is cut off
    assert said[-1] == f"warning: 2 metrics record(s) could not be written to {path}"


def test_a_line_cut_short_by_a_crash_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert [r[rec.STEP] for r in read_metrics(path)] == [1, 2]
    truncate_metrics(path, 5)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
