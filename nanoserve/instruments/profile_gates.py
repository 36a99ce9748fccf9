"""The step profile's gates, each refusing a profile that renders a clean table and means nothing,
and its text tables.

Four gates: one for a profile that still holds its first step, one whose phases do not add up to
its steps, one whose host timings were taken around async launches, and one with no device clock
at all (any CPU run). The fifth, `check_model_applies`, guards the arithmetic and lives with it in
`nanoserve.instruments.profile_pricing`.
"""

from __future__ import annotations

from collections.abc import Mapping

from nanoserve.instruments.profile import FORWARD, ProfileUnsound, StepProfile
from nanoserve.instruments.profile_pricing import loop_overhead_s, recommended_model

_EVENT_RESOLUTION_S = 2e-6  # CUDA event timestamps are ~0.5us apart; device-over-host slack below this is noise

# ----------------------------------------------------------------------------- gates


class NotWarmedUp(ProfileUnsound):
    """Still holds the first steps: context creation, allocator growth, autotuning."""


class Unaccounted(ProfileUnsound):
    """Phases do not add up to the steps: it ranks where timers were put."""


class Unattributable(ProfileUnsound):
    """Host time taken around async launches: compute billed to whatever synchronises next."""


class NotDeviceTimed(ProfileUnsound):
    """No device clock: every second reads as overhead and every ceiling as infinite."""


def check_warmed_up(profile: StepProfile, min_warmup: int = 1) -> None:
    """Refuses a profile that still contains the run's first steps.

    Args:
        profile: the profile to check.
        min_warmup: how many leading steps must have been dropped.
    Raises:
        NotWarmedUp: profile.warmup < min_warmup.
        ValueError: min_warmup < 0.
    """
    if min_warmup < 0:
        raise ValueError(f"min_warmup={min_warmup} must be >= 0")
    if profile.warmup < min_warmup:
        raise NotWarmedUp(
            f"profile dropped warmup={profile.warmup} steps, below the minimum {min_warmup}: "
            "its first steps measure start-up, not the loop"
        )


def check_accounted(profile: StepProfile, tolerance: float = 0.02) -> None:
    """Refuses a profile whose phases do not add up to its steps.

    The gap is mostly the recorder's own cost; more than the step means timers overlap.

    Args:
        profile: the profile to check.
        tolerance: largest allowed |phase time / step time - 1|, summed over the steps.
    Raises:
        Unaccounted: the phases cover too little or too much of the steps.
    """
    total = sum(s.host_s for s in profile.samples)
    covered = sum(s.accounted_s for s in profile.samples)
    if total <= 0.0:
        raise Unaccounted(f"steps total {total} s; nothing to account for")
    share = covered / total
    if abs(share - 1.0) > tolerance:
        raise Unaccounted(
            f"phases cover {share:.2%} of the steps ({covered:.6g} s of {total:.6g} s), "
            f"outside 100% +/- {tolerance:.2%}"
        )


def check_attributable(profile: StepProfile, tolerance: float = 0.05) -> None:
    """Refuses a profile in which a phase's device time exceeds its host time.

    Such a phase had its host clock read around a launch rather than around the work, so its
    cost lands on whichever phase synchronises next (a 0.1ms forward and a 30ms argmax).

    Args:
        profile: the profile to check.
        tolerance: relative slack on device over host (event clocks are not the host clock).
    Raises:
        Unattributable: naming the first offending step and phase.
    """
    for index, sample in enumerate(profile.samples):
        for phase in sample.phases:
            if phase.device_s is None:
                continue
            if phase.device_s - phase.host_s > max(tolerance * phase.host_s, _EVENT_RESOLUTION_S):
                raise Unattributable(
                    f"step {index} phase {phase.name!r}: device {phase.device_s:.6g} s exceeds host "
                    f"{phase.host_s:.6g} s by more than {tolerance:.0%}; time the host after a sync"
                )


def check_device_timed(profile: StepProfile) -> None:
    """Refuses to price an optimisation from a profile with no device clock (any CPU run).

    Without a second clock idle_fraction is 1.0 and every ceiling is infinite: not a ceiling
    but a missing measurement wearing one. Price only loop_overhead_s from such a profile.

    Raises:
        NotDeviceTimed: every device time is None or zero.
    """
    if not profile.is_device_timed:
        raise NotDeviceTimed(
            f"device time is {profile.device_s} s per step across {profile.num_steps} steps "
            "(needs > 0): this profile cannot price a host-overhead optimisation"
        )


# ----------------------------------------------------------------------------- tables


def bar(fraction: float, width: int = 20) -> str:
    """A text bar of `width` cells, "#" filled to `fraction` (clamped to [0, 1]) and "." after.

    Raises:
        ValueError: width < 1.
    """
    if width < 1:
        raise ValueError(f"width={width} must be >= 1")
    fraction = min(max(fraction, 0.0), 1.0) if fraction == fraction else 0.0  # NaN draws empty
    filled = round(fraction * width)
    return "#" * filled + "." * (width - filled)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}ms"


def render(profile: StepProfile, width: int = 20) -> str:
    """The step as a text table: each phase's mean host, device, overhead and share of the step,
    then a summary line (loop, loop/token, bound, idle fraction, overlap model).

    Args:
        profile: the steps to show.
        width: cells in each share bar.
    Returns:
        The table, lines joined by newlines.
    """
    step = profile.step_s
    lines = [f"{'phase':<14}{'host':>12}{'device':>12}{'overhead':>12}{'share':>9}  syncs"]
    for phase in profile.phase_means.values():
        share = phase.host_s / step if step > 0.0 else 0.0
        lines.append(
            f"{phase.name:<14}{_ms(phase.host_s):>12}{_ms(phase.device_s):>12}{_ms(phase.overhead_s):>12}"
            f"{share:>9.2%}  {'yes' if phase.syncs else '   '}  {bar(share, width)}"
        )
    lines.append(f"{'step':<14}{_ms(step):>12}")
    loop = loop_overhead_s(profile)
    per_token = _ms(loop_overhead_s(profile, per_token=True)) if profile.mean_rows else "-"
    lines.append(
        f"{profile.num_steps} steps (warmup {profile.warmup} dropped), loop {_ms(loop)}, "
        f"loop/token {per_token}, bound {profile.bound}, idle {profile.idle_fraction:.1%}, "
        f"model {recommended_model(profile)}"
    )
    return "\n".join(lines)


def render_sweep(profiles: Mapping[int, StepProfile]) -> str:
    """One row per slot count: step, forward, loop, loop/token and loop share (the seed's sweep table)."""
    lines = [f"{'slots':<6}{'step':>12}{'forward':>12}{'loop':>10}{'loop/token':>12}{'loop share':>12}"]
    for slots, profile in sorted(profiles.items()):
        forward = profile.phase_means.get(FORWARD)
        loop = loop_overhead_s(profile)
        per_token = _ms(loop_overhead_s(profile, per_token=True)) if profile.mean_rows else "-"
        lines.append(
            f"{slots:<6}{_ms(profile.step_s):>12}{_ms(forward.host_s if forward else None):>12}"
            f"{_ms(loop):>10}{per_token:>12}{loop / profile.step_s:>12.2%}"
        )
    return "\n".join(lines)
