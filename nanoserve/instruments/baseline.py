"""The outside baseline: one system's run of one workload, the gates it must pass, and a pair of runs.

A speedup is a product of two factors, and only one of them is the scheduler's:

    throughput = batch occupancy  x tokens per slot-second      (what the box did)
    throughput = system occupancy x tokens per request-second   (what the caller got)

batch occupancy = sum(served_s) / wall is the mean number of rows holding a slot; system occupancy =
sum(e2e_s) / wall also counts queued requests, so it reads 4.83 on an offline run at ONE slot: the
gates read batch occupancy. Both identities hold exactly in arithmetic, so in floats they agree to
rounding. `compare` refuses a pair that did different work: a run that said something else prints
a beautiful number either way. The tables and a slot sweep's doublings are in `instruments.sweep`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nanoserve.instruments.record import RunRecord


class RunUnsound(ValueError):
    """A run whose shape is not the shape it claims (serial that overlapped, batched that did not)."""


class UnfairComparison(ValueError):
    """Two runs that did not do the same work, so a ratio of their throughputs means nothing."""


def _mean_of_defined(values: Iterable[float | None]) -> float | None:
    defined = [v for v in values if v is not None]
    return math.fsum(defined) / len(defined) if defined else None


@dataclass(frozen=True)
class SystemRun:
    """One system's run of one workload: its records in workload order and its wall-clock time."""

    system: str  # label, e.g. "hf-generate" or "nanoserve, 4"
    records: tuple[RunRecord, ...]  # one per request, in workload order
    wall_s: float  # seconds from handing over the first request to the last one finishing
    slots: int = 1  # slots the system was configured with (max_num_seqs); 1 for a serial runner

    def __post_init__(self) -> None:
        object.__setattr__(self, "records", tuple(self.records))
        if not self.records:
            raise ValueError(f"run {self.system!r} has 0 records; need at least 1")
        if not self.wall_s > 0:
            raise ValueError(f"run {self.system!r}: wall_s={self.wall_s} must be > 0")
        if self.slots < 1:
            raise ValueError(f"run {self.system!r}: slots={self.slots} must be >= 1")
        for i, r in enumerate(self.records):
            if r.finished_s is None or not r.token_ids or r.prefill_s is None:
                raise ValueError(
                    f"run {self.system!r}: record {i} has finished_s={r.finished_s}, {r.output_len} output "
                    f"tokens and prefill_s={r.prefill_s}; a run holds finished requests with at least 1 token "
                    "and a prefill time each"
                )

    @property
    def num_requests(self) -> int:
        """Requests in the run."""
        return len(self.records)

    @property
    def output_tokens(self) -> int:
        """Output tokens over every request."""
        return sum(r.output_len for r in self.records)

    @property
    def slot_seconds(self) -> float:
        """The sum over requests of the seconds each held a slot."""
        return math.fsum(r.served_s for r in self.records)

    @property
    def request_seconds(self) -> float:
        """The sum over requests of arrival-to-finish (queue included)."""
        return math.fsum(r.e2e_s for r in self.records)

    @property
    def throughput(self) -> float:
        """Output tokens per wall-clock second."""
        return self.output_tokens / self.wall_s

    @property
    def batch_occupancy(self) -> float:
        """Mean rows holding a slot: slot-seconds / wall. The batching factor."""
        return self.slot_seconds / self.wall_s

    @property
    def system_occupancy(self) -> float:
        """Mean requests in the system, queued ones included: request-seconds / wall. Not a batch size."""
        return self.request_seconds / self.wall_s

    @property
    def tokens_per_slot_second(self) -> float:
        """What one row produced per second it held a slot. The per-row (kernel) factor."""
        return self.output_tokens / self.slot_seconds

    @property
    def tokens_per_request_second(self) -> float:
        """What a request got per second it was in the system, queue included."""
        return self.output_tokens / self.request_seconds

    @property
    def queue_share(self) -> float:
        """Fraction of request-seconds spent queued: 1 - batch occupancy / system occupancy."""
        return 1.0 - self.slot_seconds / self.request_seconds

    @property
    def mean_ttft_s(self) -> float:
        """Mean time to first token, queue included."""
        return math.fsum(r.ttft_s for r in self.records) / len(self.records)

    @property
    def mean_tpot_s(self) -> float | None:
        """Mean TPOT over the requests that have one (more than one output token); None if none has."""
        return _mean_of_defined(r.tpot_s for r in self.records)

    @property
    def mean_decode_tok_per_s(self) -> float | None:
        """Mean over requests of one row's decode rate (tokens after the first per second); None if none has."""
        return _mean_of_defined(r.decode_tok_per_s for r in self.records)

    @property
    def mean_prefill_s(self) -> float:
        """Mean prompt-forward time; for a serial run this is its TTFT, for an engine run it excludes the queue."""
        return math.fsum(r.prefill_s for r in self.records) / len(self.records)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where two token streams differ, or None if they are identical.

    A stream that is a strict prefix of the other diverges at the shorter one's length.
    """
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    if len(a) != len(b):
        return min(len(a), len(b))
    return None


@dataclass(frozen=True)
class Comparison:
    """A candidate run against a baseline run of the same workload, and the speedup split into factors.

    speedup = batch_gain x per_slot_gain, and speedup = system_gain x per_request_gain.
    """

    baseline: SystemRun
    candidate: SystemRun

    @property
    def speedup(self) -> float:
        """Candidate throughput / baseline throughput."""
        return self.candidate.throughput / self.baseline.throughput

    @property
    def batch_gain(self) -> float:
        """Ratio of batch occupancies: the scheduler's factor."""
        return self.candidate.batch_occupancy / self.baseline.batch_occupancy

    @property
    def per_slot_gain(self) -> float:
        """Ratio of tokens per slot-second: what one row produces, the kernel's factor."""
        return self.candidate.tokens_per_slot_second / self.baseline.tokens_per_slot_second

    @property
    def system_gain(self) -> float:
        """Ratio of system occupancies."""
        return self.candidate.system_occupancy / self.baseline.system_occupancy

    @property
    def per_request_gain(self) -> float:
        """Ratio of tokens per request-second."""
        return self.candidate.tokens_per_request_second / self.baseline.tokens_per_request_second

    @property
    def prefill_speedup(self) -> float:
        """Baseline mean prefill / candidate mean prefill (> 1: the candidate's prompt forward is faster);
        a serial baseline's TTFT is its prefill, the engine's loaded TTFT is mostly queue."""
        return self.baseline.mean_prefill_s / self.candidate.mean_prefill_s

    def as_row(self) -> dict[str, float | int | str]:
        """One CSV row for the candidate, units in the column names."""
        c = self.candidate
        return {
            "system": c.system,
            "slots": c.slots,
            "requests": c.num_requests,
            "output_tokens": c.output_tokens,
            "wall_s": c.wall_s,
            "throughput_tok_per_s": c.throughput,
            "speedup_x": self.speedup,
            "batch_occupancy": c.batch_occupancy,
            "system_occupancy": c.system_occupancy,
            "tokens_per_slot_s": c.tokens_per_slot_second,
            "tokens_per_request_s": c.tokens_per_request_second,
            "per_slot_gain_x": self.per_slot_gain,
            "queue_share": c.queue_share,
            "mean_ttft_s": c.mean_ttft_s,
            "mean_prefill_s": c.mean_prefill_s,
            "prefill_speedup_x": self.prefill_speedup,
        }


