"""Workloads, arrival schedules, one-process driving, and the offered-load check.

A benchmark is only as honest as the load it offered. `offline_workload` hands every request over
before the first step (the throughput question); `poisson_arrivals` spaces them out at a mean rate
(the latency-under-load question, vLLM's `--request-rate`); `ragged_workload` draws lengths the way
nano-vllm's bench does so rows finish at different steps. `drive` feeds any of them to an engine
from one process, and `check_offered_load` refuses a run in which the engine never actually held
more than one request at a time although more than one was waiting: that run completes, prints a
throughput, and measures nothing about batching.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoserve.instruments.metrics import BenchmarkMetrics, benchmark_metrics, run_duration

if TYPE_CHECKING:
    from nanoserve.engine import Engine
    from nanoserve.request import RequestOutput


@dataclass(frozen=True)
class Workload:
    """The requests of one benchmark: prompts as token ids and how many tokens each must produce."""

    prompts: list[list[int]]  # [num_requests][prompt_len_i] token ids
    output_lens: list[int]  # [num_requests] tokens to generate (max_tokens with ignore_eos=True)

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.output_lens):
            raise ValueError(
                f"{len(self.prompts)} prompts but {len(self.output_lens)} output lengths; "
                "need one output length per prompt"
            )
        for i, prompt in enumerate(self.prompts):
            if len(prompt) < 1:
                raise ValueError(f"prompt {i} has 0 tokens; every prompt needs at least 1")
        for i, n in enumerate(self.output_lens):
            if n < 1:
                raise ValueError(f"output_lens[{i}]={n} must be >= 1")

    @property
    def num_requests(self) -> int:
        """How many requests the workload holds."""
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens over all requests."""
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens the workload asks for over all requests."""
        return sum(self.output_lens)


def _random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(length)]


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")


def offline_workload(
    num_requests: int, prompt_len: int, output_len: int, vocab_size: int, seed: int = 0
) -> Workload:
    """`num_requests` requests of equal prompt and output length, random token ids from a fixed seed.

    Random ids rather than one repeated prompt, so a prefix cache cannot turn the run into a cache
    benchmark. Offline means all of them are offered at once: drive it with `arrivals=None`.
    """
    for name, value in (
        ("num_requests", num_requests),
        ("prompt_len", prompt_len),
        ("output_len", output_len),
        ("vocab_size", vocab_size),
    ):
        _check_positive(name, value)
    rng = random.Random(seed)
    prompts = [_random_prompt(rng, prompt_len, vocab_size) for _ in range(num_requests)]
    return Workload(prompts=prompts, output_lens=[output_len] * num_requests)


def _check_range(name: str, bounds: tuple[int, int]) -> None:
    lo, hi = bounds
    if lo < 1 or hi < lo:
        raise ValueError(f"{name}={bounds} must satisfy 1 <= low <= high")


def ragged_workload(
    n: int,
    prompt_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> Workload:
    """nano-vllm's bench workload: lengths uniform over inclusive ranges, ids uniform, seeded.

    Ragged lengths are what make rows finish at different steps, which is where a scheduler either
    refills the freed slot or leaves it idle.
    """
    _check_positive("n", n)
    _check_positive("vocab_size", vocab_size)
    _check_range("prompt_len_range", prompt_len_range)
    _check_range("output_len_range", output_len_range)
    rng = random.Random(seed)
    prompts = [_random_prompt(rng, rng.randint(*prompt_len_range), vocab_size) for _ in range(n)]
    output_lens = [rng.randint(*output_len_range) for _ in range(n)]
    return Workload(prompts=prompts, output_lens=output_lens)


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds for `n` requests of a Poisson process with mean `rate` req/s.

    As vLLM's benchmark does it: the first request arrives at 0.0 and each gap after it is an
    exponential draw with mean 1 / rate. `rate=math.inf` is the offline case, every offset 0.0.

    Raises:
        ValueError: `n` < 1 or `rate` is not > 0.
    """
    _check_positive("n", n)
    if not rate > 0:
        raise ValueError(f"rate={rate} must be > 0 requests per second (math.inf for all at once)")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    offsets = [0.0]
    for _ in range(n - 1):
        offsets.append(offsets[-1] + rng.expovariate(rate))
    return offsets


