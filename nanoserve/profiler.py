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
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

PHASES = ("schedule", "sync_rows", "build_inputs", "forward", "sample", "collect")
FORWARD = "forward"  # the one phase a faster device makes faster; every other phase is the loop
SERIAL = "serial"  # something reads a device value back: step = overhead + device
OVERLAPPED = "overlapped"  # nothing reads back, the host runs ahead: step = max(overhead, device)
MODELS = (SERIAL, OVERLAPPED)
HOST_BOUND = "host"
DEVICE_BOUND = "device"
_EVENT_RESOLUTION_S = 2e-6  # CUDA event timestamps are ~0.5us apart; slack below this is noise


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Phase:
    """One named region of a step and the two times it owns."""

    name: str  # "schedule", "forward", ... (any non-empty name; PHASES are the engine's six)
    host_s: float  # seconds the host spent inside the region
    device_s: float | None = None  # seconds of device work it launched; None = not device-timed
    syncs: bool = False  # the region reads a device value back, so the host waits for the device

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a phase needs a non-empty name")
        if not self.host_s >= 0.0:
            raise ValueError(f"phase {self.name!r}: host_s={self.host_s} must be >= 0")
        if self.device_s is not None and not self.device_s >= 0.0:
            raise ValueError(f"phase {self.name!r}: device_s={self.device_s} must be >= 0 or None")

    @property
    def overhead_s(self) -> float:
        """Host time not covered by device work: what a host-side change could remove."""
        return self.host_s - (self.device_s or 0.0)

    @property
    def hidden(self) -> bool:
        """More device time than host time: the host clock saw a launch, not the work."""
        return self.device_s is not None and self.device_s > self.host_s


@dataclass(frozen=True)
class StepSample:
    """One iteration of the engine loop."""

    phases: tuple[Phase, ...]  # in the order the step ran them
    num_rows: int  # rows sampled (tokens produced) this step
    num_tokens: int  # tokens forwarded this step (prefill chunks count every token)
    num_decode_rows: int  # of num_rows, how many were decodes
    host_s: float  # wall time begin_step -> end_step, including what no phase covers

    def __post_init__(self) -> None:
        for field in ("num_rows", "num_tokens", "num_decode_rows"):
            value = getattr(self, field)
            if value < 0:
                raise ValueError(f"{field}={value} must be >= 0")
        if self.num_decode_rows > self.num_rows:
            raise ValueError(f"num_decode_rows={self.num_decode_rows} exceeds num_rows={self.num_rows}")
        if not self.host_s >= 0.0:
            raise ValueError(f"step host_s={self.host_s} must be >= 0")

    @property
    def is_decode(self) -> bool:
        """Every sampled row was a decode (and there was at least one)."""
        return self.num_rows > 0 and self.num_decode_rows == self.num_rows

    @property
    def accounted_s(self) -> float:
        """Host seconds the phases cover."""
        return sum(p.host_s for p in self.phases)


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


class ProfileUnsound(ValueError):
    """A profile that renders a clean table and means nothing."""


class NotWarmedUp(ProfileUnsound):
    """Still holds the first steps: context creation, allocator growth, autotuning."""


class Unaccounted(ProfileUnsound):
    """Phases do not add up to the steps: it ranks where timers were put."""


class Unattributable(ProfileUnsound):
    """Host time taken around async launches: compute billed to whatever synchronises next."""


class NotDeviceTimed(ProfileUnsound):
    """No device clock: every second reads as overhead and every ceiling as infinite."""


class ModelMismatch(ProfileUnsound):
    """An overlap model the code does not follow."""


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


# ----------------------------------------------------------------------------- rendering


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
    """One row per slot count: step, forward, loop, loop/token and loop share (Day 46's table)."""
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


# ----------------------------------------------------------------------------- recording


