"""The step profiler: one engine iteration taken apart, with its two clocks kept apart.

A phase's *host* time is how long Python was inside it; its *device* time is how long the
accelerator spent on the kernels it launched. The difference is overhead: time the device sat
idle because the host had not told it anything yet. Everything here follows from keeping those
two numbers separate:

- the arithmetic (`amdahl`, `step_time_under`, `speedup_if`, `loop_overhead_s`,
  `step_with_compute`, `project_point`) prices an optimisation before anyone does it;
- `recommended_model` reads `Phase.syncs` to decide whether overhead overlaps the device
  (nothing reads back: step = max(overhead, device)) or adds to it (something reads back:
  step = overhead + device), and `check_model_applies` refuses the flattering choice;
- four gates refuse profiles that render a clean table and mean nothing: one that still holds
  its first step, one whose phases do not add up to its steps, one whose host timings were
  taken around async launches, and one with no device clock at all (any CPU run);
- `StepRecorder` collects `StepSample`s from the live loop; `NULL_RECORDER` is the free
  stand-in the engine carries when nobody is profiling.

Every time is in seconds. Arithmetic treats a missing device time as zero (all overhead), which
is what the gates exist to refuse; the arithmetic itself never refuses a number it can compute.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from nanoserve.recorder import Phase, StepSample

FORWARD = "forward"  # the one phase a faster device makes faster; every other phase is the loop
SERIAL = "serial"  # something reads a device value back: step = overhead + device
OVERLAPPED = "overlapped"  # nothing reads back, the host runs ahead: step = max(overhead, device)
MODELS = (SERIAL, OVERLAPPED)
HOST_BOUND = "host"
DEVICE_BOUND = "device"
_EVENT_RESOLUTION_S = 2e-6  # CUDA event timestamps are ~0.5us apart; slack below this is noise


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


# ----------------------------------------------------------------------------- arithmetic


def amdahl(fraction: float, factor: float) -> float:
    """Amdahl's law: the speedup from making `fraction` of the time `factor` times faster.

    Args:
        fraction: share of the time affected, in [0, 1].
        factor: how many times faster it gets, > 0 (math.inf: removed entirely).
    Returns:
        1 / ((1 - fraction) + fraction / factor); math.inf when that denominator is 0.
    Raises:
        ValueError: fraction outside [0, 1] or factor <= 0.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction={fraction} must be in [0, 1]")
    if not factor > 0.0:
        raise ValueError(f"factor={factor} must be > 0")
    remaining = (1.0 - fraction) + fraction / factor
    return math.inf if remaining == 0.0 else 1.0 / remaining


def step_time_under(overhead_s: float, device_s: float, model: str = SERIAL) -> float:
    """One step's time under an overlap model.

    Args:
        overhead_s: host seconds not covered by device work.
        device_s: device seconds.
        model: "serial" (a readback makes the host wait: overhead + device) or "overlapped"
            (async launches let host work hide under the kernels: max(overhead, device)).
    Returns:
        Seconds.
    Raises:
        ValueError: a negative time or an unknown model.
    """
    if overhead_s < 0.0 or device_s < 0.0:
        raise ValueError(f"overhead_s={overhead_s} and device_s={device_s} must be >= 0")
    if model == SERIAL:
        return overhead_s + device_s
    if model == OVERLAPPED:
        return max(overhead_s, device_s)
    raise ValueError(f"model={model!r} is not one of {MODELS}")


def recommended_model(profile: StepProfile | Iterable[Phase]) -> str:
    """Serial if any phase syncs, else overlapped: a fact about the code, not a choice.

    Args:
        profile: a StepProfile or the phases of one step.
    Returns:
        "serial" or "overlapped".
    """
    phases = profile.phase_totals.values() if isinstance(profile, StepProfile) else profile
    return SERIAL if any(p.syncs for p in phases) else OVERLAPPED


def _resolve_model(profile: StepProfile, model: str | None) -> str:
    if model is None:
        return recommended_model(profile)
    check_model_applies(profile, model)
    return model


