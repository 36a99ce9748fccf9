"""nanoserve.profiler: arithmetic on hand-placed numbers, the gates, the recorder on a hand clock.

Times are multiples of U = 2**-10 s so that sums are exact in binary floating point; every
expected value below is worked out by hand in the comment beside it. Engine-loop tests live
with the engine.
"""

from __future__ import annotations

import math

import pytest
import torch

from nanoserve import profiler
from nanoserve.profiler import (
    MODELS,
    NULL_RECORDER,
    OVERLAPPED,
    PHASES,
    SERIAL,
    CudaEventTimer,
    ModelMismatch,
    NotDeviceTimed,
    NotWarmedUp,
    NullRecorder,
    Phase,
    ProfileUnsound,
    StepProfile,
    StepRecorder,
    StepSample,
    Unaccounted,
    Unattributable,
    amdahl,
    bar,
    check_accounted,
    check_attributable,
    check_device_timed,
    check_model_applies,
    check_warmed_up,
    loop_overhead_s,
    null_recorder_cost_s,
    project_point,
    recommended_model,
    render,
    render_sweep,
    speedup_if,
    step_recorder_cost_s,
    step_time_under,
    step_with_compute,
)

U = 2.0**-10  # about a millisecond, exact in binary

# One decode step at 4 rows, in units of U: (host, device). Totals: host 40, device 23,
# overhead 17. Overheads: schedule 1, sync_rows 1, build_inputs 1, forward 3, sample 7, collect 4.
STEP = {
    "schedule": (1, 0),
    "sync_rows": (1, 0),
    "build_inputs": (2, 1),
    "forward": (24, 21),
    "sample": (8, 1),
    "collect": (4, 0),
}


def make_phases(table=STEP, *, device=True, sync_phase="collect"):
    return tuple(
        Phase(name, host * U, device_u * U if device else None, name == sync_phase)
        for name, (host, device_u) in table.items()
    )


def make_sample(rows=4, step_u=40, *, decode_rows=None, tokens=None, **kw):
    return StepSample(
        make_phases(**kw),
        num_rows=rows,
        num_tokens=rows if tokens is None else tokens,
        num_decode_rows=rows if decode_rows is None else decode_rows,
        host_s=step_u * U,
    )


def make_profile(n=2, warmup=1, **kw):
    return StepProfile(tuple(make_sample(**kw) for _ in range(n)), warmup=warmup)


# ----------------------------------------------------------------------------- tier 1: arithmetic


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


def test_profile_per_step_quantities():
    p = make_profile(n=2)
    assert p.num_steps == 2
    assert p.step_s == 40 * U
    assert p.accounted_s == 40 * U
    assert p.device_s == 23 * U
    assert p.overhead_s == 17 * U
    assert p.idle_fraction == 17 / 40
    assert p.bound == "device"  # 23 of device against 17 of overhead
    assert p.sync_points == 1
    assert p.is_device_timed
    assert p.mean_rows == 4


def test_phase_totals_sum_and_means_average():
    p = make_profile(n=2)
    totals, means = p.phase_totals, p.phase_means
    assert list(totals) == list(PHASES)  # first-seen order
    assert totals["forward"] == Phase("forward", 48 * U, 42 * U, False)
    assert totals["collect"] == Phase("collect", 8 * U, 0.0, True)
    assert means["forward"] == Phase("forward", 24 * U, 21 * U, False)


def test_phase_totals_keep_none_where_nothing_was_device_timed():
    p = make_profile(n=2, device=False)
    assert p.phase_totals["sample"] == Phase("sample", 16 * U, None, False)
    assert p.device_s == 0.0
    assert not p.is_device_timed


def test_phase_missing_from_a_step_counts_as_zero_in_the_mean():
    full = make_sample()
    short = StepSample((Phase("schedule", 2 * U, None),), 0, 0, 0, 2 * U)  # an empty step
    p = StepProfile((full, short))
    assert p.phase_means["schedule"].host_s == 1.5 * U  # (1 + 2) / 2
    assert p.phase_means["forward"].host_s == 12 * U  # (24 + 0) / 2


def test_hotspots_rank_by_overhead_not_host_time():
    p = make_profile()
    names = [ph.name for ph in p.hotspots()]
    # overheads 7, 4, 3, then three 1s in step order; forward has the most host time (24)
    assert names == ["sample", "collect", "forward", "schedule", "sync_rows", "build_inputs"]
    assert max(p.phase_means.values(), key=lambda ph: ph.host_s).name == "forward"
    assert [ph.name for ph in p.hotspots(2)] == ["sample", "collect"]
    assert p.hotspots()[0].overhead_s == 7 * U


def test_bound_is_host_when_overhead_exceeds_device():
    table = dict(STEP, forward=(24, 10))  # device 12, overhead 28
    p = StepProfile((StepSample(make_phases(table), 4, 4, 4, 40 * U),))
    assert p.bound == "host"
    assert p.idle_fraction == 28 / 40


def test_cpu_profile_is_all_overhead():
    p = make_profile(device=False)
    assert p.idle_fraction == 1.0
    assert p.bound == "host"