class DeviceTimer(Protocol):
    """Brackets device work; what StepRecorder needs from a device clock."""

    def start(self) -> Any:
        """Marks the start of a region; returns a handle for stop and elapsed_s."""

    def stop(self, handle: Any) -> None:
        """Marks the end of the region `handle` started."""

    def elapsed_s(self, handle: Any) -> float:
        """Device seconds between the two marks (may block until the end mark has happened)."""


class _EventPair:
    __slots__ = ("start", "end")

    def __init__(self, start: Any) -> None:
        self.start = start
        self.end: Any = None


class CudaEventTimer:
    """Device timing from torch.cuda.Event(enable_timing=True) pairs, read at end_step.

    With synchronize=True (the default) stop() waits for its end event, so the host clock that
    the recorder reads just after it covers the work, not the launch. That makes a profiled step
    a serialised one, longer than an unprofiled step: trust the profile's shape, not its total.
    With synchronize=False host times are launch times and check_attributable will refuse them.
    """

    def __init__(self, synchronize: bool = True) -> None:
        import torch  # lazily: the profiler's arithmetic needs no torch

        if not torch.cuda.is_available():
            raise RuntimeError("CudaEventTimer needs a CUDA device; torch.cuda.is_available() is False")
        self._event = torch.cuda.Event
        self.synchronize = synchronize

    def start(self) -> _EventPair:
        event = self._event(enable_timing=True)
        event.record()
        return _EventPair(event)

    def stop(self, handle: _EventPair) -> None:
        handle.end = self._event(enable_timing=True)
        handle.end.record()
        if self.synchronize:
            handle.end.synchronize()

    def elapsed_s(self, handle: _EventPair) -> float:
        handle.end.synchronize()
        return handle.start.elapsed_time(handle.end) / 1e3  # elapsed_time is in milliseconds


CudaDeviceTimer = CudaEventTimer  # the seed's name for it


class _PhaseTimer:
    """Times one phase for a StepRecorder: host clock around, device marks inside."""

    __slots__ = ("_recorder", "_name", "_syncs", "_t0", "_handle")

    def __init__(self, recorder: StepRecorder, name: str, syncs: bool) -> None:
        self._recorder = recorder
        self._name = name
        self._syncs = syncs

    def __enter__(self) -> None:
        recorder = self._recorder
        self._t0 = recorder.clock()
        timer = recorder.device_timer
        self._handle = timer.start() if timer is not None else None

    def __exit__(self, *exc: object) -> None:
        recorder = self._recorder
        if recorder.device_timer is not None:
            recorder.device_timer.stop(self._handle)  # before the clock: host time covers the wait
        host_s = recorder.clock() - self._t0
        recorder._open.append((self._name, host_s, self._syncs, self._handle))


class StepRecorder:
    """Collects one StepSample per engine step from inline phase() blocks.

    Usage (the engine's):
        rec.begin_step()
        with rec.phase("schedule"): ...
        with rec.phase("collect", syncs=True): ...
        rec.end_step(num_rows=..., num_tokens=..., num_decode_rows=...)

    Args:
        clock: the host clock, seconds (tests pass one they advance by hand).
        device_timer: brackets each phase's device work (CudaEventTimer on a GPU); None
            leaves every device time None.
    """

    is_recording = True  # lets a caller skip building what only a profile would read

    def __init__(
        self, clock: Callable[[], float] = time.perf_counter, device_timer: DeviceTimer | None = None
    ) -> None:
        self.clock = clock
        self.device_timer = device_timer
        self.samples: list[StepSample] = []
        self.num_abandoned = 0  # steps begun and never ended (an exception mid-step)
        self._t_begin: float | None = None
        self._open: list[tuple[str, float, bool, Any]] = []  # (name, host_s, syncs, device handle)

    def begin_step(self) -> None:
        """Starts a step; an unfinished previous step is dropped and counted in num_abandoned."""
        if self._t_begin is not None:
            self.num_abandoned += 1
        self._open = []
        self._t_begin = self.clock()

    def phase(self, name: str, *, syncs: bool = False) -> _PhaseTimer:
        """A context manager timing one named region of the current step.

        Args:
            name: the phase's name.
            syncs: the region reads a device value back (decides the overlap model).
        Raises:
            RuntimeError: no step is open.
        """
        if self._t_begin is None:
            raise RuntimeError(f"phase({name!r}) outside a step: call begin_step() first")
        return _PhaseTimer(self, name, syncs)

    def end_step(self, *, num_rows: int, num_tokens: int, num_decode_rows: int) -> None:
        """Closes the step and appends its StepSample (device times are resolved here).

        Raises:
            RuntimeError: no step is open.
            ValueError: negative counts, or more decode rows than rows.
        """
        t_end = self.clock()  # first: resolving device times is the instrument's cost, not the step's
        if self._t_begin is None:
            raise RuntimeError("end_step() without begin_step()")
        timer = self.device_timer
        phases = tuple(
            Phase(name, host_s, None if handle is None else timer.elapsed_s(handle), syncs)
            for name, host_s, syncs, handle in self._open
        )
        host_s = t_end - self._t_begin
        self._t_begin, self._open = None, []
        self.samples.append(StepSample(phases, num_rows, num_tokens, num_decode_rows, host_s))

    def profile(self, warmup: int = 1, decode_only: bool = False) -> StepProfile:
        """StepProfile.from_samples over everything recorded so far."""
        return StepProfile.from_samples(self.samples, warmup=warmup, decode_only=decode_only)

    def reset(self) -> None:
        """Forgets every sample and any open step."""
        self.samples = []
        self.num_abandoned = 0
        self._t_begin, self._open = None, []


class _NullPhase:
    """The one no-op context manager every NullRecorder.phase() call returns."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None  # falsy: exceptions propagate


_NULL_PHASE = _NullPhase()


class NullRecorder:
    """The recorder the engine carries when nobody is profiling: every method does nothing.

    Written as __slots__ classes rather than contextlib.nullcontext because the engine enters
    six of these per step whether or not anyone is looking: phase() returns one shared object,
    so an unprofiled step allocates nothing for its instrument.
    """

    __slots__ = ()
    is_recording = False

    @property
    def samples(self) -> tuple[StepSample, ...]:
        return ()

    def begin_step(self) -> None:
        return None

    def phase(self, name: str, *, syncs: bool = False) -> _NullPhase:
        return _NULL_PHASE

    def end_step(self, *, num_rows: int, num_tokens: int, num_decode_rows: int) -> None:
        return None

    def profile(self, warmup: int = 1, decode_only: bool = False) -> StepProfile:
        """Raises RuntimeError: the null recorder keeps nothing to profile."""
        raise RuntimeError("NULL_RECORDER records nothing; set engine.recorder = StepRecorder() to profile")

    def reset(self) -> None:
        return None


NULL_RECORDER = NullRecorder()


def _per_step_cost_s(recorder: StepRecorder | NullRecorder, n_steps: int) -> float:
    if n_steps < 1:
        raise ValueError(f"n_steps={n_steps} must be >= 1")
    start = time.perf_counter()
    for _ in range(n_steps):
        recorder.begin_step()
        for name in PHASES:
            with recorder.phase(name, syncs=name == "collect"):
                pass
        recorder.end_step(num_rows=1, num_tokens=1, num_decode_rows=1)
    return (time.perf_counter() - start) / n_steps


def null_recorder_cost_s(n_steps: int = 10_000) -> float:
    """Measures NULL_RECORDER's cost per step: begin, the six phases, end, around empty bodies.

    Args:
        n_steps: steps to average over.
    Returns:
        Seconds per step.
    Raises:
        ValueError: n_steps < 1.
    """
    return _per_step_cost_s(NULL_RECORDER, n_steps)


def step_recorder_cost_s(n_steps: int = 10_000) -> float:
    """Measures a StepRecorder's cost per step the same way, for comparison with the null one."""
    return _per_step_cost_s(StepRecorder(), n_steps)

