"""nanoserve.instruments.profile_pricing: Amdahl, the overlap models and the speedup a change would
buy, on hand-placed numbers (multiples of U = 2**-10 s, exact in binary); every expected value is
worked out by hand in the comment beside it.
"""

from __future__ import annotations

import math

import pytest
from test_profile import STEP, U, make_phases, make_profile

from nanoserve.instruments.profile import StepProfile
from nanoserve.instruments.profile_gates import (
    NotDeviceTimed,
    check_device_timed,
)
from nanoserve.instruments.profile_pricing import (
    MODELS,
    OVERLAPPED,
    SERIAL,
    ModelMismatch,
    amdahl,
    check_model_applies,
    loop_overhead_s,
    project_point,
    recommended_model,
    speedup_if,
    step_time_under,
    step_with_compute,
)
from nanoserve.recorder import Phase, StepSample


@pytest.mark.parametrize(
    "fraction, factor, expected",
    [
        (0.5, 2.0, 1 / (0.5 + 0.25)),  # 4/3
        (0.2, 4.0, 1 / (0.8 + 0.05)),
        (0.9, 10.0, 1 / (0.1 + 0.09)),
        (0.75, math.inf, 4.0),  # 1 / (1 - 0.75)
        (0.0, 5.0, 1.0),
        (1.0, 2.0, 2.0),
        (0.5, 0.5, 1 / (0.5 + 1.0)),  # a slowdown is still Amdahl
    ],
)
def test_amdahl_matches_its_closed_form(fraction, factor, expected):
    assert amdahl(fraction, factor) == pytest.approx(expected, rel=1e-15)


def test_amdahl_with_everything_removed_is_infinite():
    assert amdahl(1.0, math.inf) == math.inf


@pytest.mark.parametrize("fraction, factor", [(-0.1, 2.0), (1.1, 2.0), (float("nan"), 2.0), (0.5, 0.0), (0.5, -1.0)])
def test_amdahl_refuses_out_of_range(fraction, factor):
    with pytest.raises(ValueError, match="must be"):
        amdahl(fraction, factor)


def test_step_time_under_both_models():
    assert step_time_under(3.0, 5.0, SERIAL) == 8.0  # overhead + device
    assert step_time_under(3.0, 5.0, OVERLAPPED) == 5.0  # host hides under the kernels
    assert step_time_under(7.0, 5.0, OVERLAPPED) == 7.0  # device waits for the host
    assert step_time_under(3.0, 5.0) == 8.0  # serial is the default
    assert MODELS == ("serial", "overlapped")


def test_step_time_under_refuses_bad_input():
    with pytest.raises(ValueError, match="'pipelined'"):
        step_time_under(1.0, 1.0, "pipelined")
    with pytest.raises(ValueError, match="overhead_s=-1.0"):
        step_time_under(-1.0, 1.0)


def test_speedup_if_everything_removed_is_host_over_device():
    p = make_profile()
    assert speedup_if(p, overhead_factor=math.inf) == 40 / 23  # serial: (17 + 23) / 23


@pytest.mark.parametrize("k", [1.0, 2.0, 4.0, 10.0, math.inf])
def test_speedup_if_and_amdahl_are_the_same_number_by_two_routes(k):
    p = make_profile()
    assert speedup_if(p, overhead_factor=k) == pytest.approx(amdahl(p.idle_fraction, k), rel=1e-12)


def test_speedup_if_halving_all_overhead():
    assert speedup_if(make_profile(), overhead_factor=2.0) == 40 / 31.5  # 23 + 17 / 2


def test_speedup_if_eliminate_one_phase_keeps_its_device_time():
    # sample's 7 U of overhead goes, its 1 U of device work stays: 23 + (17 - 7) = 33
    assert speedup_if(make_profile(), eliminate=("sample",)) == 40 / 33


def test_speedup_if_shrinks_only_the_named_phases():
    # sample 7 -> 3.5, collect 4 -> 2: overhead 17 - 11 + 5.5 = 11.5, step 34.5
    assert speedup_if(make_profile(), overhead_factor=2.0, phases=("sample", "collect")) == 40 / 34.5


def test_speedup_if_eliminate_and_shrink_together():
    # sample gone (7), the rest (10) halved to 5: step 23 + 5 = 28
    assert speedup_if(make_profile(), eliminate=("sample",), overhead_factor=2.0) == 40 / 28


