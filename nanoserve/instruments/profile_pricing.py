"""What a change to the loop would buy, priced from a measured `StepProfile` before anyone makes it.

- `amdahl`, `step_time_under`, `speedup_if`: the speedup from removing or shrinking overhead;
- `loop_overhead_s`, `step_with_compute`, `project_point`: the loop told apart from the forward by
  name, and the step projected with a different forward (a point on the latency-throughput curve);
- `recommended_model` reads `Phase.syncs` to decide whether overhead overlaps the device (nothing
  reads back: step = max(overhead, device)) or adds to it (something reads back: step = overhead +
  device), and `check_model_applies` refuses the flattering choice.

Every time is in seconds. The arithmetic treats a missing device time as zero (all overhead) and
never refuses a number it can compute; refusing a profile that cannot price anything is the
gates' job (`nanoserve.instruments.profile_gates`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from nanoserve.instruments.profile import FORWARD, ProfileUnsound, StepProfile
from nanoserve.recorder import Phase

SERIAL = "serial"  # something reads a device value back: step = overhead + device
OVERLAPPED = "overlapped"  # nothing reads back, the host runs ahead: step = max(overhead, device)
MODELS = (SERIAL, OVERLAPPED)


class ModelMismatch(ProfileUnsound):
    """An overlap model the code does not follow."""


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
