"""nanoserve.instruments.load: workloads, Poisson arrivals, driving an engine, and the offered-load check."""

from __future__ import annotations

import math
import statistics

import pytest

from nanoserve.instruments.load import (
    Concurrency,
    OfferedLoadError,
    Workload,
    check_offered_load,
    concurrency,
    drive,
    offline_workload,
    poisson_arrivals,
    ragged_workload,
    rate_sweep,
)
from nanoserve.request import RequestOutput


def interval_output(rid, arrival, scheduled, finished) -> RequestOutput:
    """A finished one-token output whose only stamps that matter here are the three given."""
    return RequestOutput(
        request_id=rid, prompt_token_ids=[1], token_ids=[5], text="", finished=True,
        finish_reason="length", arrival_time=arrival, first_scheduled_time=scheduled,
        first_token_time=finished, finished_time=finished, token_times=[finished],
        running_s=finished - scheduled,
    )


# ---- workloads ---------------------------------------------------------------------------------


def test_workload_validation():
    with pytest.raises(ValueError, match="2 prompts but 1 output lengths"):
        Workload(prompts=[[1], [2]], output_lens=[3])
    with pytest.raises(ValueError, match="prompt 1 has 0 tokens"):
        Workload(prompts=[[1], []], output_lens=[3, 3])
    with pytest.raises(ValueError, match=r"output_lens\[0\]=0 must be >= 1"):
        Workload(prompts=[[1]], output_lens=[0])


def test_workload_totals():
    w = Workload(prompts=[[1, 2], [3, 4, 5]], output_lens=[4, 6])
    assert (w.num_requests, w.num_prompt_tokens, w.num_output_tokens) == (2, 5, 10)


def test_offline_workload_shape_and_seed():
    w = offline_workload(num_requests=6, prompt_len=9, output_len=4, vocab_size=50, seed=3)
    assert w.num_requests == 6
    assert all(len(p) == 9 for p in w.prompts)
    assert w.output_lens == [4] * 6
    assert all(0 <= t < 50 for p in w.prompts for t in p)
    assert w == offline_workload(6, 9, 4, 50, seed=3)  # fixed seed, same workload
    assert w.prompts != offline_workload(6, 9, 4, 50, seed=4).prompts
    assert len({tuple(p) for p in w.prompts}) == 6  # distinct prompts: no accidental prefix-cache hits
    with pytest.raises(ValueError, match="prompt_len=0 must be >= 1"):
        offline_workload(2, 0, 4, 50)


def test_ragged_workload_bounds():
    # 400 requests over 7 prompt lengths and 5 output lengths: each value, endpoints included, is
    # expected ~57 and ~80 times, so with this fixed seed every one of them must appear.
    w = ragged_workload(400, prompt_len_range=(3, 9), output_len_range=(1, 5), vocab_size=20, seed=0)
    prompt_lens = [len(p) for p in w.prompts]
    assert set(prompt_lens) == set(range(3, 10))
    assert set(w.output_lens) == set(range(1, 6))
    assert all(0 <= t < 20 for p in w.prompts for t in p)
    assert w == ragged_workload(400, (3, 9), (1, 5), 20, seed=0)


def test_ragged_workload_rejects_bad_ranges():
    with pytest.raises(ValueError, match=r"prompt_len_range=\(5, 4\)"):
        ragged_workload(3, (5, 4), (1, 2), 10)
    with pytest.raises(ValueError, match=r"output_len_range=\(0, 4\)"):
        ragged_workload(3, (1, 4), (0, 4), 10)


# ---- arrivals ----------------------------------------------------------------------------------


def test_poisson_arrivals_statistics():
    rate, n = 4.0, 20_001
    offsets = poisson_arrivals(n, rate, seed=0)
    assert len(offsets) == n and offsets[0] == 0.0
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert min(gaps) >= 0
    # Exponential gaps with mean 1/rate = 0.25 have standard deviation 0.25 too, so the mean of
    # 20 000 of them has standard error 0.25 / sqrt(20 000) = 0.00177; 5 standard errors = 0.0089.
    assert abs(statistics.fmean(gaps) - 0.25) < 0.0089
    # The sample standard deviation (relative standard error ~sqrt(8 / n) / 2 = 1% for an
    # exponential) must also be ~0.25: evenly spaced arrivals would have the right mean and 0 here.
    assert abs(statistics.stdev(gaps) - 0.25) < 0.05 * 0.25
    assert offsets == poisson_arrivals(n, rate, seed=0)
    assert offsets != poisson_arrivals(n, rate, seed=1)


def test_poisson_arrivals_scale_with_rate():
    # the same seed draws the same uniforms, so halving the rate exactly doubles every offset
    assert poisson_arrivals(50, 2.0, seed=7) == [2 * x for x in poisson_arrivals(50, 4.0, seed=7)]


