"""nanoserve.instruments.recording: the recorder on a hand clock with a scripted device timer, what
a recorder costs, and the CUDA event timer. Engine-loop tests live with the engine.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_profile import STEP, U

from nanoserve import profiler
from nanoserve.instruments.profile_gates import (
    check_accounted,
    check_attributable,
    check_device_timed,
    check_warmed_up,
)
from nanoserve.instruments.profile_pricing import (
    speedup_if,
)
from nanoserve.instruments.recording import (
    CudaEventTimer,
    StepRecorder,
    null_recorder_cost_s,
    step_recorder_cost_s,
)
from nanoserve.recorder import PHASES


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


def test_instrument_cost_measurements_return_positive_floats():
    # Measurement only: the relative cost is reported by profbench, never asserted here.
    for measure in (null_recorder_cost_s, step_recorder_cost_s):
        cost = measure(200)
        assert isinstance(cost, float) and cost > 0.0
    with pytest.raises(ValueError, match="n_steps=0"):
        null_recorder_cost_s(0)


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