def speedup_if(
    profile: StepProfile,
    *,
    eliminate: Iterable[str] = (),
    overhead_factor: float = 1.0,
    phases: Iterable[str] | None = None,
    model: str | None = None,
) -> float:
    """Prices an optimisation before doing it: old step / new step.

    A host-side change removes overhead, never arithmetic, so the named phases lose overhead
    and keep their device time. With every overhead divided by k under the serial model this is
    amdahl(profile.idle_fraction, k) by a second route.

    Args:
        profile: the measured steps.
        eliminate: phases whose overhead goes away entirely.
        overhead_factor: the remaining overhead of `phases` is divided by this (> 0; math.inf
            removes it all).
        phases: which phases overhead_factor applies to (None: every phase not eliminated).
        model: overlap model; None reads it from the profile, an explicit one must apply.
    Returns:
        The speedup (math.inf when the new step would take no time).
    Raises:
        ValueError: an unknown phase name or a bad factor.
        ModelMismatch: `model` contradicts the profile's sync flags.
    """
    if not overhead_factor > 0.0:
        raise ValueError(f"overhead_factor={overhead_factor} must be > 0")
    means = profile.phase_means
    eliminate = set(eliminate)
    shrink = set(means) if phases is None else set(phases)
    unknown = (eliminate | shrink) - set(means)
    if unknown:
        raise ValueError(f"unknown phases {sorted(unknown)}; the profile has {list(means)}")
    model = _resolve_model(profile, model)
    new_overhead = 0.0
    for name, phase in means.items():
        if name in eliminate:
            continue
        new_overhead += phase.overhead_s / overhead_factor if name in shrink else phase.overhead_s
    old = step_time_under(profile.overhead_s, profile.device_s, model)
    new = step_time_under(new_overhead, profile.device_s, model)
    return math.inf if new == 0.0 else old / new


def loop_overhead_s(profile: StepProfile, *, per_token: bool = False) -> float:
    """Mean host seconds per step of every phase but forward, told apart by name, not clock.

    This survives having no accelerator: schedule, sync_rows, build_inputs, sample and collect
    are the same host work whatever the forward runs on, so a CPU measures it honestly.

    Args:
        profile: the measured steps.
        per_token: divide by mean rows sampled per step (the number comparable across batches).
    Returns:
        Seconds per step, or per token.
    Raises:
        ValueError: per_token on a profile that sampled no rows.
    """
    loop = sum(p.host_s for name, p in profile.phase_means.items() if name != FORWARD)
    if not per_token:
        return loop
    if profile.mean_rows == 0.0:
        raise ValueError("profile sampled 0 rows; loop per token is undefined")
    return loop / profile.mean_rows


def step_with_compute(profile: StepProfile, forward_s: float, *, model: str | None = None) -> float:
    """Projects the step with a different forward under this measured loop (a projection).

    Only legitimate down one column: a forward_s stands for one batch size, so project each
    profile with the forward of its own batch, and compare loop per token across batches.

    Args:
        profile: the measured steps (their loop is kept).
        forward_s: the forward to substitute, e.g. a GPU-sized one.
        model: overlap model; None reads it from the profile.
    Returns:
        Projected seconds per step.
    Raises:
        ValueError: forward_s < 0.
        ModelMismatch: `model` contradicts the profile's sync flags.
    """
    if forward_s < 0.0:
        raise ValueError(f"forward_s={forward_s} must be >= 0")
    return step_time_under(loop_overhead_s(profile), forward_s, _resolve_model(profile, model))


def project_point(profile: StepProfile, slots: int, *, forward_s: float | None = None) -> tuple[float, float]:
    """The profile as one point on the latency-versus-throughput curve.

    Args:
        profile: steps taken with `slots` rows in the batch.
        slots: the batch size the point stands for; must be the profile's largest row count,
            because a profile at one batch cannot stand for another.
        forward_s: None uses the measured step; otherwise `step_with_compute(profile, forward_s)`.
    Returns:
        (throughput in tokens/s, step latency in s): tokens are rows sampled.
    Raises:
        ValueError: slots < 1 or not the profile's batch.
    """
    if slots < 1:
        raise ValueError(f"slots={slots} must be >= 1")
    rows = max(s.num_rows for s in profile.samples)
    if rows != slots:
        raise ValueError(f"profile was taken at {rows} rows per step and cannot stand for slots={slots}")
    step = profile.step_s if forward_s is None else step_with_compute(profile, forward_s)
    if step <= 0.0:
        raise ValueError(f"step latency {step} s must be > 0 to give a throughput")
    return profile.mean_rows / step, step


# ----------------------------------------------------------------------------- gates


# ----------------------------------------------------------------------------- the gate the arithmetic itself applies


class ProfileUnsound(ValueError):
    """A profile that renders a clean table and means nothing."""


class ModelMismatch(ProfileUnsound):
    """An overlap model the code does not follow."""


def check_model_applies(profile: StepProfile, model: str) -> None:
    """Refuses an overlap model the code does not follow.

    Args:
        profile: the profile whose Phase.syncs flags decide.
        model: the model someone wants to price with.
    Raises:
        ModelMismatch: model is not recommended_model(profile).
        ValueError: model is not one of MODELS.
    """
    if model not in MODELS:
        raise ValueError(f"model={model!r} is not one of {MODELS}")
    expected = recommended_model(profile)
    if model != expected:
        syncing = [name for name, p in profile.phase_totals.items() if p.syncs]
        raise ModelMismatch(
            f"model={model!r} but the profile calls for {expected!r} (syncing phases: {syncing})"
        )
