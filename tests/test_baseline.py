"""nanoserve.instruments.baseline: runs, their gates and the paired comparison, on records placed
by hand on a ruler. The runners are tested in test_runners.py, the record in test_record.py."""

from __future__ import annotations

import pytest

from nanoserve.instruments.baseline import (
    Comparison,
    RunUnsound,
    SystemRun,
    UnfairComparison,
    check_concurrent,
    check_serial,
    compare,
    first_divergence,
)
from nanoserve.instruments.record import RunRecord


def rec(arrival, first_token, finished, served=None, prefill=None, tokens=(1, 2, 3, 4), prompt_len=6):
    """One request on the ruler. Defaults: served the whole time (serial), prefill = ttft."""
    return RunRecord(
        prompt_len=prompt_len,
        token_ids=tuple(tokens),
        arrival_s=arrival,
        first_token_s=first_token,
        finished_s=finished,
        served_s=finished - arrival if served is None else served,
        prefill_s=first_token - arrival if prefill is None else prefill,
    )


def serial_run(n=8, step=1.0, tokens=(1, 2, 3, 4), system="hf-generate"):
    """n requests one after another, each arriving when the previous finished, each `step` long."""
    records = [rec(i * step, i * step + step / 4, (i + 1) * step, tokens=tokens) for i in range(n)]
    return SystemRun(system, tuple(records), wall_s=n * step, slots=1)


def one_slot_engine_run(n=8, tokens=(1, 2, 3, 4)):
    """The offline gotcha: all n arrive at 0, one slot, request i served during [i, i+1)."""
    records = [rec(0.0, i + 0.25, i + 1.0, served=1.0, prefill=0.25, tokens=tokens) for i in range(n)]
    return SystemRun("nanoserve, 1", tuple(records), wall_s=float(n), slots=1)


def two_slot_run(tokens=(1, 2, 3, 4)):
    """4 requests at 0, 2 slots: r0 r1 served [0, 4), r2 r3 served [4, 8); prefill 1 s each."""
    records = [
        rec(0.0, 1.0, 4.0, served=4.0, prefill=1.0, tokens=tokens),
        rec(0.0, 1.0, 4.0, served=4.0, prefill=1.0, tokens=tokens),
        rec(0.0, 5.0, 8.0, served=4.0, prefill=1.0, tokens=tokens),
        rec(0.0, 5.0, 8.0, served=4.0, prefill=1.0, tokens=tokens),
    ]
    return SystemRun("nanoserve, 2", tuple(records), wall_s=8.0, slots=2)


