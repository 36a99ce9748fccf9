"""Latency against throughput: the rate sweep and the slot sweep on one pair of axes.

A request-rate sweep and a slot-count sweep each give a throughput and a latency per setting. Put
on the same axes, the knee is a point on a picture rather than a row in a table. The CSV
(`csv_rows` through `nanoserve.instruments.csv_writer.write_csv`) needs nothing beyond the standard
library; `plot_png` needs matplotlib, which is an optional extra (`pip install matplotlib`, or
`pip install nanoserve[plot]`) and is imported only when a picture is asked for.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanoserve.instruments import csv_writer
from nanoserve.instruments.metrics import summarize

if TYPE_CHECKING:
    from nanoserve.instruments.baseline import SystemRun
    from nanoserve.instruments.metrics import BenchmarkMetrics

SOURCES = ("rate", "slots")  # which sweep a point came from
LATENCIES = ("queue", "ttft", "tpot", "itl", "e2e")  # latencies a point may plot
STATS = ("mean", "median", "p99")  # summary statistics a point may plot

CSV_COLUMNS = (
    "source",
    "rate_req_per_s",
    "slots",
    "throughput_tok_per_s",
    "latency_s",
    "latency_metric",
)


@dataclass(frozen=True)
class CurvePoint:
    """One setting of one sweep: the throughput it reached and the latency it cost."""

    source: str  # "rate" (request-rate sweep) or "slots" (slot-count sweep)
    setting: float  # the swept value: requests per second for "rate", slot count for "slots"
    throughput_tok_s: float  # output tokens per wall-clock second
    latency_s: float  # the latency named by `metric`, seconds
    metric: str = "e2e_median"  # which latency: "<queue|ttft|tpot|itl|e2e>_<mean|median|p99>"

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source={self.source!r} must be one of {SOURCES}")
        if not self.setting > 0:
            raise ValueError(f"setting={self.setting} must be > 0")
        if self.source == "slots" and self.setting != int(self.setting):
            raise ValueError(f"slots setting={self.setting} must be a whole number")
        for name in ("throughput_tok_s", "latency_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name}={value} must be finite and >= 0")


def _split_metric(latency: str, stat: str) -> str:
    if latency not in LATENCIES:
        raise ValueError(f"latency={latency!r} must be one of {LATENCIES}")
    if stat not in STATS:
        raise ValueError(f"stat={stat!r} must be one of {STATS}")
    return f"{latency}_{stat}"


def point_from_metrics(
    source: str, setting: float, metrics: BenchmarkMetrics, latency: str = "e2e", stat: str = "median"
) -> CurvePoint:
    """A curve point from one run's `BenchmarkMetrics` (output throughput, one latency statistic).

    Raises:
        ValueError: unknown latency or stat, or the run has no value for that latency.
    """
    metric = _split_metric(latency, stat)
    value = getattr(getattr(metrics, latency), stat)
    if value is None:
        raise ValueError(f"the run has no {latency} values (count 0); cannot plot {metric}")
    return CurvePoint(source, setting, metrics.output_throughput, value, metric)


def point_from_run(run: SystemRun, latency: str = "e2e", stat: str = "median") -> CurvePoint:
    """A "slots" curve point from a `SystemRun` of the slot sweep (ttft, tpot or e2e per request).

    Raises:
        ValueError: unknown latency or stat, a latency a run's records do not hold, or tpot on a
            run in which no request has more than one output token.
    """
    metric = _split_metric(latency, stat)
    per_request = {
        "ttft": [r.ttft_s for r in run.records],
        "tpot": [r.tpot_s for r in run.records if r.tpot_s is not None],
        "e2e": [r.e2e_s for r in run.records],
    }
    if latency not in per_request:
        raise ValueError(f"latency={latency!r}: a SystemRun records only {tuple(per_request)}")
    value = getattr(summarize(per_request[latency]), stat)
    if value is None:
        raise ValueError(f"the run has no {latency} values (count 0); cannot plot {metric}")
    return CurvePoint("slots", run.slots, run.throughput, value, metric)


def csv_rows(points: Sequence[CurvePoint]) -> list[dict[str, Any]]:
    """One row per point for `csv_writer.write_csv`, columns `CSV_COLUMNS`; the setting goes in its
    own unit's column and the other one is left empty."""
    return [
        {
            "source": p.source,
            "rate_req_per_s": p.setting if p.source == "rate" else "",
            "slots": int(p.setting) if p.source == "slots" else "",
            "throughput_tok_per_s": p.throughput_tok_s,
            "latency_s": p.latency_s,
            "latency_metric": p.metric,
        }
        for p in points
    ]


def write_csv(points: Sequence[CurvePoint], path: str | os.PathLike[str]) -> None:
    """`csv_writer.write_csv(path, csv_rows(points))`, for callers that pass the points first."""
    csv_writer.write_csv(path, csv_rows(points))


def plot_png(points: Sequence[CurvePoint], path: str | os.PathLike[str], title: str | None = None) -> None:
    """Draw both sweeps as latency against throughput on one pair of axes and save a PNG.

    Raises:
        ImportError: matplotlib is not installed (it is an optional extra).
        ValueError: no points, or points that plot different latency metrics.
    """
    if not points:
        raise ValueError("plot_png needs at least 1 point, got 0")
    metrics = {p.metric for p in points}
    if len(metrics) != 1:
        raise ValueError(f"points plot {sorted(metrics)}; one pair of axes takes one latency metric")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            "plot_png needs matplotlib, an optional extra: pip install matplotlib "
            "(or pip install nanoserve[plot]); the CSV works without it"
        ) from err

    fig, ax = plt.subplots(figsize=(7, 5))
    labels = {"rate": ("request-rate sweep", "req/s", "o-"), "slots": ("slot sweep", "slots", "s--")}
    for source in SOURCES:
        series = sorted((p for p in points if p.source == source), key=lambda p: p.setting)
        if not series:
            continue
        name, unit, style = labels[source]
        ax.plot([p.throughput_tok_s for p in series], [p.latency_s for p in series], style, label=name)
        for p in series:
            setting = f"{int(p.setting)}" if source == "slots" else f"{p.setting:g}"
            ax.annotate(f"{setting} {unit}", (p.throughput_tok_s, p.latency_s), fontsize=8,
                        textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("throughput (output tok/s)")
    ax.set_ylabel(f"{next(iter(metrics))} (s)")
    ax.set_title(title or "latency against throughput")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
