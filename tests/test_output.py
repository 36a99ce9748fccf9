"""nanoserve.output: the readback layer, its arithmetic and its gates.

Every expected number below is worked by hand in the comment beside it. The tests that matter
most are about an operation that must not happen: the ``no_readback`` fixture (conftest) turns every way
a tensor's value can reach Python into an exception, so "did not read back" can fail.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ReadbackHappened

from nanoserve.output import (
    MIN_MEASURABLE_S,
    STRATEGIES,
    NotDeviceResident,
    NotMeasurable,
    NotSingleTransfer,
    OutputProcessor,
    Readback,
    RowOrderMismatch,
    SyncMeasurement,
    TokenBatch,
    check_device_resident,
    check_in_row_order,
    check_measurable,
    check_single_transfer,
    measure_transfer_s,
    overshoot_tokens,
    readback_s,
    render,
    sample_ceiling,
    saving_per_step,
    strategy_speedup,
    syncs_per_step,
)


def _batch(ids: list[int], request_ids: tuple[str, ...], readback: Readback | None = None) -> TokenBatch:
    return TokenBatch(torch.tensor(ids, dtype=torch.int64), request_ids, readback or Readback())


# --------------------------------------------------------------------------------------------
# The fixture itself: a test of "did not read back" is only worth something if it can fail
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.tolist(),
        lambda t: t[0].item(),
        lambda t: int(t[0]),
        lambda t: float(t[0]),
        lambda t: bool(t[0]),
        lambda t: [10, 20, 30][t[0]],
        repr,
    ],
    ids=["tolist", "item", "int", "float", "bool", "index", "repr"],
)
def test_no_readback_fixture_catches_every_route(no_readback, read):
    tokens = torch.tensor([2, 1, 0], dtype=torch.int64)
    with pytest.raises(ReadbackHappened):
        read(tokens)


def test_counted_tolist_fixture_counts_and_forbids_the_rest(counted_tolist):
    tokens = torch.tensor([4, 5], dtype=torch.int64)
    assert tokens.tolist() == [4, 5]
    assert tokens.tolist() == [4, 5]
    assert counted_tolist["tolist"] == 2
    with pytest.raises(ReadbackHappened):
        int(tokens[0])


# --------------------------------------------------------------------------------------------
# Readback
# --------------------------------------------------------------------------------------------


def test_readback_counts_journeys_and_elements():
    readback = Readback()
    assert (readback.journeys, readback.elements) == (0, 0)
    assert readback.fetch(torch.tensor([7, 8, 9])) == [7, 8, 9]
    assert (readback.journeys, readback.elements) == (1, 3)
    assert readback.fetch(torch.tensor([1, 2])) == [1, 2]
    assert (readback.journeys, readback.elements) == (2, 5)  # 3 + 2 elements
    readback.reset()
    assert (readback.journeys, readback.elements) == (0, 0)


def test_readback_fetch_is_exactly_one_tolist(counted_tolist):
    readback = Readback()
    readback.fetch(torch.tensor([3, 1, 4, 1]))
    assert counted_tolist["tolist"] == 1
    assert readback.journeys == 1


def test_readback_does_not_count_a_failed_fetch(no_readback):
    readback = Readback()
    with pytest.raises(ReadbackHappened):
        readback.fetch(torch.tensor([1, 2]))
    assert (readback.journeys, readback.elements) == (0, 0)


# --------------------------------------------------------------------------------------------
# TokenBatch
# --------------------------------------------------------------------------------------------


def test_token_batch_resolves_in_row_order():
    batch = _batch([11, 22, 33], ("a", "b", "c"))
    assert len(batch) == 3
    assert batch.request_ids == ("a", "b", "c")
    assert batch.resolve() == [11, 22, 33]


def test_token_batch_resolves_once_however_many_callers():
    readback = Readback()
    batch = _batch([5, 6, 7], ("a", "b", "c"), readback)
    assert not batch.resolved
    assert readback.journeys == 0  # building it made no journey
    for _ in range(4):
        assert batch.resolve() == [5, 6, 7]
    assert batch.resolved
    assert (readback.journeys, readback.elements) == (1, 3)


def test_token_batch_resolve_is_the_one_permitted_transfer(counted_tolist):
    readback = Readback()
    batch = _batch([5, 6, 7], ("a", "b", "c"), readback)
    assert counted_tolist["tolist"] == 0
    for _ in range(3):
        assert batch.resolve() == [5, 6, 7]
    assert counted_tolist["tolist"] == 1
    assert readback.journeys == 1


def test_building_and_passing_a_token_batch_does_not_read_back(no_readback):
    tokens = torch.tensor([9, 8], dtype=torch.int64)
    readback = Readback()

    def hand_on(batch: TokenBatch) -> TokenBatch:
        return batch

    batch = hand_on(TokenBatch(tokens, ("x", "y"), readback))
    assert len(batch) == 2
    assert batch.request_ids == ("x", "y")
    assert not batch.resolved
    check_device_resident(batch.tokens, "cpu")
    check_in_row_order(batch, ["x", "y"])
    text = repr(batch)  # the dataclass default would print the tensor, which calls .item()
    assert "rows=2" in text and "resolved=False" in text
    assert readback.journeys == 0
    with pytest.raises(ReadbackHappened):
        batch.resolve()


def test_token_batch_accepts_a_list_of_ids_as_a_tuple():
    batch = TokenBatch(torch.tensor([1, 2]), ["a", "b"], Readback())
    assert batch.request_ids == ("a", "b")


def test_empty_token_batch_resolves_without_a_journey(no_readback):
    readback = Readback()
    batch = TokenBatch(torch.empty(0, dtype=torch.int64), (), readback)
    assert len(batch) == 0
    assert batch.resolve() == []
    assert batch.resolved
    assert readback.journeys == 0


def test_token_batch_refuses_rows_that_do_not_match_ids():
    with pytest.raises(ValueError, match=r"tokens has 3 rows but request_ids has 2"):
        _batch([1, 2, 3], ("a", "b"))


@pytest.mark.parametrize(
    "tokens, pattern",
    [
        (torch.tensor([[1, 2]]), r"shape \(1, 2\).*must be \[rows\] torch.int64"),
        (torch.tensor([1, 2], dtype=torch.int32), r"dtype torch.int32"),
        ([1, 2], r"tokens is a list, must be a torch.Tensor"),
    ],
    ids=["2-D", "int32", "list"],
)
def test_token_batch_refuses_what_is_not_a_rows_int64_tensor(tokens, pattern):
    with pytest.raises(ValueError, match=pattern):
        TokenBatch(tokens, ("a", "b"), Readback())


# --------------------------------------------------------------------------------------------
# OutputProcessor
# --------------------------------------------------------------------------------------------


def test_processor_hands_each_row_to_its_owner_in_row_order():
    processor = OutputProcessor()
    seen: list[tuple[str, int]] = []
    processor.apply(
        _batch([40, 41, 42], ("r2", "r0", "r1"), processor.readback), lambda r, t: seen.append((r, t))
    )
    assert seen == [("r2", 40), ("r0", 41), ("r1", 42)]


def test_processor_rate_is_zero_before_any_step():
    processor = OutputProcessor()
    assert processor.num_steps == 0
    assert processor.transfers_per_step == 0.0


def test_processor_counts_exactly_one_transfer_per_step(counted_tolist):
    processor = OutputProcessor()
    steps = [([1, 2, 3], ("a", "b", "c")), ([4, 5], ("a", "c")), ([6], ("c",)), ([7, 8], ("c", "d"))]
    seen: list[tuple[str, int]] = []
    for ids, owners in steps:
        processor.apply(_batch(ids, owners, processor.readback), lambda r, t: seen.append((r, t)))
    assert counted_tolist["tolist"] == 4
    assert processor.num_steps == 4
    assert processor.readback.journeys == 4
    assert processor.readback.elements == 8  # 3 + 2 + 1 + 2
    assert processor.transfers_per_step == 1.0
    assert seen == [("a", 1), ("b", 2), ("c", 3), ("a", 4), ("c", 5), ("c", 6), ("c", 7), ("d", 8)]
    check_single_transfer(processor)


def test_processor_does_not_pay_again_for_a_batch_already_resolved():
    processor = OutputProcessor()
    batch = _batch([3, 4], ("a", "b"), processor.readback)
    batch.resolve()  # a log line got there first
    processor.apply(batch, lambda r, t: None)
    assert processor.readback.journeys == 1
    assert processor.transfers_per_step == 1.0


def test_processor_rate_sees_a_readback_made_elsewhere():
    # A caller that re-reads the tensor instead of going through the memo: 2 journeys a step.
    processor = OutputProcessor()
    for step in range(3):
        batch = _batch([step, step + 1], ("a", "b"), processor.readback)
        processor.readback.fetch(batch.tokens)
        processor.apply(batch, lambda r, t: None)
    assert processor.readback.journeys == 6
    assert processor.transfers_per_step == 2.0  # 6 / 3
    with pytest.raises(NotSingleTransfer, match=r"transfers_per_step=2.0 \(6 journeys over 3 steps\)"):
        check_single_transfer(processor)


def test_processor_skips_an_empty_batch_without_a_journey_or_a_step():
    processor = OutputProcessor()
    processor.apply(_batch([1], ("a",), processor.readback), lambda r, t: None)
    calls: list[tuple[str, int]] = []
    processor.apply(
        TokenBatch(torch.empty(0, dtype=torch.int64), (), processor.readback),
        lambda r, t: calls.append((r, t)),
    )
    assert calls == []
    assert processor.num_steps == 1
    assert processor.readback.journeys == 1
    assert processor.transfers_per_step == 1.0


def test_processor_refuses_a_batch_counted_on_another_readback():
    processor = OutputProcessor()
    with pytest.raises(ValueError, match=r"different Readback"):
        processor.apply(_batch([1], ("a",), Readback()), lambda r, t: None)
    assert processor.num_steps == 0


def test_processor_uses_the_readback_it_is_given_and_resets_it():
    readback = Readback()
    processor = OutputProcessor(readback)
    assert processor.readback is readback
    processor.apply(_batch([1, 2], ("a", "b"), readback), lambda r, t: None)
    processor.apply(_batch([3], ("a",), readback), lambda r, t: None)
    assert (processor.num_steps, readback.journeys, readback.elements) == (2, 2, 3)
    processor.reset()
    assert (processor.num_steps, readback.journeys, readback.elements) == (0, 0, 0)
    assert processor.transfers_per_step == 0.0


# --------------------------------------------------------------------------------------------
# The arithmetic
# --------------------------------------------------------------------------------------------


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
    # Day 46's loop at one row: 0.577 ms, sample 0.505 ms of it: 0.577 / 0.072 = 577/72.
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


def _fake_clock(readings: list[float]):
    it = iter(readings)
    return lambda: next(it)


def test_measure_transfer_s_is_the_median_round_trip():
    # round trips of 7, 1 and 2 s: median 2 (the mean would be 10/3, one outlier dragging it).
    assert measure_transfer_s("cpu", n=3, warmup=0, clock=_fake_clock([0, 7, 10, 11, 20, 22])) == 2.0
    # 1, 9, 2, 3: median of an even count is the mean of the middle two, 2.5 (the mean is 3.75).
    clock = _fake_clock([0, 1, 10, 19, 20, 22, 30, 33])
    assert measure_transfer_s("cpu", n=4, warmup=0, clock=clock) == 2.5


def test_measure_transfer_s_makes_warmup_plus_n_round_trips(counted_tolist):
    measure_transfer_s("cpu", n=5, warmup=2, rows=4)
    assert counted_tolist["tolist"] == 7  # 2 untimed + 5 timed


def test_measure_transfer_s_on_cpu_is_small():
    per_transfer_s = measure_transfer_s("cpu", n=9)
    assert 0.0 <= per_transfer_s < 1e-3


@pytest.mark.parametrize("kwargs", [{"n": 0}, {"rows": 0}, {"warmup": -1}])
def test_measure_transfer_s_refuses_bad_input(kwargs):
    with pytest.raises(ValueError, match=r"must be >= "):
        measure_transfer_s("cpu", **kwargs)


def test_render_reproduces_the_seed_table():
    measurements = [
        SyncMeasurement(1, "greedy", 0.193e-3, 0.145e-3, 1, 1),
        SyncMeasurement(8, "greedy", 0.680e-3, 0.358e-3, 1, 1),
        SyncMeasurement(1, "top-p", 14.525e-3, 14.504e-3, 1, 1),
        SyncMeasurement(2, "top-p", 19.481e-3, 19.208e-3, 2, 1),
        SyncMeasurement(4, "top-p", 28.993e-3, 28.708e-3, 4, 1),
        SyncMeasurement(8, "top-p", 60.900e-3, 59.592e-3, 8, 1),
    ]
    # Copied from the Day 47 seed (its other greedy rows divide unrounded medians).
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


# --------------------------------------------------------------------------------------------
# The gates
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gate_error", [NotSingleTransfer, NotDeviceResident, RowOrderMismatch, NotMeasurable]
)
def test_every_gate_error_is_a_value_error(gate_error):
    assert issubclass(gate_error, ValueError)


def test_check_single_transfer_passes_exactly_one():
    check_single_transfer(1.0)
    processor = OutputProcessor()
    for step in range(3):
        processor.apply(_batch([step], ("a",), processor.readback), lambda r, t: None)
    check_single_transfer(processor)


@pytest.mark.parametrize("rate", [0.0, 0.5, 1.25, 2.0, 9.0])
def test_check_single_transfer_refuses_any_other_rate(rate):
    with pytest.raises(NotSingleTransfer, match=rf"transfers_per_step={rate} must be exactly 1.0"):
        check_single_transfer(rate)


def test_check_single_transfer_refuses_a_processor_with_no_steps():
    with pytest.raises(NotSingleTransfer, match=r"applied 0 steps"):
        check_single_transfer(OutputProcessor())


def test_check_single_transfer_refuses_one_extra_journey():
    processor = OutputProcessor()
    for step in range(4):
        processor.apply(_batch([step], ("a",), processor.readback), lambda r, t: None)
    processor.readback.fetch(torch.tensor([0]))  # somebody's debug line
    with pytest.raises(NotSingleTransfer, match=r"transfers_per_step=1.25 \(5 journeys over 4 steps\)"):
        check_single_transfer(processor)


def test_check_device_resident_passes_a_rows_int64_tensor_on_the_device():
    check_device_resident(torch.tensor([1, 2, 3]), "cpu")
    check_device_resident(torch.tensor([1, 2, 3]), torch.device("cpu"))
    check_device_resident(torch.tensor([1, 2, 3]), "cpu:0")  # a CPU tensor's device has no index
    check_device_resident(torch.empty(0, dtype=torch.int64), "cpu")


@pytest.mark.parametrize(
    "output, device, pattern",
    [
        ([1, 2, 3], "cpu", r"sampler output is a list, must be a torch.Tensor"),
        (
            torch.tensor([1, 2, 3]),
            "cuda",
            r"sampler output is on cpu, must stay on the forward's device cuda",
        ),
        (torch.empty(3, dtype=torch.int64, device="meta"), "cpu", r"sampler output is on meta"),
        (torch.tensor([1, 2], dtype=torch.int32), "cpu", r"dtype torch.int32, must be torch.int64"),
        (torch.tensor([[1, 2]]), "cpu", r"shape \(1, 2\), must be 1-D \[rows\]"),
        (torch.tensor(5), "cpu", r"shape \(\), must be 1-D"),
    ],
    ids=["list", "cpu-not-cuda", "meta-not-cpu", "int32", "2-D", "0-D"],
)
def test_check_device_resident_refuses(output, device, pattern):
    with pytest.raises(NotDeviceResident, match=pattern):
        check_device_resident(output, device)


def test_check_in_row_order_passes_the_same_order():
    batch = _batch([1, 2, 3], ("a", "b", "c"))
    check_in_row_order(batch, ("a", "b", "c"))
    check_in_row_order(batch, ["a", "b", "c"])


def test_check_in_row_order_refuses_a_shifted_row():
    # "b" finished between steps and "d" was admitted into its row.
    batch = _batch([1, 2, 3], ("a", "b", "c"))
    with pytest.raises(RowOrderMismatch, match=r"row 1 belongs to request 'b', expected 'd'"):
        check_in_row_order(batch, ("a", "d", "c"))
    with pytest.raises(RowOrderMismatch, match=r"row 0 belongs to request 'a', expected 'c'"):
        check_in_row_order(batch, ("c", "b", "a"))


def test_check_in_row_order_refuses_a_different_row_count():
    batch = _batch([1, 2, 3], ("a", "b", "c"))
    with pytest.raises(RowOrderMismatch, match=r"batch has 3 rows, expected 2"):
        check_in_row_order(batch, ("a", "b"))


def test_check_measurable_refuses_a_cpu_whatever_it_measured():
    with pytest.raises(NotMeasurable, match=r"device=cpu has no bus"):
        check_measurable(1e-3, "cpu")
    with pytest.raises(NotMeasurable, match=r"device=cpu"):
        check_measurable(0.0, torch.device("cpu"))


def test_check_measurable_refuses_a_cost_below_resolution():
    assert MIN_MEASURABLE_S == 1e-6
    with pytest.raises(
        NotMeasurable, match=r"per_transfer_s=5e-07 is below the measurable resolution_s=1e-06"
    ):
        check_measurable(5e-7, "cuda")
    with pytest.raises(NotMeasurable, match=r"resolution_s=0.0001"):
        check_measurable(5e-5, "cuda", resolution_s=1e-4)


def test_check_measurable_passes_a_measured_device_cost():
    check_measurable(20e-6, "cuda")
    check_measurable(1e-6, "cuda:0")  # exactly at the resolution is measurable


@pytest.mark.parametrize("per_transfer_s", [-1e-6, math.nan, math.inf])
def test_check_measurable_refuses_nonsense_as_bad_input_not_as_a_gate(per_transfer_s):
    with pytest.raises(ValueError, match=r"must be finite and >= 0") as info:
        check_measurable(per_transfer_s, "cuda")
    assert not isinstance(info.value, NotMeasurable)


# --------------------------------------------------------------------------------------------
# On a GPU, where the journey is a real stop
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_transfer_is_measurable_and_the_batch_stays_resident():
    per_transfer_s = measure_transfer_s("cuda", n=25)
    check_measurable(per_transfer_s, "cuda")
    tokens = torch.tensor([3, 1, 2], dtype=torch.int64, device="cuda")
    check_device_resident(tokens, "cuda")
    check_device_resident(tokens, f"cuda:{tokens.device.index}")
    processor = OutputProcessor()
    seen: list[tuple[str, int]] = []
    processor.apply(TokenBatch(tokens, ("a", "b", "c"), processor.readback), lambda r, t: seen.append((r, t)))
    assert seen == [("a", 3), ("b", 1), ("c", 2)]
    check_single_transfer(processor)