def full_slot_run(slots, served, wall, n=8, tokens=(1, 2)):
    """n requests at 0 through `slots` slots in waves, each served `served` s; every slot always busy."""
    records = []
    for i in range(n):
        start = (i // slots) * served
        records.append(rec(0.0, start + served / 2, start + served, served=served, prefill=served / 2, tokens=tokens))
    return SystemRun(f"nanoserve, {slots}", tuple(records), wall_s=wall, slots=slots)


def assert_identities_exact(run):
    assert run.throughput == run.batch_occupancy * run.tokens_per_slot_second
    assert run.throughput == run.system_occupancy * run.tokens_per_request_second


def test_two_slot_run_by_hand():
    run = two_slot_run()
    assert run.num_requests == 4
    assert run.output_tokens == 16
    assert run.throughput == 2.0  # 16 tokens / 8 s
    assert run.slot_seconds == 16.0  # 4 x 4 s
    assert run.request_seconds == 24.0  # 4 + 4 + 8 + 8
    assert run.batch_occupancy == 2.0  # 16 / 8
    assert run.system_occupancy == 3.0  # 24 / 8
    assert run.tokens_per_slot_second == 1.0  # 16 / 16
    assert run.tokens_per_request_second == 16 / 24
    assert run.queue_share == pytest.approx(1 / 3, rel=1e-15)  # 8 of 24 request-seconds queued
    assert run.mean_ttft_s == 3.0  # (1 + 1 + 5 + 5) / 4
    assert run.mean_prefill_s == 1.0
    assert_identities_exact(run)


def test_one_slot_occupancy_is_not_batch_size():
    # The bug the seed describes: eight requests handed over at once to one slot. The mean number
    # in the system is (1 + 2 + ... + 8) / 8 = 4.5, the batch is exactly 1.
    run = one_slot_engine_run()
    assert run.batch_occupancy == 1.0
    assert run.system_occupancy == 4.5
    assert run.queue_share == pytest.approx(1 - 8 / 36, rel=1e-15)  # 78%: the seed's "80%" row
    assert run.tokens_per_slot_second == 4.0
    assert run.tokens_per_request_second == 32 / 36
    assert run.throughput == 4.0
    assert_identities_exact(run)


def test_identities_on_a_ragged_hand_run():
    records = (
        rec(0.0, 0.5, 3.0, served=3.0, prefill=0.5, tokens=(1, 2, 3)),
        rec(0.25, 0.5, 1.0, served=0.75, prefill=0.25, tokens=(4,)),
        rec(0.5, 2.0, 5.0, served=4.0, prefill=1.0, tokens=(5, 6, 7, 8, 9)),
    )
    run = SystemRun("ragged", records, wall_s=5.0, slots=2)
    assert run.output_tokens == 9
    assert run.slot_seconds == 7.75
    assert run.request_seconds == 3.0 + 0.75 + 4.5
    assert run.throughput == 1.8
    assert run.batch_occupancy == 1.55
    assert run.throughput == pytest.approx(run.batch_occupancy * run.tokens_per_slot_second, rel=1e-15)
    assert run.throughput == pytest.approx(run.system_occupancy * run.tokens_per_request_second, rel=1e-15)


def test_system_run_validation():
    with pytest.raises(ValueError, match="0 records"):
        SystemRun("x", (), wall_s=1.0)
    with pytest.raises(ValueError, match="wall_s=0.0 must be > 0"):
        SystemRun("x", (rec(0.0, 1.0, 2.0),), wall_s=0.0)
    with pytest.raises(ValueError, match="slots=0"):
        SystemRun("x", (rec(0.0, 1.0, 2.0),), wall_s=2.0, slots=0)


def test_system_run_refuses_a_request_that_has_not_finished():
    running = RunRecord(6, (1, 2), 0.0, 1.0, None, served_s=0.5, prefill_s=0.5)
    with pytest.raises(ValueError, match=r"record 1 has finished_s=None, 2 output tokens"):
        SystemRun("x", (rec(0.0, 1.0, 2.0), running), wall_s=2.0)


def test_mean_tpot_and_decode_rate_by_hand():
    records = (
        rec(0.0, 1.0, 2.0, tokens=(1, 2, 3, 4, 5)),  # TPOT (2 - 1) / 4 = 0.25, 4 tok/s after the first
        rec(0.0, 1.0, 2.0, tokens=(1, 2, 3)),  # TPOT (2 - 1) / 2 = 0.5, 2 tok/s
        rec(0.0, 1.0, 1.0, tokens=(1,)),  # one token: neither
    )
    run = SystemRun("x", records, wall_s=2.0)
    assert run.mean_tpot_s == 0.375  # (0.25 + 0.5) / 2
    assert run.mean_decode_tok_per_s == 3.0  # (4 + 2) / 2, not 1 / 0.375
    single = SystemRun("x", (rec(0.0, 1.0, 1.0, tokens=(1,)),), wall_s=1.0)
    assert single.mean_tpot_s is None and single.mean_decode_tok_per_s is None


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((1, 2, 3), (1, 2, 3), None),
        ((), (), None),
        ((1, 2, 3), (9, 2, 3), 0),
        ((1, 2, 3, 4), (1, 2, 9, 4), 2),
        ((1, 2, 3), (1, 2, 3, 4), 3),  # a strict prefix splits at its own length
        ((1, 2, 3, 4), (1, 2), 2),
        ((), (5,), 0),
    ],
)
def test_first_divergence(a, b, expected):
    assert first_divergence(a, b) == expected
    assert first_divergence(list(a), list(b)) == expected


def test_comparison_factors_by_hand():
    base = serial_run(n=4, step=2.0)  # 16 tokens in 8 s: 2 tok/s, batch 1, 2 tok per slot-second
    cand = two_slot_run()  # 16 tokens in 8 s at batch 2
    c = compare(base, cand)
    assert isinstance(c, Comparison)
    assert c.speedup == 1.0
    assert c.batch_gain == 2.0
    assert c.per_slot_gain == 0.5  # 1 tok/slot-s against 2
    assert c.speedup == c.batch_gain * c.per_slot_gain
    assert c.system_gain == 3.0
    assert c.speedup == pytest.approx(c.system_gain * c.per_request_gain, rel=1e-15)
    # baseline prefill (its ttft) 0.5 s against the engine's 1.0 s
    assert c.prefill_speedup == 0.5
    row = c.as_row()
    assert row["throughput_tok_per_s"] == 2.0 and row["batch_occupancy"] == 2.0 and row["slots"] == 2
    assert all(k in row for k in ("wall_s", "tokens_per_slot_s", "mean_prefill_s", "speedup_x"))


