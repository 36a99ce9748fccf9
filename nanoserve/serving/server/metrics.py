"""GET /metrics: the server's counters, gauges and latency histograms in Prometheus text format.

The text format (version 0.0.4) is small enough to write by hand, which keeps the server's
dependencies to the ASGI stack. Latencies come from the engine's own stamps on each finished
request (nanoserve.instruments.metrics.request_metrics), so they mean what the offline benchmarks mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from nanoserve.instruments.metrics import request_metrics

if TYPE_CHECKING:
    from nanoserve.engine import EngineStats
    from nanoserve.request import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds; the range a CPU or a GPU serving a small model lands in, as vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
FINISH_REASONS = ("stop", "length", "abort")


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Histogram:
    """A cumulative-bucket histogram of non-negative values."""

    def __init__(self, name: str, help: str, buckets: Sequence[float]) -> None:
        if list(buckets) != sorted(buckets):
            raise ValueError(f"buckets={tuple(buckets)} must be increasing")
        self.name, self.help, self.buckets = name, help, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # per bucket, not cumulative; last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.buckets) if value <= bound), len(self.buckets))
        self.counts[index] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        lines += [f"{self.name}_sum {_number(self.sum)}", f"{self.name}_count {self.count}"]
        return lines


def _scalar(name: str, kind: str, help: str, value: float) -> list[str]:
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {_number(value)}"]


class ServerMetrics:
    """Everything /metrics reports. `observe_finished` is AsyncEngine's on_finished hook."""

    def __init__(self, prefix: str = "nanoserve") -> None:
        self.prefix = prefix
        self.finished = dict.fromkeys(FINISH_REASONS, 0)  # requests by finish reason
        self.num_prompt_tokens = 0  # over finished requests, aborted included (their prefill ran)
        self.num_generation_tokens = 0  # likewise
        self.num_rejected = 0  # requests answered with a 4xx before reaching the engine
        self.ttft = Histogram(f"{prefix}_time_to_first_token_seconds",
                              "Arrival to first output token, per request that produced one.", TTFT_BUCKETS)
        self.tpot = Histogram(f"{prefix}_time_per_output_token_seconds",
                              "(E2E - TTFT) / (output tokens - 1), per completed request.", TPOT_BUCKETS)
        self.e2e = Histogram(f"{prefix}_e2e_request_latency_seconds",
                             "Arrival to finish, per completed (not aborted) request.", E2E_BUCKETS)

    def observe_finished(self, output: RequestOutput) -> None:
        reason = output.finish_reason or "abort"
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.num_prompt_tokens += len(output.prompt_token_ids)
        self.num_generation_tokens += len(output.token_ids)
        m = request_metrics(output)
        if m.ttft_s is not None:
            self.ttft.observe(m.ttft_s)
        if reason != "abort":
            if m.tpot_s is not None:
                self.tpot.observe(m.tpot_s)
            if m.e2e_s is not None:
                self.e2e.observe(m.e2e_s)

    def render(self, stats: EngineStats) -> str:
        """The text exposition; the gauges are read from `stats`, taken between two steps."""
        p = self.prefix
        name = f"{p}_requests_finished_total"
        lines = [f"# HELP {name} Requests finished, by finish reason.", f"# TYPE {name} counter"]
        lines += [f'{name}{{finish_reason="{reason}"}} {n}' for reason, n in self.finished.items()]
        lines += _scalar(f"{p}_requests_rejected_total", "counter",
                         "Requests answered with a 4xx before reaching the engine.", self.num_rejected)
        lines += _scalar(f"{p}_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                         self.num_prompt_tokens)
        lines += _scalar(f"{p}_generation_tokens_total", "counter", "Output tokens of finished requests.",
                         self.num_generation_tokens)
        lines += _scalar(f"{p}_num_requests_running", "gauge", "Requests holding a running slot.",
                         stats.num_running)
        lines += _scalar(f"{p}_num_requests_waiting", "gauge", "Requests queued for a slot.", stats.num_waiting)
        lines += _scalar(f"{p}_kv_blocks_used", "gauge", "KV cache blocks not free.",
                         stats.num_total_blocks - stats.num_free_blocks)
        lines += _scalar(f"{p}_kv_blocks_total", "gauge", "KV cache blocks in the pool.", stats.num_total_blocks)
        for histogram in (self.ttft, self.tpot, self.e2e):
            lines += histogram.render()
        return "\n".join(lines) + "\n"


def parse_text(text: str) -> dict[str, float]:
    """Samples of a text exposition as {'name{labels}': value}; for tests and bench tooling."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples
