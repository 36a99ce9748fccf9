"""A slot sweep read as tables: each candidate against the baseline, its speedup split into factors
(`render`), and what each doubling of the slots was worth (`marginal_doublings`, `render_doublings`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nanoserve.instruments.baseline import Comparison, SystemRun, compare


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
    """The seed's comparison table: the baseline row, then one row per candidate, each speedup split into factors.

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