def compare(baseline: SystemRun, candidate: SystemRun) -> Comparison:
    """Pair two runs of the same workload, refusing any pair that did not do identical work.

    Records are matched by position (workload order).

    Raises:
        UnfairComparison: different request counts, or at some request a different prompt length,
            output length, or output token ids (the message says where the streams split).
    """
    b_name, c_name = baseline.system, candidate.system
    if baseline.num_requests != candidate.num_requests:
        raise UnfairComparison(
            f"{b_name!r} ran {baseline.num_requests} requests but {c_name!r} ran {candidate.num_requests}"
        )
    for i, (b, c) in enumerate(zip(baseline.records, candidate.records, strict=True)):
        if b.prompt_len != c.prompt_len:
            raise UnfairComparison(
                f"request {i}: prompt length {b.prompt_len} in {b_name!r} but {c.prompt_len} in {c_name!r}"
            )
        if b.output_len != c.output_len:
            raise UnfairComparison(
                f"request {i}: output length {b.output_len} in {b_name!r} but {c.output_len} in {c_name!r}"
            )
        split = first_divergence(b.token_ids, c.token_ids)
        if split is not None:
            raise UnfairComparison(
                f"request {i}: output tokens split at position {split} "
                f"({b.token_ids[split]} in {b_name!r}, {c.token_ids[split]} in {c_name!r}); "
                "a speedup against a system that said something else is not a speedup"
            )
    return Comparison(baseline=baseline, candidate=candidate)