def drive(
    engine: Engine, workload: Workload, arrivals: Sequence[float] | None = None
) -> list[RequestOutput]:
    """Run `workload` through `engine` from one process and return the final outputs in workload order.

    Each request is added once its arrival offset has passed, greedy, with `ignore_eos=True` and
    `max_tokens` equal to its output length, so every system produces the same number of tokens.
    A request's `arrival_time` is its scheduled arrival (start + offset), not the moment this loop
    got round to adding it: a single process cannot accept a request while a step is running, and
    that wait is a cost of the engine, so it must land in the request's queue time.

    Raises:
        ValueError: `arrivals` has the wrong length, is negative or not sorted, or the engine still
            has unfinished requests when called.
    """
    from nanoserve.params import SamplingParams  # engine-side import kept off module load

    n = workload.num_requests
    offsets = [0.0] * n if arrivals is None else [float(a) for a in arrivals]
    if len(offsets) != n:
        raise ValueError(f"{len(offsets)} arrival offsets for {n} requests; need exactly one each")
    if offsets and offsets[0] < 0:
        raise ValueError(f"arrival offset {offsets[0]} must be >= 0")
    for i in range(1, n):
        if offsets[i] < offsets[i - 1]:
            raise ValueError(f"arrivals[{i}]={offsets[i]} < arrivals[{i - 1}]={offsets[i - 1]}; must be sorted")
    if engine.has_unfinished():
        raise ValueError("engine has unfinished requests; drive needs an idle engine")

    start = time.perf_counter()
    rid_to_index: dict[str, int] = {}
    final: dict[str, RequestOutput] = {}
    next_i = 0
    while next_i < n or engine.has_unfinished():
        now = time.perf_counter()
        while next_i < n and start + offsets[next_i] <= now:
            params = SamplingParams(temperature=0.0, max_tokens=workload.output_lens[next_i], ignore_eos=True)
            rid = engine.add_request(
                list(workload.prompts[next_i]), params, arrival_time=start + offsets[next_i]
            )
            rid_to_index[rid] = next_i
            next_i += 1
        if engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        elif next_i < n:
            time.sleep(max(0.0, start + offsets[next_i] - time.perf_counter()))
    by_index: list[RequestOutput | None] = [None] * n
    for rid, out in final.items():
        by_index[rid_to_index[rid]] = out
    missing = [i for i, out in enumerate(by_index) if out is None]
    if missing:
        raise RuntimeError(f"engine went idle without a finished output for requests {missing}")
    return by_index  # type: ignore[return-value]  # no None left, checked above


class OfferedLoadError(ValueError):
    """The run did not have the concurrency its offered load implies, so it measures nothing about it."""


@dataclass(frozen=True)
class Concurrency:
    """Peak concurrency seen in a run, read from the engine's stamps."""

    max_in_system: int  # most requests between arrival and finish at one instant (offered)
    max_running: int  # most requests between first_scheduled and finish at one instant (served)


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    # Half-open [start, end): at equal stamps an end is processed before a start, so a request that
    # is scheduled in the step after another finished does not count as overlapping it.
    events = [(end, 0) for _, end in intervals] + [(start, 1) for start, _ in intervals]
    events.sort()
    current = peak = 0
    for _, is_start in events:
        current += 1 if is_start else -1
        peak = max(peak, current)
    return peak


def concurrency(outputs: Sequence[RequestOutput]) -> Concurrency:
    """Peak offered and served concurrency of a run, from arrival/first_scheduled/finished stamps.

    `max_running` treats a request as running from its first scheduling to its finish, so a request
    preempted in between still counts; that can only overstate concurrency, never invent a drop.

    Raises:
        ValueError: an output has not finished or was never scheduled.
    """
    offered: list[tuple[float, float]] = []
    running: list[tuple[float, float]] = []
    for out in outputs:
        if not out.finished or out.finished_time is None or out.first_scheduled_time is None:
            raise ValueError(
                f"request {out.request_id} is unfinished or unscheduled; concurrency needs finished runs"
            )
        offered.append((out.arrival_time, out.finished_time))
        running.append((out.first_scheduled_time, out.finished_time))
    return Concurrency(max_in_system=_max_overlap(offered), max_running=_max_overlap(running))


def check_offered_load(outputs: Sequence[RequestOutput], min_running: int | None = None) -> Concurrency:
    """Refuse a run that quietly fell back to one request at a time; return its concurrency.

    With more than one request in the system at some instant, the engine must have run more than
    one at some instant. `min_running` asks for more: the peak running count must reach
    `min(min_running, max_in_system)` (pass the slot count to demand that every slot was used).

    Raises:
        OfferedLoadError: the peak running count is below what the offered load allowed.
        ValueError: `min_running` < 1, or an output is unfinished.
    """
    if min_running is not None and min_running < 1:
        raise ValueError(f"min_running={min_running} must be >= 1")
    seen = concurrency(outputs)
    required = 2 if min_running is None else min_running
    required = min(required, seen.max_in_system)
    if seen.max_running < required:
        raise OfferedLoadError(
            f"max running requests {seen.max_running} < required {required} while "
            f"{seen.max_in_system} were in the system at once: the run did not batch the load it was offered"
        )
    return seen


def rate_sweep(
    make_engine: Callable[[], Engine],
    workload: Workload,
    rates: Sequence[float],
    seed: int = 0,
) -> list[BenchmarkMetrics]:
    """Drive `workload` once per request rate, each on a fresh engine, and return their metrics.

    A fresh engine per rate keeps any prefix cache of one run from speeding up the next. The same
    `seed` is used at every rate so the arrival gaps differ only by scale.
    """
    results = []
    for rate in rates:
        arrivals = poisson_arrivals(workload.num_requests, rate, seed)
        outputs = drive(make_engine(), workload, arrivals)
        results.append(benchmark_metrics(outputs, run_duration(outputs)))
    return results
