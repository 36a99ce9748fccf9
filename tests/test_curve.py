"""nanoserve.instruments.curve: points from both sweeps, the CSV rows (written by the one CSV writer,
no matplotlib needed) and the optional PNG."""

from __future__ import annotations

import csv
import sys

import pytest

from nanoserve.instruments.baseline import SystemRun
from nanoserve.instruments.csv_writer import write_csv
from nanoserve.instruments.curve import (
    CSV_COLUMNS,
    CurvePoint,
    csv_rows,
    plot_png,
    point_from_metrics,
    point_from_run,
)
from nanoserve.instruments.metrics import benchmark_metrics
from nanoserve.instruments.record import RunRecord
from nanoserve.request import RequestOutput


def output(rid, arrival, times):
    return RequestOutput(
        request_id=rid, prompt_token_ids=[1, 2], token_ids=[3] * len(times), text="", finished=True,
        finish_reason="length", arrival_time=arrival, first_scheduled_time=arrival, first_token_time=times[0],
        finished_time=times[-1], token_times=list(times), running_s=times[-1] - arrival,
    )


def sample_points():
    return [
        CurvePoint("rate", 0.5, 10.0, 1.25),
        CurvePoint("rate", 2.0, 30.0, 2.5),
        CurvePoint("slots", 1, 12.0, 4.0),
        CurvePoint("slots", 4, 40.0, 8.0),
    ]


def test_curve_point_validation():
    with pytest.raises(ValueError, match="source='batch' must be one of"):
        CurvePoint("batch", 1, 1.0, 1.0)
    with pytest.raises(ValueError, match="setting=0 must be > 0"):
        CurvePoint("rate", 0, 1.0, 1.0)
    with pytest.raises(ValueError, match="slots setting=1.5 must be a whole number"):
        CurvePoint("slots", 1.5, 1.0, 1.0)
    with pytest.raises(ValueError, match="latency_s=-1.0"):
        CurvePoint("rate", 1.0, 1.0, -1.0)
    with pytest.raises(ValueError, match="throughput_tok_s=inf"):
        CurvePoint("rate", 1.0, float("inf"), 1.0)


def test_point_from_metrics_by_hand():
    # two requests on a ruler: e2e 3.0 and 2.0, ttft 1.0 and 0.5; 5 tokens in 4 s
    outs = [output("a", 0.0, (1.0, 2.0, 3.0)), output("b", 1.0, (1.5, 3.0))]
    bm = benchmark_metrics(outs, duration_s=4.0)
    p = point_from_metrics("rate", 2.0, bm)
    assert p == CurvePoint("rate", 2.0, 1.25, 2.5, "e2e_median")
    assert point_from_metrics("rate", 2.0, bm, latency="ttft", stat="mean").latency_s == 0.75
    with pytest.raises(ValueError, match="stat='p50' must be one of"):
        point_from_metrics("rate", 2.0, bm, stat="p50")
    one_token = benchmark_metrics([output("c", 0.0, (1.0,))], duration_s=1.0)
    with pytest.raises(ValueError, match="no tpot values"):
        point_from_metrics("rate", 1.0, one_token, latency="tpot")


def test_point_from_run_by_hand():
    records = (
        RunRecord(2, (1, 2), 0.0, 1.0, 2.0, served_s=2.0, prefill_s=1.0),
        RunRecord(2, (1, 2), 0.0, 3.0, 4.0, served_s=2.0, prefill_s=1.0),
        RunRecord(2, (1, 2), 0.0, 5.0, 8.0, served_s=4.0, prefill_s=1.0),
    )
    run = SystemRun("nanoserve, 2", records, wall_s=8.0, slots=2)
    p = point_from_run(run)
    assert p == CurvePoint("slots", 2, 0.75, 4.0, "e2e_median")  # 6 tokens / 8 s; e2e 2, 4, 8
    assert point_from_run(run, latency="ttft", stat="mean").latency_s == 3.0
    # TPOT (e2e - ttft) / 1: 1, 1, 3; median 1
    assert point_from_run(run, latency="tpot") == CurvePoint("slots", 2, 0.75, 1.0, "tpot_median")
    with pytest.raises(ValueError, match="a SystemRun records only"):
        point_from_run(run, latency="itl")
    one_token = SystemRun("x", (RunRecord(2, (1,), 0.0, 1.0, 1.0, served_s=1.0, prefill_s=1.0),), wall_s=1.0)
    with pytest.raises(ValueError, match="no tpot values"):
        point_from_run(one_token, latency="tpot")


def test_curve_write_csv_is_the_one_writer_with_the_points_first(tmp_path):
    from nanoserve.instruments import curve

    curve.write_csv(sample_points(), tmp_path / "a.csv")
    write_csv(tmp_path / "b.csv", csv_rows(sample_points()))
    assert (tmp_path / "a.csv").read_text() == (tmp_path / "b.csv").read_text()


def test_write_csv_round_trips_with_units(tmp_path):
    path = tmp_path / "curve.csv"
    write_csv(path, csv_rows(sample_points()))
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0].keys()) == CSV_COLUMNS
    assert "throughput_tok_per_s" in CSV_COLUMNS and "rate_req_per_s" in CSV_COLUMNS and "latency_s" in CSV_COLUMNS
    assert rows[0] == {"source": "rate", "rate_req_per_s": "0.5", "slots": "", "throughput_tok_per_s": "10.0",
                       "latency_s": "1.25", "latency_metric": "e2e_median"}
    assert rows[3] == {"source": "slots", "rate_req_per_s": "", "slots": "4", "throughput_tok_per_s": "40.0",
                       "latency_s": "8.0", "latency_metric": "e2e_median"}
    assert len(rows) == 4


def test_csv_does_not_need_matplotlib_and_png_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    write_csv(tmp_path / "ok.csv", csv_rows(sample_points()))
    assert (tmp_path / "ok.csv").read_text().startswith("source,")
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_png(sample_points(), tmp_path / "curve.png")
    assert not (tmp_path / "curve.png").exists()


def test_plot_png_refuses_mixed_metrics_and_empty(tmp_path):
    mixed = [CurvePoint("rate", 1.0, 1.0, 1.0, "e2e_median"), CurvePoint("slots", 1, 1.0, 1.0, "ttft_p99")]
    with pytest.raises(ValueError, match="one latency metric"):
        plot_png(mixed, tmp_path / "x.png")
    with pytest.raises(ValueError, match="at least 1 point"):
        plot_png([], tmp_path / "x.png")


def test_plot_png_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "curve.png"
    plot_png(sample_points(), path, title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
