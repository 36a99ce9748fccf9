"""nanoserve.instruments.sync: the sync arithmetic and syncbench's table, every expected number worked
by hand in the comment beside it."""

from __future__ import annotations

import math

import pytest

from nanoserve.instruments.sync import (
    STRATEGIES,
    SyncMeasurement,
    overshoot_tokens,
    readback_s,
    render,
    sample_ceiling,
    saving_per_step,
    strategy_speedup,
    syncs_per_step,
)


def test_strategies():
    assert STRATEGIES == ("per_row", "one_tensor", "deferred")


@pytest.mark.parametrize("slots", [1, 2, 4, 8])
def test_syncs_per_step_reproduces_the_seed_table(slots):
    # greedy: 1 / 1 at every batch; top-p: slots / 1.
    assert syncs_per_step(slots, "per_row", num_greedy=slots) == 1.0
    assert syncs_per_step(slots, "one_tensor", num_greedy=slots) == 1.0
    assert syncs_per_step(slots, "per_row") == float(slots)
    assert syncs_per_step(slots, "one_tensor") == 1.0


def test_syncs_per_step_per_row_counts_each_sampled_row_and_the_greedy_group_once():
    assert syncs_per_step(9, "per_row", num_greedy=1) == 9.0  # the seed's nine: 8 int() + 1 tolist
    assert syncs_per_step(8, "per_row", num_greedy=3) == 6.0  # 5 sampled + 1 greedy group
    assert syncs_per_step(8, "per_row", num_greedy=7) == 2.0  # 1 sampled + 1 greedy group


