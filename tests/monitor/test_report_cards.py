"""The report's text is written for people: units, separators, percents, and MFU named
by what it is measured against. No matplotlib needed."""

from __future__ import annotations

import re

import pytest
from test_report import write_run

from disttrain.monitor.report import cards, formats, load_run

# A figure a reader cannot use: a run of five or more digits with no thousands separator
# (3363856.0), or a fraction with more than four decimals (0.7647714986).
RAW_NUMBER = re.compile(r"(?<![\d,])\d{5,}|\.\d{5,}")


@pytest.mark.parametrize("n, text", [(512, "512 B"), (3363856.0, "3.2 MiB"),
                                     (71615492, "68.3 MiB"), (463 * 2**20, "463 MiB"),
                                     (1.5e9, "1.4 GiB"), (1023 * 1024, "1.0 MiB")])
def test_bytes_in_binary_units(n, text):
    assert formats.format_bytes(n) == text


@pytest.mark.parametrize("s, text", [(0.0004, "400 µs"), (0.0123, "12.3 ms"),
                                     (0.85, "850 ms"), (2.43, "2.4 s"), (97.3, "1 min 37 s"),
                                     (3790, "1 h 03 min")])
def test_seconds_in_the_unit_that_reads(s, text):
    assert formats.format_seconds(s) == text


def test_rates_percents_and_prefixes():
    assert formats.format_rate(7634.52, "tokens/s") == "7,635 tokens/s"
    assert formats.format_percent(0.7647714986) == "76.5%"
    assert formats.format_si(4.3775480267e10, "FLOP/s") == "43.8 GFLOP/s"
    assert formats.format_si(989.5e12, "FLOP/s") == "990 TFLOP/s"


def test_a_summary_value_without_a_card_takes_its_unit_from_its_name():
    assert formats.format_value("loop_s", 245.0) == "4 min 05 s"
    assert formats.format_value("memory_bytes", {"params": 3363840}) == "params 3.2 MiB"
    assert formats.format_value("staleness_max", 3) == "3"
    assert formats.format_value("worker_steps", list(range(20))) == "20 values, 0 to 19"
    assert formats.format_value("whatever", 0.7647714986) == "0.7648"


def test_no_card_shows_a_raw_float_or_a_json_dict(tmp_path):
    rows = cards.summary_rows(load_run(write_run(tmp_path / "run")))
    for label, text in rows:
        if label != "Run directory":
            assert not RAW_NUMBER.search(text), (label, text)
            assert "{" not in text and "[" not in text, (label, text)
    got = dict(rows)
    assert got["Communication per step"] == "3.2 MiB sent by each rank"
    assert got["Memory: parameters (rank 0)"] == "3.2 MiB"
    assert got["Memory: optimizer state (rank 0)"] == "6.4 MiB"
    assert got["Memory: activations saved for backward (rank 0)"] == "68.3 MiB"
    assert got["Memory: model state + activations (rank 0)"] == "81.1 MiB"
    assert got["Memory: model state + activations per rank"] == \
        "78.9 MiB (rank 2) to 81.1 MiB (rank 0)"
    assert got["Collectives issued"] == "179" and got["Device"] == "cpu"


def test_summary_keys_disttrain_has_no_card_for_are_still_formatted(tmp_path):
    run = load_run(write_run(tmp_path / "run"))
    summary = dict(run.summary, sync="async", loop_s=245.0, staleness_mean=1.2345678,
                   worker_steps=[101, 99, 100], equivalent_steps=100.33333333)
    rows = dict(cards.summary_rows(type(run)(run_dir=run.run_dir, records=run.records,
                                             summary=summary)))
    assert rows["Loop s"] == "4 min 05 s" and rows["Worker steps"] == "101, 99, 100"
    assert rows["Staleness (mean)"] == "1.23 updates" and rows["Synchronisation"] == "async"
    assert rows["Equivalent steps"] == "100.3"


@pytest.mark.parametrize("source, kind, says", [
    ("measured:cpu", "measured CPU matmul rate", "timed on this CPU at start-up (measured, "
     "not the hardware's peak)"),
    ("measured:cuda:bf16", "measured GPU matmul rate", "a bf16 matmul timed on this GPU"),
    ("published:H100-SXM:bf16", "datasheet peak", "the H100-SXM's datasheet dense bf16 peak"),
    ("configured", "configured peak", "monitor.peak_tflops")])
def test_mfu_says_what_it_is_measured_against(tmp_path, source, kind, says):
    run = load_run(write_run(tmp_path / "run"))
    summary = dict(run.summary, peak_source=source, peak_tflops=989.5)
    rows = dict(cards.summary_rows(type(run)(run_dir=run.run_dir, records=run.records,
                                             summary=summary)))
    text = rows[f"MFU (vs {kind})"]
    assert text.startswith("38.1% of 990 TFLOP/s per device, ") and says in text
    if source.startswith("measured"):
        assert "peak" not in text.replace("not the hardware's peak", "")


def test_an_unfinished_run_shows_the_records_mean_mfu_and_its_source(tmp_path):
    run = load_run(write_run(tmp_path / "run"))
    rows = dict(cards.summary_rows(type(run)(run_dir=run.run_dir, records=run.records)))
    text = rows["Mean MFU (vs measured CPU matmul rate)"]
    assert re.fullmatch(r"\d+\.\d% of an fp32 matmul rate timed on this CPU .*", text)


def test_mfu_over_100_percent_says_the_denominator_is_too_low(tmp_path):
    run = load_run(write_run(tmp_path / "run"))
    summary = dict(run.summary, mfu=6.465, peak_tflops=0.00294)
    rows = dict(cards.summary_rows(type(run)(run_dir=run.run_dir, records=run.records,
                                             summary=summary)))
    text = rows["MFU (vs measured CPU matmul rate)"]
    assert text.startswith("646.5% of 2.94 GFLOP/s per device")
    assert "over 100%" in text and "monitor.peak_tflops" in text
