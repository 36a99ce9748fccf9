"""nanoserve.recorder: the Phase and StepSample records and the null recorder the engine carries."""

from __future__ import annotations

import pytest
from test_profile import U, make_sample

from nanoserve.instruments.recording import (
    StepRecorder,
)
from nanoserve.recorder import NULL_RECORDER, PHASES, NullRecorder, Phase, StepSample


def test_phases_constant():
    assert PHASES == ("schedule", "sync_rows", "build_inputs", "forward", "sample", "collect")


def test_phase_overhead_and_hidden():
    assert Phase("forward", 24 * U, 21 * U).overhead_s == 3 * U
    assert Phase("sample", 8 * U).overhead_s == 8 * U  # no device time: all of it is overhead
    assert not Phase("forward", 24 * U, 21 * U).hidden
    assert Phase("forward", 0.1 * U, 21 * U).hidden
    assert not Phase("sample", 8 * U).hidden


@pytest.mark.parametrize("kw", [{"host_s": -1.0}, {"host_s": float("nan")}, {"host_s": 1.0, "device_s": -1.0}])
def test_phase_refuses_negative_times(kw):
    with pytest.raises(ValueError, match="must be >= 0"):
        Phase("x", **kw)


def test_step_sample_validation_and_is_decode():
    assert make_sample().is_decode
    assert not make_sample(decode_rows=3).is_decode  # one row still prefilling
    assert not StepSample((), 0, 0, 0, 0.0).is_decode  # an empty step is not a decode step
    assert make_sample().accounted_s == 40 * U
    with pytest.raises(ValueError, match="num_decode_rows=5 exceeds num_rows=4"):
        make_sample(decode_rows=5)
    with pytest.raises(ValueError, match="num_rows=-1"):
        StepSample((), -1, 0, 0, 0.0)


def test_null_recorder_has_empty_slots_and_no_dict():
    assert NullRecorder.__slots__ == ()
    assert not hasattr(NULL_RECORDER, "__dict__")
    assert isinstance(NULL_RECORDER, NullRecorder)
    assert NULL_RECORDER.is_recording is False and StepRecorder.is_recording is True


def test_null_recorder_returns_one_shared_context_manager():
    first = NULL_RECORDER.phase("schedule")
    assert NULL_RECORDER.phase("collect", syncs=True) is first
    assert NULL_RECORDER.phase("forward") is first
    assert not hasattr(first, "__dict__")


def test_null_recorder_runs_an_engine_shaped_step_and_keeps_nothing():
    assert NULL_RECORDER.begin_step() is None
    for name in PHASES:
        with NULL_RECORDER.phase(name, syncs=name == "collect") as entered:
            assert entered is None
    assert NULL_RECORDER.end_step(num_rows=4, num_tokens=4, num_decode_rows=4) is None
    assert NULL_RECORDER.samples == ()
    assert NULL_RECORDER.reset() is None
    with pytest.raises(RuntimeError, match="records nothing"):
        NULL_RECORDER.profile()


def test_null_recorder_phase_lets_exceptions_through():
    with pytest.raises(ZeroDivisionError), NULL_RECORDER.phase("forward"):
        raise ZeroDivisionError