def test_speedup_if_under_the_overlapped_model():
    p = make_profile(sync_phase=None)  # nothing reads back
    assert recommended_model(p) == OVERLAPPED
    # device-bound: max(17, 23) = 23 before and max(0, 23) after: removing overhead buys nothing
    assert speedup_if(p, overhead_factor=math.inf) == 1.0
    host_bound = StepProfile((StepSample(make_phases(dict(STEP, forward=(24, 2)), sync_phase=None), 4, 4, 4, 40 * U),))
    # device 4, overhead 36: max(36, 4) = 36 before, max(18, 4) = 18 after halving
    assert speedup_if(host_bound, overhead_factor=2.0) == 2.0


def test_speedup_if_on_a_cpu_profile_is_infinite_which_is_why_the_gate_exists():
    p = make_profile(device=False)
    assert speedup_if(p, overhead_factor=math.inf) == math.inf
    with pytest.raises(NotDeviceTimed):
        check_device_timed(p)


def test_speedup_if_refuses_unknown_phases_and_bad_factors():
    with pytest.raises(ValueError, match="'sampel'"):
        speedup_if(make_profile(), eliminate=("sampel",))
    with pytest.raises(ValueError, match="overhead_factor=0"):
        speedup_if(make_profile(), overhead_factor=0)


def test_speedup_if_refuses_the_flattering_model():
    p = make_profile()  # collect syncs
    with pytest.raises(ModelMismatch, match="'overlapped'"):
        speedup_if(p, overhead_factor=2.0, model=OVERLAPPED)
    assert speedup_if(p, overhead_factor=2.0, model=SERIAL) == 40 / 31.5


def test_recommended_model_reads_the_sync_flags():
    assert recommended_model(make_profile()) == SERIAL
    assert recommended_model(make_profile(sync_phase="sample")) == SERIAL
    assert recommended_model(make_profile(sync_phase=None)) == OVERLAPPED
    assert recommended_model(make_phases()) == SERIAL  # also takes one step's phases
    assert recommended_model([Phase("forward", 1.0)]) == OVERLAPPED


def test_check_model_applies():
    check_model_applies(make_profile(), SERIAL)
    with pytest.raises(ModelMismatch, match=r"'overlapped' .* 'serial' .*\['collect'\]"):
        check_model_applies(make_profile(), OVERLAPPED)
    check_model_applies(make_profile(sync_phase=None), OVERLAPPED)
    with pytest.raises(ModelMismatch, match="calls for 'overlapped'"):
        check_model_applies(make_profile(sync_phase=None), SERIAL)
    with pytest.raises(ValueError, match="'async'"):
        check_model_applies(make_profile(), "async")


def test_loop_overhead_is_everything_but_forward():
    p = make_profile(rows=4)
    assert loop_overhead_s(p) == 16 * U  # 40 - 24
    assert loop_overhead_s(p, per_token=True) == 4 * U
    assert loop_overhead_s(make_profile(device=False)) == 16 * U  # by name: no device clock needed


def test_step_with_compute_reproduces_the_seed_projection():
    # The seed's profbench row: 2ms of arithmetic under a 0.577ms loop is a 2.577ms step, 22% of it Python
    sample = StepSample(
        (Phase("forward", 307.234e-3), Phase("sample", 0.577e-3), Phase("collect", 0.0, syncs=True)),
        1, 1, 1, 307.885e-3,
    )
    p = StepProfile((sample,), warmup=2)
    step = step_with_compute(p, 2e-3)
    assert step == pytest.approx(2.577e-3, rel=1e-12)
    assert loop_overhead_s(p) / step == pytest.approx(0.577 / 2.577, rel=1e-12)
    assert round(loop_overhead_s(p) / step, 2) == 0.22


def test_step_with_compute_under_both_models():
    assert step_with_compute(make_profile(), 8 * U) == 24 * U  # serial: 16 + 8
    assert step_with_compute(make_profile(sync_phase=None), 8 * U) == 16 * U  # max(16, 8)
    with pytest.raises(ModelMismatch):
        step_with_compute(make_profile(), 8 * U, model=OVERLAPPED)
    with pytest.raises(ValueError, match="forward_s=-1"):
        step_with_compute(make_profile(), -1)


def test_project_point_measured_and_projected():
    p = make_profile(rows=4, step_u=41)  # 1 U per step the phases do not cover
    throughput, latency = project_point(p, 4)
    assert latency == 41 * U
    assert throughput == 4 / (41 * U)
    throughput, latency = project_point(p, 4, forward_s=8 * U)
    assert latency == 24 * U  # loop 16 + forward 8
    assert throughput == 4 / (24 * U)


def test_project_point_refuses_another_batch():
    with pytest.raises(ValueError, match="4 rows per step and cannot stand for slots=2"):
        project_point(make_profile(rows=4), 2)
    with pytest.raises(ValueError, match="slots=0"):
        project_point(make_profile(rows=4), 0)
