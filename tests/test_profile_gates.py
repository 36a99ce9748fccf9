"""nanoserve.instruments.profile_gates: each gate refuses the profile it names and passes a sound one;
the tables, checked line by line against values worked out by hand.
"""

from __future__ import annotations

import pytest
from test_profile import STEP, U, make_phases, make_profile, make_sample

from nanoserve.instruments.profile import ProfileUnsound, StepProfile
from nanoserve.instruments.profile_gates import (
    NotDeviceTimed,
    NotWarmedUp,
    Unaccounted,
    Unattributable,
    bar,
    check_accounted,
    check_attributable,
    check_device_timed,
    check_warmed_up,
    render,
    render_sweep,
)
from nanoserve.instruments.profile_pricing import (
    ModelMismatch,
)
from nanoserve.recorder import Phase, StepSample


def test_every_gate_error_is_a_profile_unsound_value_error():
    for cls in (NotWarmedUp, Unaccounted, Unattributable, NotDeviceTimed, ModelMismatch):
        assert issubclass(cls, ProfileUnsound)
    assert issubclass(ProfileUnsound, ValueError)


def test_check_warmed_up():
    with pytest.raises(NotWarmedUp, match="warmup=0 .* minimum 1"):
        check_warmed_up(make_profile(warmup=0))
    check_warmed_up(make_profile(warmup=1))
    with pytest.raises(NotWarmedUp, match="warmup=1 .* minimum 2"):
        check_warmed_up(make_profile(warmup=1), min_warmup=2)
    check_warmed_up(make_profile(warmup=0), min_warmup=0)


def test_check_accounted_passes_when_phases_fill_the_step():
    check_accounted(make_profile(step_u=40))
    check_accounted(make_profile(step_u=40.5))  # 40 / 40.5 = 98.8%, inside 2%


def test_check_accounted_refuses_a_missing_slice():
    with pytest.raises(Unaccounted, match=r"95\.24% .* \+/- 2\.00%"):  # 40 / 42
        check_accounted(make_profile(step_u=42))
    check_accounted(make_profile(step_u=42), tolerance=0.05)


def test_check_accounted_refuses_phases_longer_than_the_step():
    with pytest.raises(Unaccounted, match=r"125\.00%"):  # 40 / 32: overlapping timers
        check_accounted(make_profile(step_u=32))


def test_check_attributable_refuses_launch_timed_phases():
    # host clock around the launch: forward 0.1 U on the host, 21 U on the device
    table = dict(STEP, forward=(0.125, 21))
    p = StepProfile((make_sample(), StepSample(make_phases(table), 4, 4, 4, 40 * U)))
    with pytest.raises(Unattributable, match="step 1 phase 'forward'"):
        check_attributable(p)


def test_check_attributable_passes_synced_timings_and_small_slack():
    check_attributable(make_profile())
    check_attributable(make_profile(device=False))  # nothing device-timed, nothing to attribute
    slack = StepProfile((StepSample((Phase("forward", 100 * U, 102 * U),), 1, 1, 1, 100 * U),))
    check_attributable(slack)  # 2% over, inside the 5% default
    with pytest.raises(Unattributable):
        check_attributable(slack, tolerance=0.01)


def test_check_device_timed():
    check_device_timed(make_profile())
    with pytest.raises(NotDeviceTimed, match="device time is 0.0 s"):
        check_device_timed(make_profile(device=False))  # all None
    zeros = {name: (host, 0) for name, (host, _) in STEP.items()}
    with pytest.raises(NotDeviceTimed):
        check_device_timed(StepProfile((StepSample(make_phases(zeros), 4, 4, 4, 40 * U),)))


def test_every_unsound_profile_still_renders():
    # the gates exist because all four of these produce a clean table
    for p in (make_profile(warmup=0), make_profile(step_u=42), make_profile(device=False)):
        assert "sample" in render(p)


def test_bar():
    assert bar(0.5, 10) == "#####....."
    assert bar(0.25, 4) == "#..."
    assert bar(1.5, 4) == "####"
    assert bar(-1.0, 4) == "...."
    assert bar(float("nan"), 4) == "...."
    with pytest.raises(ValueError, match="width=0"):
        bar(0.5, 0)


def test_render_shows_each_phase_and_the_summary():
    phases = (Phase("forward", 3e-3, 2e-3), Phase("collect", 1e-3, None, True))
    p = StepProfile((StepSample(phases, 2, 2, 2, 4e-3),), warmup=1)
    lines = render(p, width=4).splitlines()
    assert lines[0].split() == ["phase", "host", "device", "overhead", "share", "syncs"]
    assert lines[1].split() == ["forward", "3.000ms", "2.000ms", "1.000ms", "75.00%", "###."]
    assert lines[2].split() == ["collect", "1.000ms", "-", "1.000ms", "25.00%", "yes", "#..."]
    assert lines[3].split() == ["step", "4.000ms"]
    # loop = collect 1ms, per token 0.5ms; device 2 >= overhead 2; idle 2 / 4
    assert lines[4] == (
        "1 steps (warmup 1 dropped), loop 1.000ms, loop/token 0.500ms, bound device, idle 50.0%, model serial"
    )


def seed_profile(slots, step_ms, forward_ms, loop_ms):
    phases = (Phase("forward", forward_ms * 1e-3), Phase("sample", loop_ms * 1e-3, None, True))
    return StepProfile((StepSample(phases, slots, slots, slots, step_ms * 1e-3),), warmup=2)


def test_render_sweep_reproduces_the_seed_table():
    table = render_sweep({4: seed_profile(4, 984.047, 982.756, 1.161), 1: seed_profile(1, 307.885, 307.234, 0.577)})
    lines = table.splitlines()
    assert lines[0].split() == ["slots", "step", "forward", "loop", "loop/token", "loop", "share"]
    # 0.577 / 307.885 = 0.187%; 1.161 / 4 = 0.290; 1.161 / 984.047 = 0.118%
    assert lines[1].split() == ["1", "307.885ms", "307.234ms", "0.577ms", "0.577ms", "0.19%"]
    assert lines[2].split() == ["4", "984.047ms", "982.756ms", "1.161ms", "0.290ms", "0.12%"]
