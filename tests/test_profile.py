"""nanoserve.instruments.profile: StepProfile's per-step quantities on hand-placed numbers.

Times are multiples of U = 2**-10 s so that sums are exact in binary floating point; every
expected value below is worked out by hand in the comment beside it. The helpers that build a
profile (STEP, make_phases, make_sample, make_profile) are shared with the other profiler tests.
"""

from __future__ import annotations

import pytest

from nanoserve.instruments.profile import StepProfile
from nanoserve.recorder import PHASES, Phase, StepSample

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
