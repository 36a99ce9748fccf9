"""The outside baseline: one system's run of one workload, a pair of them, and what a speedup is made of.

A speedup is a product of two factors, and only one of them is the scheduler's:

    throughput = batch occupancy  x tokens per slot-second      (what the box did)
    throughput = system occupancy x tokens per request-second   (what the caller got)

batch occupancy = sum(served_s) / wall is the mean number of rows actually holding a slot;
system occupancy = sum(e2e_s) / wall also counts requests sitting on the queue doing nothing, so it
reads 4.83 on an offline run at ONE slot. The first version of this module gated on it, and that
gate would have waved through a run with no batching in it. `check_concurrent` reads batch
occupancy. Both identities hold exactly in arithmetic (each side is tokens / wall with one factor
cancelled), so in floats they agree to rounding; the tests check them bit-exact on records placed
by hand on a ruler and to 1e-12 on a real engine run.

`compare` refuses a pair that disagree on request count, prompt lengths, output lengths or output
tokens: a run that said something else completes and prints a beautiful number either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

# a one-at-a-time generator: (prompt ids, max new tokens) -> (output ids, first-token perf_counter stamp, ...)
GenerateOne = Callable[[list[int], int], tuple[Any, ...]]


class RunUnsound(ValueError):
    """A run whose shape is not the shape it claims (serial that overlapped, batched that did not)."""


class UnfairComparison(ValueError):
    """Two runs that did not do the same work, so a ratio of their throughputs means nothing."""


@dataclass(frozen=True)
class RunRecord:
    """One request of one run, placed on the perf_counter clock."""

    prompt_len: int  # prompt tokens
    token_ids: tuple[int, ...]  # output token ids, in order
    arrival_s: float  # perf_counter stamp when the request was handed to the system
    first_token_s: float  # perf_counter stamp when the first output token existed
    finished_s: float  # perf_counter stamp when the last output token existed
    served_s: float  # seconds the request held a slot (engine: running_s; serial: the whole call)
    prefill_s: float  # seconds of the prompt forward (engine: first_token - first_scheduled; serial: ttft)

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len={self.prompt_len} must be >= 1")
        if not self.token_ids:
            raise ValueError("a record needs at least 1 output token, got 0")
        if not self.arrival_s <= self.first_token_s <= self.finished_s:
            raise ValueError(
                f"stamps out of order: arrival {self.arrival_s} <= first token {self.first_token_s} "
                f"<= finished {self.finished_s} must hold"
            )
        if not 0 < self.served_s <= self.e2e_s * (1 + 1e-9):
            raise ValueError(f"served_s={self.served_s} must be > 0 and <= e2e_s={self.e2e_s}")
        if not 0 <= self.prefill_s <= self.ttft_s * (1 + 1e-9):
            raise ValueError(f"prefill_s={self.prefill_s} must be >= 0 and <= ttft_s={self.ttft_s}")

    @property
    def output_len(self) -> int:
        """Output tokens."""
        return len(self.token_ids)

    @property
    def ttft_s(self) -> float:
        """Seconds from arrival to the first token, queue included."""
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        """Seconds from arrival to finish: how long the request was in the system."""
        return self.finished_s - self.arrival_s

    @property
    def queued_s(self) -> float:
        """Seconds in the system without a slot (e2e - served)."""
        return self.e2e_s - self.served_s


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
        """Baseline mean prefill / candidate mean prefill (> 1: the candidate's prompt forward is faster).

        A serial baseline's TTFT is its prefill, so this puts it next to the engine's prefill rather
        than the engine's loaded TTFT, which is mostly queue.
        """
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
    requests and reads well above 1 on an offline run at one slot.

    With more than one slot and more than one request the batch occupancy must exceed
    1 + tolerance; at any slot count it must not exceed slots x (1 + tolerance).

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


@dataclass(frozen=True)
class Doubling:
    """What one doubling of the slots was worth: throughput_ratio = batch_ratio x per_slot_ratio."""

    from_slots: int  # slots before
    to_slots: int  # slots after (2 x from_slots)
    batch_ratio: float  # batch occupancy after / before (2.0 when every slot stayed full)
    per_slot_ratio: float  # tokens per slot-second after / before (how far each row slowed)
    throughput_ratio: float  # throughput after / before

    @property
    def verdict(self) -> str:
        """'worth it' when the doubling raised throughput, else 'not worth it'."""
        return "worth it" if self.throughput_ratio > 1.0 else "not worth it"


def marginal_doublings(runs: Sequence[SystemRun]) -> list[Doubling]:
    """The return on each doubling of a slot sweep; the knee is where throughput_ratio crosses 1.

    Each neighbouring pair is checked with `compare`, so the ratios are between runs that did
    identical work. The baseline of the sweep cancels out of every ratio, which is why these
    reproduce when the headline speedup does not.

    Raises:
        ValueError: fewer than 2 runs, or the slots (in the given order) do not double each time.
        UnfairComparison: two neighbouring runs did different work.
    """
    if len(runs) < 2:
        raise ValueError(f"marginal_doublings needs at least 2 runs, got {len(runs)}")
    doublings = []
    for before, after in zip(runs, runs[1:], strict=False):
        if after.slots != 2 * before.slots:
            raise ValueError(f"slots go {before.slots} -> {after.slots}; each step must double")
        pair = compare(before, after)
        doublings.append(
            Doubling(
                from_slots=before.slots,
                to_slots=after.slots,
                batch_ratio=pair.batch_gain,
                per_slot_ratio=pair.per_slot_gain,
                throughput_ratio=pair.speedup,
            )
        )
    return doublings


def render(comparisons: Sequence[Comparison]) -> str:
    """The day-44 table: the baseline row, then one row per candidate, each speedup split into factors.

    Raises:
        ValueError: no comparisons, or comparisons against different baselines.
    """
    if not comparisons:
        raise ValueError("render needs at least 1 comparison, got 0")
    base = comparisons[0].baseline
    if any(c.baseline is not base for c in comparisons):
        raise ValueError("every comparison in one table must share the same baseline run")
    header = (
        f"{'system':<18}{'tok/s':>9}{'speedup':>10}{'batch':>8}"
        f"{'per slot-second':>18}{'queue share':>14}{'prefill':>10}"
    )
    lines = [header]

    def row(run: SystemRun, speedup: float, per_slot: float, prefill: float) -> str:
        return (
            f"{run.system:<18}{run.throughput:>9.2f}{speedup:>9.2f}x{run.batch_occupancy:>8.2f}"
            f"{per_slot:>17.2f}x{run.queue_share * 100:>13.0f}%{prefill:>9.2f}x"
        )

    lines.append(row(base, 1.0, 1.0, 1.0))
    for c in comparisons:
        lines.append(row(c.candidate, c.speedup, c.per_slot_gain, c.prefill_speedup))
    return "\n".join(lines)


def render_doublings(doublings: Sequence[Doubling]) -> str:
    """The marginal table: per doubling, how far per-slot-second fell, the throughput ratio, a verdict."""
    lines = [f"{'slots':<10}{'per slot-second x':>19}{'throughput x':>14}   verdict"]
    for d in doublings:
        lines.append(
            f"{f'-> {d.to_slots}':<10}{d.per_slot_ratio:>19.2f}{d.throughput_ratio:>14.2f}   {d.verdict}"
        )
    return "\n".join(lines)