def test_overhead_per_token_divides_by_rows_sampled():
    # two steps of 17 U overhead each, 4 rows then 2 rows: 34 U over 6 tokens
    p = StepProfile((make_sample(rows=4), make_sample(rows=2)))
    assert p.overhead_per_token_s == pytest.approx(34 * U / 6, rel=1e-15)
    assert make_profile(rows=4).overhead_per_token_s == 17 * U / 4


def test_overhead_per_token_refuses_a_profile_without_rows():
    p = StepProfile((StepSample((Phase("schedule", U),), 0, 0, 0, U),))
    with pytest.raises(ValueError, match="0 rows"):
        _ = p.overhead_per_token_s


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


def test_loop_overhead_is_everything_but_forward():
    p = make_profile(rows=4)
    assert loop_overhead_s(p) == 16 * U  # 40 - 24
    assert loop_overhead_s(p, per_token=True) == 4 * U
    assert loop_overhead_s(make_profile(device=False)) == 16 * U  # by name: no device clock needed


def test_step_with_compute_reproduces_the_seed_projection():
    # Day 46: 2ms of arithmetic under a 0.577ms loop is a 2.577ms step, 22% of it Python
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


# ----------------------------------------------------------------------------- tier 2: gates


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


def test_check_model_applies():
    check_model_applies(make_profile(), SERIAL)
    with pytest.raises(ModelMismatch, match=r"'overlapped' .* 'serial' .*\['collect'\]"):
        check_model_applies(make_profile(), OVERLAPPED)
    check_model_applies(make_profile(sync_phase=None), OVERLAPPED)
    with pytest.raises(ModelMismatch, match="calls for 'overlapped'"):
        check_model_applies(make_profile(sync_phase=None), SERIAL)
    with pytest.raises(ValueError, match="'async'"):
        check_model_applies(make_profile(), "async")


def test_every_unsound_profile_still_renders():
    # the gates exist because all four of these produce a clean table
    for p in (make_profile(warmup=0), make_profile(step_u=42), make_profile(device=False)):
        assert "sample" in render(p)


# ----------------------------------------------------------------------------- rendering


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


# ----------------------------------------------------------------------------- tier 3: the recorder