def test_syncs_per_step_deferred_leaves_none_on_the_critical_path():
    assert syncs_per_step(8, "deferred") == 0.0
    assert syncs_per_step(8, "deferred", window=4) == 0.0
    assert syncs_per_step(1, "deferred", num_greedy=1) == 0.0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_syncs_per_step_is_zero_when_nothing_was_sampled(strategy):
    assert syncs_per_step(0, strategy) == 0.0


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"rows": 4, "strategy": "per_batch"}, r"strategy='per_batch' is not one of"),
        ({"rows": -1, "strategy": "per_row"}, r"rows=-1 must be >= 0"),
        ({"rows": 4, "strategy": "per_row", "num_greedy": 5}, r"num_greedy=5 must be in \[0, rows=4\]"),
        ({"rows": 4, "strategy": "per_row", "num_greedy": -1}, r"num_greedy=-1"),
        ({"rows": 4, "strategy": "deferred", "window": 0}, r"window=0 must be >= 1"),
    ],
)
def test_syncs_per_step_refuses_bad_input(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        syncs_per_step(**kwargs)


def test_overshoot_tokens():
    assert overshoot_tokens("deferred") == 1  # the seed's one token past a stop condition
    assert overshoot_tokens("deferred", window=3) == 3
    assert overshoot_tokens("one_tensor") == 0
    assert overshoot_tokens("per_row", window=5) == 0
    with pytest.raises(ValueError, match=r"window=0"):
        overshoot_tokens("deferred", window=0)
    with pytest.raises(ValueError, match=r"strategy='async'"):
        overshoot_tokens("async")


def test_readback_s_prices_the_count():
    assert readback_s(8, 0.25) == 2.0  # 8 x 0.25
    assert readback_s(1, 50e-6) == 50e-6
    assert readback_s(0, 1.0) == 0.0
    assert readback_s(0.5, 0.5) == 0.25  # amortised counts are allowed


@pytest.mark.parametrize(
    "syncs, per_transfer_s, pattern",
    [
        (-1, 0.1, r"syncs=-1 must be finite and >= 0"),
        (math.inf, 0.1, r"syncs=inf"),
        (1, -0.1, r"per_transfer_s=-0.1 must be finite and >= 0"),
        (1, math.nan, r"per_transfer_s=nan"),
    ],
)
def test_readback_s_refuses_bad_input(syncs, per_transfer_s, pattern):
    with pytest.raises(ValueError, match=pattern):
        readback_s(syncs, per_transfer_s)


def test_saving_per_step_is_zero_for_the_greedy_path_on_purpose():
    # Greedy rows were already one batched .tolist(): 1 sync became 1 sync.
    for rows in (1, 2, 4, 8):
        assert saving_per_step(rows, 50e-6, num_greedy=rows) == 0.0


def test_saving_per_step_for_sampled_rows():
    assert saving_per_step(8, 0.25) == 1.75  # (8 - 1) x 0.25
    assert saving_per_step(1, 0.25) == 0.0  # one row was already one journey
    assert saving_per_step(8, 0.25, num_greedy=3) == 1.25  # (6 - 1) x 0.25
    assert saving_per_step(8, 0.25, before="per_row", after="deferred") == 2.0  # (8 - 0) x 0.25
    assert saving_per_step(8, 0.25, num_greedy=8, before="one_tensor", after="deferred") == 0.25
    assert saving_per_step(8, 0.25, before="one_tensor", after="per_row") == -1.75


def test_strategy_speedup():
    # 8 top-p rows at 0.25 s a journey save 1.75 s of a 4 s step: 4 / 2.25 = 16/9.
    assert strategy_speedup(4.0, 8, 0.25) == pytest.approx(16 / 9, rel=1e-12)
    # deferring the last sync of a 2 s step at 0.5 s a journey: 2 / 1.5 = 4/3.
    assert strategy_speedup(2.0, 4, 0.5, before="one_tensor", after="deferred") == pytest.approx(
        4 / 3, rel=1e-12
    )
    assert strategy_speedup(4.0, 8, 0.25, num_greedy=8) == 1.0
    # the reverse change is a slowdown: 2.25 / 4.
    assert strategy_speedup(2.25, 8, 0.25, before="one_tensor", after="per_row") == pytest.approx(
        2.25 / 4.0, rel=1e-12
    )


def test_strategy_speedup_refuses_a_step_too_short_for_its_syncs():
    with pytest.raises(ValueError, match=r"step_s=1.0 must exceed the 8 readbacks it contains"):
        strategy_speedup(1.0, 8, 0.25)  # 8 x 0.25 = 2 s of syncs in a 1 s step
    with pytest.raises(ValueError, match=r"step_s=0 must be > 0"):
        strategy_speedup(0, 8, 0.25)


def test_sample_ceiling():
    # The seed's profbench loop at one row: 0.577 ms, sample 0.505 ms of it: 0.577 / 0.072 = 577/72.
    assert sample_ceiling(0.577e-3, 0.505e-3) == pytest.approx(577 / 72, rel=1e-9)
    # The whole step: 307.885 ms with the same sample phase: 307885 / 307380.
    assert sample_ceiling(307.885e-3, 0.505e-3) == pytest.approx(307885 / 307380, rel=1e-12)
    assert sample_ceiling(2.0, 1.5) == 4.0  # 2 / 0.5
    assert sample_ceiling(2.0, 0.0) == 1.0


@pytest.mark.parametrize(
    "step_s, sample_s, pattern",
    [
        (1.0, 1.0, r"sample_s=1.0 must be in \[0, step_s=1.0\)"),
        (1.0, 1.5, r"sample_s=1.5"),
        (1.0, -0.1, r"sample_s=-0.1"),
        (0.0, 0.0, r"step_s=0.0 must be > 0"),
    ],
)
def test_sample_ceiling_refuses_bad_input(step_s, sample_s, pattern):
    with pytest.raises(ValueError, match=pattern):
        sample_ceiling(step_s, sample_s)


def test_render_reproduces_the_seed_table():
    measurements = [
        SyncMeasurement(1, "greedy", 0.193e-3, 0.145e-3, 1, 1),
        SyncMeasurement(8, "greedy", 0.680e-3, 0.358e-3, 1, 1),
        SyncMeasurement(1, "top-p", 14.525e-3, 14.504e-3, 1, 1),
        SyncMeasurement(2, "top-p", 19.481e-3, 19.208e-3, 2, 1),
        SyncMeasurement(4, "top-p", 28.993e-3, 28.708e-3, 4, 1),
        SyncMeasurement(8, "top-p", 60.900e-3, 59.592e-3, 8, 1),
    ]
    # Copied from the seed's syncbench table (its other greedy rows divide unrounded medians).
    assert render(measurements).splitlines() == [
        "slots   params      per row    one tensor    faster    syncs before/after",
        "  1     greedy     0.193ms       0.145ms      1.33x           1 / 1",
        "  8     greedy     0.680ms       0.358ms      1.90x           1 / 1",
        "  1     top-p     14.525ms      14.504ms      1.00x           1 / 1",
        "  2     top-p     19.481ms      19.208ms      1.01x           2 / 1",
        "  4     top-p     28.993ms      28.708ms      1.01x           4 / 1",
        "  8     top-p     60.900ms      59.592ms      1.02x           8 / 1",
    ]


def test_render_of_nothing_is_the_header():
    assert render([]) == "slots   params      per row    one tensor    faster    syncs before/after"


def test_sync_measurement():
    assert SyncMeasurement(4, "greedy", 0.6, 0.3, 1, 1).speedup == 2.0
    with pytest.raises(ValueError, match=r"one_tensor_s=0.0 must both be > 0"):
        SyncMeasurement(4, "greedy", 0.6, 0.0, 1, 1)
