"""Arithmetic over one system's run: per-request decode rates, the head of a run, and where each
request's token ids first left a reference's."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from nanoserve.instruments.baseline import SystemRun, first_divergence


@dataclass(frozen=True)
class DivergenceReport:
    """Where each request's tokens first left the reference's; None where they never did."""

    splits: tuple[int | None, ...]  # per request, in workload order: first differing position

    @property
    def num_requests(self) -> int:
        """Requests compared."""
        return len(self.splits)

    @property
    def identical(self) -> int:
        """Requests whose token ids equal the reference's exactly."""
        return sum(1 for s in self.splits if s is None)

    @property
    def earliest(self) -> int | None:
        """The smallest split position over all requests, or None when every request is identical."""
        positions = [s for s in self.splits if s is not None]
        return min(positions) if positions else None

    def summary(self, limit: int = 6) -> str:
        """'8/8 identical', or '5/8 identical; split r1@17 r4@3 r6@30' listing at most `limit`."""
        head = f"{self.identical}/{self.num_requests} identical"
        split = [f"r{i}@{s}" for i, s in enumerate(self.splits) if s is not None]
        if not split:
            return head
        more = f" +{len(split) - limit} more" if len(split) > limit else ""
        return f"{head}; split {' '.join(split[:limit])}{more}"


def divergence_report(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> DivergenceReport:
    """Compare two systems' token ids request by request (`baseline.first_divergence` on each pair).

    Raises:
        ValueError: the two hold different numbers of requests.
    """
    if len(reference) != len(candidate):
        raise ValueError(f"reference has {len(reference)} requests but candidate has {len(candidate)}; need equal")
    return DivergenceReport(tuple(first_divergence(a, b) for a, b in zip(reference, candidate, strict=True)))


def mean_tpot_s(run: SystemRun) -> float | None:
    """Mean over requests with > 1 token of (finish - first token) / (tokens - 1); None if none has."""
    vals = [(r.finished_s - r.first_token_s) / (r.output_len - 1) for r in run.records if r.output_len > 1]
    return math.fsum(vals) / len(vals) if vals else None


def decode_tok_per_s(run: SystemRun) -> float | None:
    """Mean over requests with > 1 token of (tokens - 1) / (finish - first token): one row's decode rate."""
    vals = [
        (r.output_len - 1) / (r.finished_s - r.first_token_s)
        for r in run.records
        if r.output_len > 1 and r.finished_s > r.first_token_s
    ]
    return math.fsum(vals) / len(vals) if vals else None


def head_of_run(run: SystemRun, k: int) -> SystemRun:
    """The first k requests of a run, with the wall clock from its first arrival to their last finish.

    For a one-slot FIFO run this is exactly how long the engine took to serve those k requests,
    which makes it comparable to a serial peer that ran only them.
    """
    if not 1 <= k <= run.num_requests:
        raise ValueError(f"k={k} must be within [1, {run.num_requests}]")
    head = run.records[:k]
    start = min(r.arrival_s for r in run.records)
    return SystemRun(system=run.system, records=head, wall_s=max(r.finished_s for r in head) - start, slots=run.slots)


def first_records(run: SystemRun, k: int) -> SystemRun:
    """The first k records of a run, for comparing token ids with a run that did only those (wall kept)."""
    return SystemRun(system=run.system, records=run.records[:k], wall_s=run.wall_s, slots=run.slots)

