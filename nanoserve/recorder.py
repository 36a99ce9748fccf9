"""What the engine carries to be measured: the step records and the recorder that costs nothing.

The engine brackets each of its six phases with ``recorder.phase(name)`` and closes the step with
``recorder.end_step(...)``. By default it carries ``NULL_RECORDER``, whose every call does nothing;
a profiler swaps in a ``StepRecorder`` (``nanoserve.instruments.recording``), which builds one
``StepSample`` per step out of the ``Phase`` records defined here. The engine imports this module
and nothing of the instruments' arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PHASES = ("schedule", "sync_rows", "build_inputs", "forward", "sample", "collect")


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
    num_draft_tokens: int = 0  # speculative drafts verified this step (each one of num_rows)
    num_accepted_tokens: int = 0  # of those, kept

    def __post_init__(self) -> None:
        for field in ("num_rows", "num_tokens", "num_decode_rows", "num_draft_tokens", "num_accepted_tokens"):
            value = getattr(self, field)
            if value < 0:
                raise ValueError(f"{field}={value} must be >= 0")
        if self.num_decode_rows > self.num_rows:
            raise ValueError(f"num_decode_rows={self.num_decode_rows} exceeds num_rows={self.num_rows}")
        if self.num_accepted_tokens > self.num_draft_tokens:
            raise ValueError(f"num_accepted_tokens={self.num_accepted_tokens} exceeds num_draft_tokens={self.num_draft_tokens}")
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

    def end_step(self, *, num_rows: int, num_tokens: int, num_decode_rows: int, num_draft_tokens: int = 0,
                 num_accepted_tokens: int = 0) -> None:
        return None

    def profile(self, warmup: int = 1, decode_only: bool = False) -> Any:
        """Raises RuntimeError: the null recorder keeps nothing to profile."""
        raise RuntimeError("NULL_RECORDER records nothing; set engine.recorder = StepRecorder() to profile")

    def reset(self) -> None:
        return None


NULL_RECORDER = NullRecorder()
