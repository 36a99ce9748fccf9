"""nanoserve.serving.bench_serve without a server: its CSV goes through the one writer, one row a run."""

from __future__ import annotations

import csv
import math

from nanoserve.instruments.metrics import BenchmarkMetrics, summarize
from nanoserve.serving.bench_serve import BenchConfig, append_csv, csv_row


def test_append_csv_adds_one_row_per_run_under_one_header(tmp_path):
    config = BenchConfig("http://127.0.0.1:8000", rate=math.inf, num_prompts=2)
    m = BenchmarkMetrics(duration_s=2.0, completed=2, total_input_tokens=64, total_output_tokens=32,
                         request_throughput=1.0, output_throughput=16.0, queue=summarize([]),
                         ttft=summarize([0.5, 0.25]), tpot=summarize([0.125]), itl=summarize([0.125]),
                         e2e=summarize([1.0, 2.0]))
    out = tmp_path / "bench.csv"
    append_csv(out, csv_row(config, "m", m, 0))
    append_csv(out, csv_row(config, "m", m, 1))
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and out.read_text().startswith("started_at,")
    assert [r["failed"] for r in rows] == ["0", "1"]
    assert rows[0]["request_rate_req_s"] == "inf" and rows[0]["max_concurrency"] == ""
    assert rows[0]["mean_ttft_ms"] == "375.0" and rows[0]["p99_e2e_ms"] == "1990.0"  # 1 + 0.99 s
