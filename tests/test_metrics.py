"""nanoserve.instruments.metrics: records and run metrics from hand-placed stamps, checked against
arithmetic done by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nanoserve.instruments.metrics import (
    Summary,
    benchmark_metrics,
    percentile,
    request_metrics,
    run_duration,
    summarize,
)
from nanoserve.request import RequestOutput


def make_output(
    rid="r",
    prompt_len=3,
    arrival=10.0,
    scheduled=10.5,
    token_times=(11.0, 11.25, 11.75, 12.0),
    finished=True,
    finish_reason="length",
    running_s=1.5,
) -> RequestOutput:
    """A RequestOutput placed on a ruler: first token = token_times[0], finish = token_times[-1]."""
    times = list(token_times)
    return RequestOutput(
        request_id=rid,
        prompt_token_ids=list(range(prompt_len)),
        token_ids=[7] * len(times),
        text="",
        finished=finished,
        finish_reason=finish_reason if finished else None,
        arrival_time=arrival,
        first_scheduled_time=scheduled,
        first_token_time=times[0] if times else None,
        finished_time=times[-1] if finished and times else None,
        token_times=times,
        running_s=running_s,
    )


# ---- one request -------------------------------------------------------------------------------


def test_request_metrics_by_hand():
    m = request_metrics(make_output())
    # arrival 10.0, scheduled 10.5, tokens at 11.0 11.25 11.75 12.0, finished 12.0
    assert m.request_id == "r"
    assert m.num_prompt_tokens == 3
    assert m.num_output_tokens == 4
    assert m.queue_s == 0.5
    assert m.ttft_s == 1.0
    assert m.e2e_s == 2.0
    assert m.itl_s == (0.25, 0.5, 0.25)
    # vLLM: (E2E - TTFT) / (n - 1) = (2.0 - 1.0) / 3
    assert m.tpot_s == 1.0 / 3.0
    assert m.running_s == 1.5


def test_tpot_equals_mean_itl_when_finish_is_the_last_token():
    # An independent route to the same number: with finish stamped at the last token, the n - 1
    # gaps sum to E2E - TTFT, so TPOT is their mean.
    m = request_metrics(make_output(token_times=(1.0, 1.5, 3.0, 3.25, 4.0), arrival=0.0, scheduled=0.25))
    assert m.tpot_s == pytest.approx(sum(m.itl_s) / len(m.itl_s), rel=1e-15)
    assert m.tpot_s == 0.75


def test_tpot_counts_time_after_the_last_token():
    # finished stamped later than the last token: TPOT uses E2E, the ITLs do not see the tail.
    out = make_output(arrival=0.0, scheduled=0.0, token_times=(1.0, 2.0, 3.0))
    out.finished_time = 5.0
    m = request_metrics(out)
    assert m.tpot_s == (5.0 - 1.0) / 2
    assert m.itl_s == (1.0, 1.0)


def test_one_token_output_has_no_tpot_and_no_itl():
    m = request_metrics(make_output(token_times=(11.0,), running_s=0.5))
    assert m.tpot_s is None
    assert m.itl_s == ()
    assert m.ttft_s == 1.0
    assert m.e2e_s == 1.0


def test_unfinished_request_has_no_e2e_and_no_tpot():
    m = request_metrics(make_output(finished=False, token_times=(11.0, 11.5)))
    assert m.e2e_s is None
    assert m.tpot_s is None
    assert m.ttft_s == 1.0
    assert m.itl_s == (0.5,)


def test_never_scheduled_request_has_no_queue_time():
    m = request_metrics(make_output(scheduled=None, finished=False, token_times=()))
    assert m.queue_s is None
    assert m.ttft_s is None
    assert m.num_output_tokens == 0


def test_token_times_must_match_output_tokens():
    out = make_output()
    out.token_times = out.token_times[:-1]
    with pytest.raises(ValueError, match="3 token_times for 4 output tokens"):
        request_metrics(out)


def test_stamp_before_arrival_is_refused():
    with pytest.raises(ValueError, match="first_scheduled_time=9.0 is before arrival_time=10.0"):
        request_metrics(make_output(scheduled=9.0))


def test_token_times_going_backwards_are_refused():
    with pytest.raises(ValueError, match=r"token_times\[2\]=11.1"):
        request_metrics(make_output(token_times=(11.0, 11.25, 11.1, 12.0)))


def test_negative_running_s_is_refused():
    with pytest.raises(ValueError, match="running_s=-1.0"):
        request_metrics(make_output(running_s=-1.0))


def test_running_longer_than_in_the_system_is_refused():
    # finished 2 s after arrival, so it cannot have held a slot for 2.5 s
    with pytest.raises(ValueError, match=r"request r: served_s=2.5 must be > 0 and <= e2e_s=2.0"):
        request_metrics(make_output(running_s=2.5))


def test_the_record_carries_the_outputs_stamps():
    m = request_metrics(make_output())
    assert (m.arrival_s, m.first_scheduled_s, m.first_token_s, m.finished_s) == (10.0, 10.5, 11.0, 12.0)
    assert m.token_times == (11.0, 11.25, 11.75, 12.0) and m.token_ids == (7, 7, 7, 7)
    assert m.prefill_s == 0.5  # first token 11.0 - first scheduled 10.5
    assert m.decode_tok_per_s == 3.0  # 3 tokens after the first in 1 s


# ---- summaries ---------------------------------------------------------------------------------


def test_percentile_by_hand():
    # four values: rank = q/100 * 3
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # rank 1.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 0) == 1.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0
    assert percentile([0.0, 10.0], 25) == 2.5
    assert percentile([5.0], 99) == 5.0


def test_percentile_matches_numpy_linear():
    rng = np.random.default_rng(0)
    values = rng.exponential(size=101).tolist()
    for q in (1, 50, 90, 99, 99.9):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError, match="at least 1 value"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"q=101 must be within \[0, 100\]"):
        percentile([1.0], 101)


def test_summarize_by_hand():
    s = summarize([1.0, 2.0, 3.0, 10.0])
    assert s.count == 4
    assert s.mean == 4.0
    assert s.median == 2.5
    # p99: rank 0.99 * 3 = 2.97 -> 3 + 0.97 * 7
    assert s.p99 == pytest.approx(3.0 + 0.97 * 7.0, rel=1e-12)


def test_summarize_empty_and_nonfinite():
    assert summarize([]) == Summary(mean=None, median=None, p99=None, count=0)
    with pytest.raises(ValueError, match="nan"):
        summarize([1.0, math.nan])


# ---- a run ------------------------------------------------------------------------------------


def run_outputs():
    # two completed requests and one aborted, on a ruler from 0.0
    a = make_output("a", prompt_len=2, arrival=0.0, scheduled=0.0, token_times=(1.0, 2.0, 3.0))
    b = make_output("b", prompt_len=4, arrival=0.0, scheduled=1.0, token_times=(2.0, 2.5), running_s=0.5)
    c = make_output("c", prompt_len=8, arrival=0.5, scheduled=0.5, token_times=(1.0,), finish_reason="abort")
    return [a, b, c]


def test_benchmark_metrics_by_hand():
    bm = benchmark_metrics(run_outputs(), duration_s=4.0)
    assert bm.completed == 2  # the aborted one does not count
    assert bm.total_input_tokens == 2 + 4
    assert bm.total_output_tokens == 3 + 2
    assert bm.request_throughput == 0.5
    assert bm.output_throughput == 1.25
    # TTFT: a 1.0, b 2.0
    assert (bm.ttft.mean, bm.ttft.median, bm.ttft.count) == (1.5, 1.5, 2)
    # queue: a 0.0, b 1.0
    assert bm.queue.mean == 0.5
    # TPOT: a (3 - 1) / 2 = 1.0, b (2.5 - 2) / 1 = 0.5
    assert (bm.tpot.mean, bm.tpot.count) == (0.75, 2)
    # ITLs pooled: a 1.0, 1.0; b 0.5
    assert bm.itl.count == 3
    assert bm.itl.median == 1.0
    assert bm.itl.mean == 2.5 / 3
    # E2E: a 3.0, b 2.5
    assert bm.e2e.mean == 2.75
    assert bm.duration_s == 4.0


def test_benchmark_metrics_excludes_one_token_outputs_from_tpot():
    outs = [make_output("x", token_times=(11.0,), running_s=0.5), make_output("y")]
    bm = benchmark_metrics(outs, duration_s=2.0)
    assert bm.tpot.count == 1
    assert bm.tpot.mean == 1.0 / 3.0
    assert bm.ttft.count == 2


def test_benchmark_metrics_rejects_nonpositive_duration():
    with pytest.raises(ValueError, match="duration_s=0.0 must be > 0"):
        benchmark_metrics(run_outputs(), 0.0)


def test_run_duration_is_first_arrival_to_last_finish():
    assert run_duration(run_outputs()) == 3.0
    with pytest.raises(ValueError, match="at least 1 finished output"):
        run_duration([make_output(finished=False)])


# ---- on a real engine ---------------------------------------------------------------------------


def test_metrics_on_a_real_engine_run(tiny_engine):
    from nanoserve import SamplingParams

    engine = tiny_engine(max_num_seqs=2)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = engine.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]], params)
    per = [request_metrics(o) for o in outs]
    for o, m in zip(outs, per, strict=True):
        assert m.num_output_tokens == 5
        assert len(m.itl_s) == 4
        assert m.queue_s >= 0 and m.ttft_s >= m.queue_s and m.e2e_s >= m.ttft_s
        # the engine stamps finish at the last token, so TPOT is the mean ITL
        assert m.tpot_s == pytest.approx(sum(m.itl_s) / 4, rel=1e-9)
        assert 0 < m.running_s <= m.e2e_s
        assert o.finished_time == o.token_times[-1]
    # two slots, three requests: the third waited for a slot
    assert per[2].queue_s > per[0].queue_s
    bm = benchmark_metrics(outs, run_duration(outs))
    assert bm.completed == 3 and bm.total_output_tokens == 15 and bm.total_input_tokens == 9
