"""The step profile: one engine iteration taken apart, with its two clocks kept apart.

A phase's *host* time is how long Python was inside it; its *device* time is how long the
accelerator spent on the kernels it launched. The difference is overhead: time the device sat
idle because the host had not told it anything yet. `StepProfile` reads a set of recorded steps
(`nanoserve.recorder.StepSample`) that way: per-phase means and totals, hotspots ranked by
overhead, the idle fraction and which clock bounds the step. What a change would buy is priced in
`nanoserve.instruments.profile_pricing`; the gates that refuse a profile that means nothing, and
the tables, are in `nanoserve.instruments.profile_gates`; the recorder that builds one from the
live loop is in `nanoserve.instruments.recording`.

Every time is in seconds. A missing device time counts as zero (all overhead), which is what the
gates exist to refuse; the record itself never refuses a number it can compute.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nanoserve.recorder import Phase, StepSample

FORWARD = "forward"  # the one phase a faster device makes faster; every other phase is the loop
HOST_BOUND = "host"
DEVICE_BOUND = "device"


class ProfileUnsound(ValueError):
    """A profile that renders a clean table and means nothing (the base of every profile gate's error)."""


def _sum_phases(name: str, phases: list[Phase], divisor: int) -> Phase:
    devices = [p.device_s for p in phases if p.device_s is not None]
    return Phase(
        name,
        sum(p.host_s for p in phases) / divisor,
        sum(devices) / divisor if devices else None,
        any(p.syncs for p in phases),
    )


@dataclass(frozen=True)
class StepProfile:
    """A set of steps read together. Per-step quantities are means over `samples`.

    Build it with `StepProfile.from_samples` (or `StepRecorder.profile`), which drops warm-up
    steps and records how many it dropped, so `check_warmed_up` can read it.
    """

    samples: tuple[StepSample, ...]  # the steps described, in recorded order
    warmup: int = 0  # leading steps dropped before these
    decode_only: bool = False  # whether steps with any non-decode row were filtered out

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("a profile needs at least 1 step, got 0")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be >= 0")

    @classmethod
    def from_samples(
        cls, samples: Iterable[StepSample], *, warmup: int = 1, decode_only: bool = False
    ) -> StepProfile:
        """Drops the first `warmup` steps, then (optionally) every step that is not pure decode.

        Warm-up is counted in recorded steps, before the decode filter, because what it removes
        (context creation, allocator growth, autotuning) happens at the start of the run.

        Args:
            samples: the steps, in recorded order.
            warmup: how many leading steps to drop.
            decode_only: keep only steps whose every sampled row was a decode.
        Returns:
            The profile of what is left.
        Raises:
            ValueError: warmup < 0, or no step is left.
        """
        samples = tuple(samples)
        if warmup < 0:
            raise ValueError(f"warmup={warmup} must be >= 0")
        kept = tuple(s for s in samples[warmup:] if s.is_decode or not decode_only)
        if not kept:
            raise ValueError(
                f"no steps left: {len(samples)} recorded, warmup={warmup} dropped, decode_only={decode_only}"
            )
        return cls(kept, warmup=warmup, decode_only=decode_only)

    @property
    def num_steps(self) -> int:
        return len(self.samples)

    @property
    def phase_totals(self) -> dict[str, Phase]:
        """Each phase name -> one Phase summed over every step (first-seen order)."""
        return self._grouped(divisor=1)

    @property
    def phase_means(self) -> dict[str, Phase]:
        """Each phase name -> its mean per step (a step without the phase counts as zero)."""
        return self._grouped(divisor=self.num_steps)

    def _grouped(self, divisor: int) -> dict[str, Phase]:
        groups: dict[str, list[Phase]] = {}
        for sample in self.samples:
            for phase in sample.phases:
                groups.setdefault(phase.name, []).append(phase)
        return {name: _sum_phases(name, phases, divisor) for name, phases in groups.items()}

    def hotspots(self, n: int | None = None) -> list[Phase]:
        """Mean per-step phases ranked by overhead, largest first.

        Ranked by overhead (host - device), not host time: forward is the longest phase in any
        profile and is mostly device work no Python change reaches. The question is not "where
        did the seconds go" but "which of them could go away".

        Args:
            n: keep only the first n (None: all).
        Returns:
            Phases, ties in step order.
        """
        ranked = sorted(self.phase_means.values(), key=lambda p: -p.overhead_s)
        return ranked if n is None else ranked[:n]

    @property
    def step_s(self) -> float:
        """Mean measured step, begin_step to end_step."""
        return sum(s.host_s for s in self.samples) / self.num_steps

    @property
    def accounted_s(self) -> float:
        """Mean host seconds per step that the phases cover."""
        return sum(s.accounted_s for s in self.samples) / self.num_steps

    @property
    def device_s(self) -> float:
        """Mean device seconds per step (0.0 where nothing was device-timed)."""
        return sum(p.device_s or 0.0 for p in self.phase_means.values())

    @property
    def overhead_s(self) -> float:
        """Mean host-minus-device seconds per step, over the phases."""
        return self.accounted_s - self.device_s

    @property
    def is_device_timed(self) -> bool:
        """Some phase carries a device time above zero."""
        return self.device_s > 0.0

    @property
    def sync_points(self) -> int:
        """How many phases read a device value back."""
        return sum(p.syncs for p in self.phase_totals.values())

    @property
    def mean_rows(self) -> float:
        """Mean rows sampled (tokens produced) per step."""
        return sum(s.num_rows for s in self.samples) / self.num_steps

    @property
    def num_draft_tokens(self) -> int:
        """Speculative drafts verified over the profile's steps (each one of their sampled rows)."""
        return sum(s.num_draft_tokens for s in self.samples)

    @property
    def num_accepted_tokens(self) -> int:
        """Of those drafts, how many were kept."""
        return sum(s.num_accepted_tokens for s in self.samples)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted; None when no step verified a draft."""
        drafted = self.num_draft_tokens
        return self.num_accepted_tokens / drafted if drafted else None

    @property
    def mean_tokens(self) -> float:
        """Mean tokens produced per step: rows sampled less the rejected drafts' rows (a stop
        inside a request's drafts leaves a few more rows unused, which this does not see)."""
        rejected = self.num_draft_tokens - self.num_accepted_tokens
        return (sum(s.num_rows for s in self.samples) - rejected) / self.num_steps

    @property
    def idle_fraction(self) -> float:
        """Share of the phases' host time with the device idle: overhead / host (f in Amdahl)."""
        host = self.accounted_s
        return self.overhead_s / host if host > 0.0 else 0.0

    @property
    def bound(self) -> str:
        """Which term of the serial step is larger: "device" (ties too) or "host"."""
        return DEVICE_BOUND if self.device_s >= self.overhead_s else HOST_BOUND

    @property
    def overhead_per_token_s(self) -> float:
        """Overhead per token produced (rows sampled): the number batching divides by B.

        Raises:
            ValueError: the profile sampled no rows.
        """
        rows = sum(s.num_rows for s in self.samples)
        if rows == 0:
            raise ValueError(f"profile of {self.num_steps} steps sampled 0 rows; per-token is undefined")
        return self.overhead_s * self.num_steps / rows