class HandClock:
    """A clock the test advances by hand."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


class ScriptedDeviceTimer:
    """Hands out device times from a script; stop() may cost host time, as a CUDA sync does."""

    def __init__(self, clock, device_s, stop_wait_s=0.0):
        self.clock, self.device_s, self.stop_wait_s = clock, list(device_s), stop_wait_s
        self.calls = []

    def start(self):
        self.calls.append("start")
        return len(self.calls)

    def stop(self, handle):
        self.calls.append("stop")
        self.clock.advance(self.stop_wait_s)

    def elapsed_s(self, handle):
        self.calls.append("elapsed")
        return self.device_s.pop(0)


def run_step(rec, clock, host_u, *, rows=4, decode_rows=None, gap_u=0.0):
    """One engine-shaped step: each phase advances the clock by host_u[name] * U."""
    rec.begin_step()
    clock.advance(gap_u * U)
    for name in PHASES:
        with rec.phase(name, syncs=name == "collect"):
            clock.advance(host_u[name] * U)
    rec.end_step(num_rows=rows, num_tokens=rows, num_decode_rows=rows if decode_rows is None else decode_rows)


HOST_U = {name: host for name, (host, _) in STEP.items()}


def test_recorder_times_each_phase_exactly():
    clock = HandClock()
    rec = StepRecorder(clock=clock)
    run_step(rec, clock, HOST_U, gap_u=0.5)
    (sample,) = rec.samples
    assert [p.name for p in sample.phases] == list(PHASES)
    assert [p.host_s for p in sample.phases] == [1 * U, 1 * U, 2 * U, 24 * U, 8 * U, 4 * U]
    assert [p.syncs for p in sample.phases] == [False] * 5 + [True]
    assert all(p.device_s is None for p in sample.phases)
    assert sample.host_s == 40.5 * U  # phases plus the half-unit gap before schedule
    assert (sample.num_rows, sample.num_tokens, sample.num_decode_rows) == (4, 4, 4)


def test_recorder_with_a_device_timer_brackets_device_time():
    clock = HandClock()
    device = [d * U for _, d in STEP.values()]
    timer = ScriptedDeviceTimer(clock, device, stop_wait_s=U)
    rec = StepRecorder(clock=clock, device_timer=timer)
    run_step(rec, clock, HOST_U)
    (sample,) = rec.samples
    assert [p.device_s for p in sample.phases] == device
    # stop() runs before the clock is read, so each phase's host time includes the 1 U wait
    assert [p.host_s for p in sample.phases] == [(h + 1) * U for h in HOST_U.values()]
    # device times are resolved at end_step, after every phase has stopped
    assert timer.calls == ["start", "stop"] * 6 + ["elapsed"] * 6


def test_recorder_profile_drops_warmup_then_filters_decode():
    clock = HandClock()
    rec = StepRecorder(clock=clock)
    run_step(rec, clock, HOST_U, rows=1, decode_rows=0)  # 0: prefill
    run_step(rec, clock, HOST_U, rows=1)  # 1: decode
    run_step(rec, clock, HOST_U, rows=2, decode_rows=1)  # 2: mixed
    run_step(rec, clock, HOST_U, rows=2)  # 3: decode
    run_step(rec, clock, dict(HOST_U, sample=12), rows=2)  # 4: decode, sample 12 U
    p = rec.profile(warmup=2, decode_only=True)
    assert p.num_steps == 2 and p.warmup == 2 and p.decode_only
    assert p.samples == tuple(rec.samples[3:])
    assert p.phase_means["sample"].host_s == 10 * U  # (8 + 12) / 2
    assert rec.profile(warmup=2).num_steps == 3  # the mixed step stays without the filter
    assert rec.profile(warmup=0).num_steps == 5


def test_recorder_profile_refuses_when_nothing_is_left():
    clock = HandClock()
    rec = StepRecorder(clock=clock)
    run_step(rec, clock, HOST_U)
    with pytest.raises(ValueError, match="1 recorded, warmup=1 dropped"):
        rec.profile(warmup=1)
    with pytest.raises(ValueError, match="warmup=-1"):
        rec.profile(warmup=-1)


def test_recorder_refuses_phases_outside_a_step():
    rec = StepRecorder(clock=HandClock())
    with pytest.raises(RuntimeError, match="begin_step"):
        rec.phase("schedule")
    with pytest.raises(RuntimeError, match="without begin_step"):
        rec.end_step(num_rows=0, num_tokens=0, num_decode_rows=0)


def test_recorder_validates_counts():
    rec = StepRecorder(clock=HandClock())
    rec.begin_step()
    with pytest.raises(ValueError, match="num_decode_rows=3 exceeds num_rows=2"):
        rec.end_step(num_rows=2, num_tokens=2, num_decode_rows=3)


def test_an_abandoned_step_is_dropped_and_counted():
    clock = HandClock()
    rec = StepRecorder(clock=clock)
    rec.begin_step()
    with pytest.raises(KeyError), rec.phase("schedule"):  # the exception still propagates
        clock.advance(U)
        raise KeyError("boom")
    run_step(rec, clock, HOST_U)
    assert rec.num_abandoned == 1
    assert len(rec.samples) == 1
    # nothing of the abandoned step leaked in: not its clock, not its schedule phase
    assert rec.samples[0].host_s == 40 * U
    assert [p.name for p in rec.samples[0].phases] == list(PHASES)
    assert rec.samples[0].accounted_s == 40 * U


def test_recorder_reset():
    clock = HandClock()
    rec = StepRecorder(clock=clock)
    run_step(rec, clock, HOST_U)
    rec.begin_step()
    rec.reset()
    assert rec.samples == [] and rec.num_abandoned == 0
    with pytest.raises(RuntimeError):
        rec.phase("schedule")  # the open step went too


def test_recorded_profile_feeds_the_arithmetic_and_gates():
    clock = HandClock()
    device = [d * U for _, d in STEP.values()]
    rec = StepRecorder(clock=clock, device_timer=ScriptedDeviceTimer(clock, device * 3))
    for _ in range(3):
        run_step(rec, clock, HOST_U)
    p = rec.profile(warmup=1)
    for gate in (check_warmed_up, check_accounted, check_attributable, check_device_timed):
        gate(p)
    assert speedup_if(p, overhead_factor=math.inf) == 40 / 23
    assert [ph.name for ph in p.hotspots(1)] == ["sample"]


# ----------------------------------------------------------------------------- tier 4: the null recorder


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


def test_instrument_cost_measurements_return_positive_floats():
    # Measurement only: the relative cost is reported by profbench, never asserted here.
    for measure in (null_recorder_cost_s, step_recorder_cost_s):
        cost = measure(200)
        assert isinstance(cost, float) and cost > 0.0
    with pytest.raises(ValueError, match="n_steps=0"):
        null_recorder_cost_s(0)


# ----------------------------------------------------------------------------- CUDA device timer


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a box without CUDA")
def test_cuda_event_timer_refuses_without_cuda():
    with pytest.raises(RuntimeError, match="torch.cuda.is_available"):
        CudaEventTimer()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda.is_available() is False")
def test_cuda_event_timer_times_device_work():
    assert profiler.CudaDeviceTimer is CudaEventTimer
    rec = StepRecorder(device_timer=CudaEventTimer())
    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    for _ in range(3):
        rec.begin_step()
        with rec.phase("schedule"):
            pass
        with rec.phase("forward"):
            for _ in range(10):
                a = (a @ a).tanh_()
        with rec.phase("collect", syncs=True):
            int(a[0, 0].item() > 0)
        rec.end_step(num_rows=1, num_tokens=1, num_decode_rows=1)
    p = rec.profile(warmup=1)
    check_device_timed(p)
    check_attributable(p)  # the synchronising stop keeps host time around the work
    forward = p.phase_means["forward"]
    assert forward.device_s > 0.0
    assert forward.device_s > p.phase_means["schedule"].device_s