def _check_within_wall(run: SystemRun) -> None:
    span = max(r.finished_s for r in run.records) - min(r.arrival_s for r in run.records)
    if span > run.wall_s * (1 + 1e-9):
        raise RunUnsound(
            f"run {run.system!r}: records span {span:.6f}s but wall_s is {run.wall_s:.6f}s; "
            "the wall clock must cover every request"
        )


def check_serial(run: SystemRun, tolerance: float = 0.05) -> SystemRun:
    """Refuse a 'serial' run that was not one: requests must not overlap, and batch occupancy ~1.

    Batch occupancy below 1 - tolerance means the wall clock timed mostly something other than
    generation (so throughput is understated); overlap means it was not a one-at-a-time baseline.

    Raises:
        RunUnsound: two records overlap, the records do not fit in the wall clock, or batch
            occupancy is outside [1 - tolerance, 1 + tolerance].
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance={tolerance} must be within [0, 1)")
    ordered = sorted(run.records, key=lambda r: r.arrival_s)
    for prev, nxt in zip(ordered, ordered[1:], strict=False):
        if nxt.arrival_s < prev.finished_s:
            raise RunUnsound(
                f"run {run.system!r}: a request arrived at {nxt.arrival_s:.6f} before the previous one "
                f"finished at {prev.finished_s:.6f}; a serial run has no overlap"
            )
    _check_within_wall(run)
    occ = run.batch_occupancy
    if abs(occ - 1.0) > tolerance:
        raise RunUnsound(
            f"run {run.system!r}: batch occupancy {occ:.4f} is outside 1 +/- {tolerance}; "
            "a serial run holds exactly one slot for its whole wall clock"
        )
    return run


def check_concurrent(run: SystemRun, tolerance: float = 0.05) -> SystemRun:
    """Refuse a batched run whose batch occupancy says it did not batch, or could not have.

    Gates on batch occupancy (slot-seconds / wall), never on system occupancy, which counts queued
    requests and reads well above 1 on an offline run at one slot. With more than one slot and more
    than one request batch occupancy must exceed 1 + tolerance; it never may exceed slots x (1 + tolerance).

    Raises:
        RunUnsound: the records do not fit in the wall clock, batch occupancy is above the slot
            count, or it is not above 1 where batching was possible.
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance={tolerance} must be within [0, 1)")
    _check_within_wall(run)
    occ = run.batch_occupancy
    if occ > run.slots * (1 + tolerance):
        raise RunUnsound(
            f"run {run.system!r}: batch occupancy {occ:.4f} exceeds {run.slots} slots; "
            "a run cannot hold more rows than it has slots"
        )
    if run.slots > 1 and run.num_requests > 1 and occ <= 1 + tolerance:
        raise RunUnsound(
            f"run {run.system!r}: batch occupancy {occ:.4f} <= {1 + tolerance} with {run.slots} slots "
            f"and {run.num_requests} requests; the run fell back to one row at a time"
        )
    return run
