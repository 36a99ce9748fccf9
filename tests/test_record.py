"""nanoserve.instruments.record: the one per-request record and the one TPOT, on stamps placed by hand.

Every stamp is a multiple of 1/4, so the differences below are exact in binary floating point and
the expected values are worked out by hand in the comment beside them.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest

from nanoserve.instruments.metrics import RequestMetrics
from nanoserve.instruments.record import RunRecord, decode_rate, tpot


def record(**changes):
    """A finished request: arrival 10, first slot 10.5, tokens at 11, 11.25, 11.75, 12, finished 12."""
    fields = dict(prompt_len=3, token_ids=(7, 8, 9, 10), arrival_s=10.0, first_token_s=11.0, finished_s=12.0,
                  served_s=1.5, prefill_s=0.5, request_id="r", first_scheduled_s=10.5,
                  token_times=(11.0, 11.25, 11.75, 12.0))
    return RunRecord(**(fields | changes))


# ---- TPOT and the decode rate --------------------------------------------------------------------


def test_tpot_by_hand():
    assert tpot(5, 1.0, 2.0) == 0.25  # (2 - 1) / (5 - 1)
    assert tpot(3, 0.5, 2.0) == 0.75  # (2 - 0.5) / 2
    assert tpot(1, 1.0, 2.0) is None  # one token: no time per token after the first
    assert tpot(0, None, 2.0) is None
    assert tpot(4, 1.0, None) is None  # still running


def test_decode_rate_by_hand():
    assert decode_rate(5, 1.0, 2.0) == 4.0  # (5 - 1) / (2 - 1)
    assert decode_rate(3, 0.5, 2.0) == 2 / 1.5
    assert decode_rate(1, 1.0, 2.0) is None
    assert decode_rate(4, 1.0, 1.0) is None  # every token at once: TPOT 0, no finite rate
    assert decode_rate(4, None, 1.0) is None


# ---- derived latencies ---------------------------------------------------------------------------


def test_record_latencies_by_hand():
    r = record()
    assert (r.ttft_s, r.e2e_s, r.queue_s, r.queued_s) == (1.0, 2.0, 0.5, 0.5)  # queued: e2e 2 - served 1.5
    assert r.itl_s == (0.25, 0.5, 0.25)
    assert r.tpot_s == 1.0 / 3.0  # (2 - 1) / 3
    assert r.decode_tok_per_s == 3.0  # 3 / (2 - 1)
    assert (r.output_len, r.num_output_tokens, r.num_prompt_tokens, r.running_s) == (4, 4, 3, 1.5)


def test_record_derived_times():
    r = RunRecord(6, (1, 2, 3, 4), 2.0, 3.5, 6.0, served_s=3.0, prefill_s=0.5)
    assert (r.ttft_s, r.e2e_s, r.queued_s, r.output_len) == (1.5, 4.0, 1.0, 4)
    assert r.queue_s is None and r.itl_s is None  # a runner that did not record them
    assert r.tpot_s == 2.5 / 3  # (4 - 1.5) / 3


def test_a_running_request_has_no_finish_latencies():
    r = record(finished_s=None, token_ids=(7, 8), token_times=(11.0, 11.25))
    assert (r.ttft_s, r.e2e_s, r.queued_s, r.tpot_s, r.decode_tok_per_s) == (1.0, None, None, None, None)
    assert r.itl_s == (0.25,)


def test_a_request_never_scheduled_has_no_latencies():
    r = record(token_ids=(), first_token_s=None, finished_s=None, served_s=0.0, prefill_s=None,
               first_scheduled_s=None, token_times=())
    assert (r.queue_s, r.ttft_s, r.e2e_s, r.tpot_s, r.output_len) == (None, None, None, None, 0)
    assert r.itl_s == ()


def test_an_abort_before_the_first_token_held_no_slot():
    r = record(token_ids=(), first_token_s=None, served_s=0.0, prefill_s=None, first_scheduled_s=None,
               token_times=())
    assert (r.e2e_s, r.ttft_s, r.queued_s) == (2.0, None, 2.0)


def test_request_metrics_is_the_record():
    assert RequestMetrics is RunRecord


def test_record_round_trips_through_a_dict():
    # benches store runs as JSON: asdict turns tuples into lists on the way out
    r = record()
    as_json = asdict(r) | {"token_ids": list(r.token_ids), "token_times": list(r.token_times)}
    assert RunRecord(**as_json) == r


# ---- validation ----------------------------------------------------------------------------------


def test_record_validation():
    with pytest.raises(ValueError, match="stamps out of order"):
        RunRecord(6, (1, 2, 3, 4), 1.0, 0.5, 2.0, served_s=1.0, prefill_s=None)
    with pytest.raises(ValueError, match=r"served_s=5.0 must be > 0 and <= e2e_s=2.0"):
        RunRecord(6, (1, 2, 3, 4), 0.0, 1.0, 2.0, served_s=5.0, prefill_s=1.0)
    with pytest.raises(ValueError, match="served_s=0.0"):
        RunRecord(6, (1, 2, 3, 4), 0.0, 1.0, 2.0, served_s=0.0, prefill_s=1.0)
    with pytest.raises(ValueError, match=r"prefill_s=1.5 must be >= 0 and <= ttft_s=1.0"):
        RunRecord(6, (1, 2, 3, 4), 0.0, 1.0, 2.0, served_s=2.0, prefill_s=1.5)
    with pytest.raises(ValueError, match="at least 1 output token"):
        RunRecord(6, (), 0.0, 1.0, 2.0, served_s=2.0, prefill_s=1.0)
    with pytest.raises(ValueError, match="prompt_len=0"):
        RunRecord(0, (1, 2, 3, 4), 0.0, 1.0, 2.0, served_s=2.0, prefill_s=1.0)


def test_record_refuses_an_impossible_history():
    with pytest.raises(ValueError, match=r"request r: 2 output tokens but first_token_s=None"):
        record(token_ids=(7, 8), first_token_s=None, token_times=None, prefill_s=None)
    with pytest.raises(ValueError, match=r"first_scheduled_s=11.5 <= first_token_s=11.0"):
        record(first_scheduled_s=11.5)
    with pytest.raises(ValueError, match=r"request r: 3 token_times for 4 output tokens"):
        record(token_times=(11.0, 11.25, 11.75))
    with pytest.raises(ValueError, match=r"token_times\[2\]=11.0 is before token_times\[1\]=11.25"):
        record(token_times=(11.0, 11.25, 11.0, 12.0))
    with pytest.raises(ValueError, match=r"served_s=-0.25 must be >= 0"):
        record(finished_s=None, served_s=-0.25)
    with pytest.raises(ValueError, match=r"served_s=2.25 must be > 0 and <= e2e_s=2.0"):
        record(served_s=2.25)
    with pytest.raises(ValueError, match=r"prefill_s=0.5 must be >= 0 and <= ttft_s=None"):
        record(token_ids=(), first_token_s=None, token_times=(), served_s=0.0)


def test_served_may_exceed_e2e_by_float_rounding_only():
    e2e = 2.0
    record(served_s=e2e * (1 + 1e-12))  # a sum of intervals a rounding above their span
    with pytest.raises(ValueError, match="must be > 0 and <= e2e_s"):
        record(served_s=e2e * (1 + 1e-6))
