"""GET /metrics: the server's counters, gauges and latency histograms in Prometheus text format.

The counts are kept here; the exposition is written by `prometheus_client` from metric families
built at each scrape (a collector rather than the library's live metric objects, which would add a
`_created` series to every counter and histogram). Latencies come from the engine's own stamps on
each finished request (`nanoserve.instruments.metrics.request_metrics`), so they mean what the
offline benchmarks mean.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from nanoserve.instruments.metrics import request_metrics

if TYPE_CHECKING:
    from nanoserve.engine import EngineStats
    from nanoserve.request import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST  # the text format generate_latest writes

# Seconds; the range a CPU or a GPU serving a small model lands in, as vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
FINISH_REASONS = ("stop", "length", "abort")
REFUSAL_REASONS = ("queue_full", "draining")  # why a valid request got a 503 before reaching the engine


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

    def family(self) -> HistogramMetricFamily:
        """The histogram as a metric family: cumulative counts per upper bound, then +Inf."""
        cumulative, buckets = 0, []
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        return HistogramMetricFamily(self.name, self.help, buckets=buckets, sum_value=self.sum)


class _Families:
    """A collector that yields metric families built beforehand (one scrape's snapshot)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def _counter(name: str, help: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, help, value=value)


def _gauge(name: str, help: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help, value=value)


class ServerMetrics:
    """Everything /metrics reports. `observe_finished` is AsyncEngine's on_finished hook."""

    def __init__(self, prefix: str = "nanoserve") -> None:
        self.prefix = prefix
        self.finished = dict.fromkeys(FINISH_REASONS, 0)  # requests by finish reason
        self.num_prompt_tokens = 0  # over finished requests, aborted included (their prefill ran)
        self.num_generation_tokens = 0  # likewise
        # Speculative decoding, vLLM's counters (over finished requests): verification steps that
        # carried drafts, the drafts verified, and those kept.
        self.num_spec_drafts = 0
        self.num_spec_draft_tokens = 0
        self.num_spec_accepted_tokens = 0
        self.num_rejected = 0  # requests answered with a 4xx before reaching the engine
        self.refused = dict.fromkeys(REFUSAL_REASONS, 0)  # valid requests answered 503, by reason
        self.num_embeddings = 0  # embedding requests finished with their vector (POST /v1/embeddings inputs)
        self.num_step_faults = 0  # engine steps that raised (their requests failed, the server went on)
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
        self.num_spec_drafts += output.num_drafts
        self.num_spec_draft_tokens += output.num_draft_tokens
        self.num_spec_accepted_tokens += output.num_accepted_tokens
        self.num_embeddings += output.embedding is not None
        m = request_metrics(output)
        if m.ttft_s is not None:
            self.ttft.observe(m.ttft_s)
        if reason != "abort":
            if m.tpot_s is not None:
                self.tpot.observe(m.tpot_s)
            if m.e2e_s is not None:
                self.e2e.observe(m.e2e_s)

    def observe_step_fault(self, error: Exception) -> None:
        self.num_step_faults += 1

    def families(self, stats: EngineStats) -> list[Metric]:
        """Every metric as a family; the gauges are read from `stats`, taken between two steps."""
        p = self.prefix
        finished = CounterMetricFamily(f"{p}_requests_finished", "Requests finished, by finish reason.",
                                       labels=["finish_reason"])
        for reason, n in self.finished.items():
            finished.add_metric([reason], n)
        refused = CounterMetricFamily(f"{p}_requests_refused", "Requests answered 503 before reaching the engine: "
                                      "the waiting queue was full, or the server was draining.", labels=["reason"])
        for reason, n in self.refused.items():
            refused.add_metric([reason], n)
        return [
            finished,
            _counter(f"{p}_requests_rejected", "Requests answered with a 4xx before reaching the engine.",
                     self.num_rejected),
            refused,
            _counter(f"{p}_step_faults", "Engine steps that raised; their requests failed, the others went on.",
                     self.num_step_faults),
            _counter(f"{p}_embedding_requests", "Embedding requests finished with their vector (one per input of "
                     "POST /v1/embeddings).", self.num_embeddings),
            _counter(f"{p}_prompt_tokens", "Prompt tokens of finished requests.", self.num_prompt_tokens),
            _counter(f"{p}_generation_tokens", "Output tokens of finished requests.", self.num_generation_tokens),
            _counter(f"{p}_spec_decode_num_drafts", "Speculative verifications (a request's drafts in one step), "
                     "over finished requests.", self.num_spec_drafts),
            _counter(f"{p}_spec_decode_num_draft_tokens", "Speculative draft tokens verified, over finished requests.",
                     self.num_spec_draft_tokens),
            _counter(f"{p}_spec_decode_num_accepted_tokens", "Speculative draft tokens accepted, over finished "
                     "requests.", self.num_spec_accepted_tokens),
            _gauge(f"{p}_num_requests_running", "Requests holding a running slot.", stats.num_running),
            _gauge(f"{p}_num_requests_waiting", "Requests queued for a slot.", stats.num_waiting),
            _gauge(f"{p}_kv_blocks_used", "KV cache blocks not free.", stats.num_total_blocks - stats.num_free_blocks),
            _gauge(f"{p}_kv_blocks_total", "KV cache blocks in the pool.", stats.num_total_blocks),
            *(histogram.family() for histogram in (self.ttft, self.tpot, self.e2e)),
        ]

    def render(self, stats: EngineStats) -> str:
        """The text exposition, written by `prometheus_client.generate_latest`."""
        registry = CollectorRegistry()
        registry.register(_Families(self.families(stats)))
        return generate_latest(registry).decode()


def parse_text(text: str) -> dict[str, float]:
    """Samples of a text exposition as {'name{labels}': value}; for tests and bench tooling."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples
