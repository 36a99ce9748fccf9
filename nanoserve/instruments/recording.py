"""StepRecorder: one StepSample per engine step from the engine's inline phase() blocks, the device
clock it can read (a CUDA event timer), and what a recorder costs per step (the null one included)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from nanoserve.instruments.profile import StepProfile
from nanoserve.recorder import NULL_RECORDER, PHASES, NullRecorder, Phase, StepSample


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

    def end_step(self, *, num_rows: int, num_tokens: int, num_decode_rows: int, num_draft_tokens: int = 0,
                 num_accepted_tokens: int = 0) -> None:
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
        self.samples.append(StepSample(phases, num_rows, num_tokens, num_decode_rows, host_s, num_draft_tokens,
                                       num_accepted_tokens))

    def profile(self, warmup: int = 1, decode_only: bool = False) -> StepProfile:
        """StepProfile.from_samples over everything recorded so far."""
        return StepProfile.from_samples(self.samples, warmup=warmup, decode_only=decode_only)

    def reset(self) -> None:
        """Forgets every sample and any open step."""
        self.samples = []
        self.num_abandoned = 0
        self._t_begin, self._open = None, []


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

