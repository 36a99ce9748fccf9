"""A run's serving metrics (vLLM's `benchmark_serving`), from the engine's own stamps.

Every number here is a difference of two `time.perf_counter()` stamps the engine wrote onto a
`RequestOutput` (arrival, first scheduled, first token, one per output token, finished) plus the
`running_s` accumulator. Nothing in this module reads a clock: a latency measured by the caller
around `engine.step()` would include the caller's own loop, and the point of stamping inside the
engine is that the number means the same thing whoever drives it. `request_metrics` turns one
output into the one per-request record (`nanoserve.instruments.record.RunRecord`, which defines
queue, TTFT, TPOT, ITL and E2E); the rest summarises those records over a run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoserve.instruments.record import RunRecord

if TYPE_CHECKING:  # only for annotations: metrics reads stamps, it never needs the engine
    from nanoserve.request import RequestOutput

RequestMetrics = RunRecord  # one request's latencies: the one per-request record, under its serving name


def request_metrics(output: RequestOutput) -> RunRecord:
    """The record of one request, from the stamps on its `RequestOutput` (finished or not).

    Raises:
        ValueError: the stamps are not a possible history (a stamp earlier than the arrival, a
            `token_times` list whose length is not the number of output tokens, token times that
            go backwards, a negative `running_s`, or one the record refuses).
    """
    rid = output.request_id
    arrival = output.arrival_time
    for name in ("first_scheduled_time", "first_token_time", "finished_time"):
        stamp = getattr(output, name)
        if stamp is not None and stamp < arrival:
            raise ValueError(f"request {rid}: {name}={stamp} is before arrival_time={arrival}")
    if output.running_s < 0:
        raise ValueError(f"request {rid}: running_s={output.running_s} must be >= 0")
    scheduled, first_token = output.first_scheduled_time, output.first_token_time
    return RunRecord(
        prompt_len=len(output.prompt_token_ids),
        token_ids=tuple(output.token_ids),
        arrival_s=arrival,
        first_token_s=first_token,
        finished_s=output.finished_time if output.finished else None,
        served_s=output.running_s,
        prefill_s=None if scheduled is None or first_token is None else first_token - scheduled,
        request_id=rid,
        first_scheduled_s=scheduled,
        token_times=tuple(output.token_times),
    )


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's default).

    Raises:
        ValueError: `values` is empty, or `q` is outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values: need at least 1 value")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q={q} must be within [0, 100]")
    ordered = sorted(values)
    rank = q / 100.0 * (len(ordered) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    frac = rank - lo
    return ordered[lo] + (ordered[hi] - ordered[lo]) * frac


@dataclass(frozen=True)
class Summary:
    """Mean, median and p99 of one latency over a run; the three are None when count is 0."""

    mean: float | None  # arithmetic mean, seconds
    median: float | None  # 50th percentile, seconds
    p99: float | None  # 99th percentile (linear interpolation), seconds
    count: int  # how many values were summarised


def summarize(values: Iterable[float]) -> Summary:
    """Summarise a collection of values (seconds). An empty collection gives `count == 0` and Nones.

    Raises:
        ValueError: a value is NaN or infinite.
    """
    vals = list(values)
    for v in vals:
        if not math.isfinite(v):
            raise ValueError(f"cannot summarise {v}: every value must be finite")
    if not vals:
        return Summary(mean=None, median=None, p99=None, count=0)
    return Summary(
        mean=math.fsum(vals) / len(vals),
        median=percentile(vals, 50.0),
        p99=percentile(vals, 99.0),
        count=len(vals),
    )


@dataclass(frozen=True)
class BenchmarkMetrics:
    """vLLM's serving metrics over one run. Counts and throughputs cover completed requests only."""

    duration_s: float  # wall-clock length of the run the outputs came from
    completed: int  # requests that finished with reason "stop" or "length" (not "abort")
    total_input_tokens: int  # prompt tokens over completed requests
    total_output_tokens: int  # output tokens over completed requests
    request_throughput: float  # completed / duration_s, requests per second
    output_throughput: float  # total_output_tokens / duration_s, tokens per second
    queue: Summary  # queue_s per completed request
    ttft: Summary  # ttft_s per completed request
    tpot: Summary  # tpot_s per completed request with more than one output token
    itl: Summary  # every inter-token gap of every completed request, pooled
    e2e: Summary  # e2e_s per completed request


def is_completed(output: RequestOutput) -> bool:
    """True when a request finished by a stop rule or its length limit rather than being aborted."""
    return bool(output.finished) and output.finish_reason != "abort"


def run_duration(outputs: Sequence[RequestOutput]) -> float:
    """Seconds from the earliest arrival to the latest finish among finished outputs.

    Raises:
        ValueError: no output has finished.
    """
    finished = [o for o in outputs if o.finished and o.finished_time is not None]
    if not finished:
        raise ValueError(f"run_duration needs at least 1 finished output, got 0 of {len(outputs)}")
    return max(o.finished_time for o in finished) - min(o.arrival_time for o in outputs)


def benchmark_metrics(outputs: Sequence[RequestOutput], duration_s: float) -> BenchmarkMetrics:
    """Serving metrics for one run: throughputs over `duration_s` and latency summaries.

    Raises:
        ValueError: `duration_s` is not positive, or a completed output's stamps are impossible.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s={duration_s} must be > 0")
    done = [o for o in outputs if is_completed(o)]
    per_request = [request_metrics(o) for o in done]
    total_in = sum(m.prompt_len for m in per_request)
    total_out = sum(m.output_len for m in per_request)
    return BenchmarkMetrics(
        duration_s=duration_s,
        completed=len(done),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(done) / duration_s,
        output_throughput=total_out / duration_s,
        queue=summarize(m.queue_s for m in per_request if m.queue_s is not None),
        ttft=summarize(m.ttft_s for m in per_request if m.ttft_s is not None),
        tpot=summarize(m.tpot_s for m in per_request if m.tpot_s is not None),
        itl=summarize(gap for m in per_request for gap in m.itl_s),
        e2e=summarize(m.e2e_s for m in per_request if m.e2e_s is not None),
    )