def test_poisson_arrivals_infinite_rate_and_bad_rate():
    assert poisson_arrivals(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate=0 must be > 0"):
        poisson_arrivals(3, 0)
    with pytest.raises(ValueError, match="n=0 must be >= 1"):
        poisson_arrivals(0, 1.0)


# ---- the offered-load check on hand-placed intervals -------------------------------------------


def test_concurrency_of_a_serial_run():
    # all three arrive at 0, run one after another; a start at another's finish is not an overlap
    outs = [interval_output("a", 0.0, 0.0, 1.0), interval_output("b", 0.0, 1.0, 2.0),
            interval_output("c", 0.0, 2.0, 3.0)]
    assert concurrency(outs) == Concurrency(max_in_system=3, max_running=1)
    with pytest.raises(OfferedLoadError, match="max running requests 1 < required 2 while 3 were in the system"):
        check_offered_load(outs)


def test_offered_load_error_is_a_value_error():
    assert issubclass(OfferedLoadError, ValueError)


def test_concurrency_of_a_batched_run_passes():
    outs = [interval_output("a", 0.0, 0.0, 2.0), interval_output("b", 0.0, 0.0, 2.0),
            interval_output("c", 0.0, 2.0, 3.0)]
    assert check_offered_load(outs) == Concurrency(max_in_system=3, max_running=2)
    # asking for every one of 3 slots to have been used refuses it
    with pytest.raises(OfferedLoadError, match="max running requests 2 < required 3"):
        check_offered_load(outs, min_running=3)
    # asking for more slots than were ever offered caps at what was offered
    assert check_offered_load(outs, min_running=2).max_running == 2


def test_one_request_at_a_time_is_fine_when_only_one_was_offered():
    outs = [interval_output("a", 0.0, 0.0, 1.0), interval_output("b", 1.5, 1.5, 2.0)]
    assert check_offered_load(outs, min_running=4) == Concurrency(max_in_system=1, max_running=1)


def test_offered_load_needs_finished_outputs():
    out = interval_output("a", 0.0, 0.0, 1.0)
    out.finished = False
    with pytest.raises(ValueError, match="request a is unfinished"):
        check_offered_load([out])
    with pytest.raises(ValueError, match="min_running=0 must be >= 1"):
        check_offered_load([interval_output("a", 0.0, 0.0, 1.0)], min_running=0)


# ---- on a real engine --------------------------------------------------------------------------


def test_drive_offline_returns_every_output_in_order(tiny_engine):
    engine = tiny_engine(max_num_seqs=4)
    w = ragged_workload(5, (2, 6), (1, 4), vocab_size=90, seed=1)
    outs = drive(engine, w)
    assert [o.prompt_token_ids for o in outs] == w.prompts
    assert [len(o.token_ids) for o in outs] == w.output_lens  # ignore_eos, max_tokens = output length
    assert all(o.finish_reason == "length" for o in outs)
    assert len({o.arrival_time for o in outs}) == 1  # offline: one instant for every request
    assert not engine.has_unfinished()


def test_drive_with_arrivals_never_adds_a_request_early(tiny_engine):
    engine = tiny_engine(max_num_seqs=4)
    w = offline_workload(3, 3, 2, vocab_size=90)
    offsets = [0.0, 0.05, 0.1]
    outs = drive(engine, w, offsets)
    base = outs[0].arrival_time
    for o, off in zip(outs, offsets, strict=True):
        assert o.arrival_time - base == pytest.approx(off, abs=1e-9)
        assert o.first_scheduled_time >= o.arrival_time


def test_drive_rejects_bad_arrivals_and_a_busy_engine(tiny_engine):
    from nanoserve import SamplingParams

    engine = tiny_engine()
    w = offline_workload(2, 3, 2, vocab_size=90)
    with pytest.raises(ValueError, match="1 arrival offsets for 2 requests"):
        drive(engine, w, [0.0])
    with pytest.raises(ValueError, match="must be sorted"):
        drive(engine, w, [0.5, 0.1])
    engine.add_request([1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="unfinished requests"):
        drive(engine, w)


def test_check_offered_load_on_real_runs(tiny_engine):
    w = offline_workload(4, 4, 3, vocab_size=90)
    serial = drive(tiny_engine(max_num_seqs=1), w)
    with pytest.raises(OfferedLoadError, match="max running requests 1 < required 2 while 4"):
        check_offered_load(serial)
    batched = drive(tiny_engine(max_num_seqs=4), w)
    assert check_offered_load(batched, min_running=4) == Concurrency(max_in_system=4, max_running=4)
    # the two runs produced the same tokens: only the concurrency differs
    assert [o.token_ids for o in serial] == [o.token_ids for o in batched]


def test_rate_sweep_runs_each_rate_on_a_fresh_engine(tiny_engine):
    made = []

    def make_engine():
        made.append(tiny_engine(max_num_seqs=4))
        return made[-1]

    w = offline_workload(3, 3, 2, vocab_size=90)
    results = rate_sweep(make_engine, w, [math.inf, 40.0], seed=0)
    assert len(made) == 2 and made[0] is not made[1]
    assert [(m.completed, m.total_output_tokens, m.total_input_tokens) for m in results] == [(3, 6, 9)] * 2
    # at 40 req/s the last of three arrivals is poisson_arrivals(3, 40.0)[-1] seconds in
    assert results[1].duration_s > poisson_arrivals(3, 40.0, seed=0)[-1]