def test_compare_refuses_different_request_counts():
    with pytest.raises(UnfairComparison, match="ran 8 requests but 'nanoserve, 2' ran 4"):
        compare(serial_run(n=8), two_slot_run())


def test_compare_refuses_different_prompt_lengths():
    cand = two_slot_run()
    records = list(cand.records)
    records[2] = rec(0.0, 5.0, 8.0, served=4.0, prefill=1.0, prompt_len=7)
    with pytest.raises(UnfairComparison, match="request 2: prompt length 6 in 'hf-generate' but 7"):
        compare(serial_run(n=4), SystemRun("c", tuple(records), 8.0, 2))


def test_compare_refuses_different_output_lengths():
    cand = two_slot_run()
    records = list(cand.records)
    records[1] = rec(0.0, 1.0, 4.0, served=4.0, prefill=1.0, tokens=(1, 2, 3))
    with pytest.raises(UnfairComparison, match="request 1: output length 4 in 'hf-generate' but 3"):
        compare(serial_run(n=4), SystemRun("c", tuple(records), 8.0, 2))


def test_compare_refuses_different_output_tokens_and_says_where():
    cand = two_slot_run()
    records = list(cand.records)
    records[3] = rec(0.0, 5.0, 8.0, served=4.0, prefill=1.0, tokens=(1, 2, 9, 4))
    with pytest.raises(UnfairComparison, match=r"request 3: output tokens split at position 2 \(3 in 'hf-generate', 9 in 'c'\)"):
        compare(serial_run(n=4), SystemRun("c", tuple(records), 8.0, 2))


def test_unfair_and_unsound_are_value_errors():
    assert issubclass(UnfairComparison, ValueError) and issubclass(RunUnsound, ValueError)


# ---- the gates ----------------------------------------------------------------------------------


def test_check_serial_passes_a_serial_run():
    run = serial_run()
    assert check_serial(run) is run


def test_check_serial_refuses_overlap():
    records = (rec(0.0, 0.5, 2.0), rec(1.0, 1.5, 3.0))
    with pytest.raises(RunUnsound, match="arrived at 1.000000 before the previous one finished at 2.000000"):
        check_serial(SystemRun("s", records, wall_s=3.0))


def test_check_serial_refuses_occupancy_far_from_one():
    records = serial_run(n=4).records  # 4 s of generation
    with pytest.raises(RunUnsound, match=r"batch occupancy 0.5000 is outside 1 \+/- 0.05"):
        check_serial(SystemRun("s", records, wall_s=8.0))
    assert check_serial(SystemRun("s", records, wall_s=4.1)).wall_s == 4.1  # 0.976: within 5%


def test_check_serial_refuses_records_outside_the_wall_clock():
    with pytest.raises(RunUnsound, match="records span 8.000000s but wall_s is 4.000000s"):
        check_serial(SystemRun("s", serial_run().records, wall_s=4.0))


def test_check_concurrent_passes_a_batched_run():
    run = two_slot_run()
    assert check_concurrent(run) is run
    assert check_concurrent(one_slot_engine_run()).slots == 1  # one slot, batch 1: what it claims


def test_check_concurrent_gates_on_batch_not_system_occupancy():
    # The serial-shaped offline run relabelled as four slots. System occupancy is 4.5, which a gate
    # reading it would wave through; batch occupancy is 1.0, so it did not batch.
    run = one_slot_engine_run()
    relabelled = SystemRun("nanoserve, 4", run.records, run.wall_s, slots=4)
    assert relabelled.system_occupancy > 4
    with pytest.raises(RunUnsound, match=r"batch occupancy 1.0000 <= 1.05 with 4 slots and 8 requests"):
        check_concurrent(relabelled)


def test_check_concurrent_refuses_more_rows_than_slots():
    run = two_slot_run()
    with pytest.raises(RunUnsound, match="batch occupancy 2.0000 exceeds 1 slots"):
        check_concurrent(SystemRun("x", run.records, run.wall_s, slots=1))


def test_check_concurrent_allows_one_request_at_many_slots():
    run = SystemRun("x", (rec(0.0, 0.5, 2.0),), wall_s=2.0, slots=4)
    assert check_concurrent(run) is run
