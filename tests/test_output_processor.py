"""nanoserve.output_processor: the Readback that counts its journeys, the TokenBatch that resolves
once, the OutputProcessor's one readback a step, and check_in_row_order.

Every expected number below is worked by hand in the comment beside it. The tests that matter
most are about an operation that must not happen: the ``no_readback`` fixture (conftest) turns every
way a tensor's value can reach Python into an exception, so "did not read back" can fail.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ReadbackHappened, process_batch

from nanoserve.instruments.sync_gates import NotSingleTransfer, check_device_resident, check_single_transfer
from nanoserve.output_processor import OutputProcessor
from nanoserve.params import SamplingParams
from nanoserve.readback import HostCopy, Readback, RowOrderMismatch, TokenBatch, check_in_row_order
from nanoserve.request import Request
from nanoserve.step_rows import StepRows


def _batch(ids: list[int], request_ids: tuple[str, ...], readback: Readback | None = None) -> TokenBatch:
    return TokenBatch(torch.tensor(ids, dtype=torch.int64), request_ids, readback or Readback())


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


def test_processor_hands_each_row_to_its_owner_in_row_order():
    processor = OutputProcessor()
    seen = process_batch(processor, _batch([40, 41, 42], ("r2", "r0", "r1"), processor.readback))
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
        seen += process_batch(processor, _batch(ids, owners, processor.readback))
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
    process_batch(processor, batch)
    assert processor.readback.journeys == 1
    assert processor.transfers_per_step == 1.0


def test_processor_rate_sees_a_readback_made_elsewhere():
    # A caller that re-reads the tensor instead of going through the memo: 2 journeys a step.
    processor = OutputProcessor()
    for step in range(3):
        batch = _batch([step, step + 1], ("a", "b"), processor.readback)
        processor.readback.fetch(batch.tokens)
        process_batch(processor, batch)
    assert processor.readback.journeys == 6
    assert processor.transfers_per_step == 2.0  # 6 / 3
    with pytest.raises(NotSingleTransfer, match=r"transfers_per_step=2.0 \(6 journeys over 3 steps\)"):
        check_single_transfer(processor)


def test_processor_skips_an_empty_batch_without_a_journey_or_a_step():
    processor = OutputProcessor()
    process_batch(processor, _batch([1], ("a",), processor.readback))
    calls = process_batch(processor, TokenBatch(torch.empty(0, dtype=torch.int64), (), processor.readback))
    assert calls == []
    assert processor.num_steps == 1
    assert processor.readback.journeys == 1
    assert processor.transfers_per_step == 1.0


def test_processor_refuses_a_batch_counted_on_another_readback():
    processor = OutputProcessor()
    with pytest.raises(ValueError, match=r"different Readback"):
        process_batch(processor, _batch([1], ("a",), Readback()))
    assert processor.num_steps == 0


def test_processor_uses_the_readback_it_is_given_and_resets_it():
    readback = Readback()
    processor = OutputProcessor(readback)
    assert processor.readback is readback
    process_batch(processor, _batch([1, 2], ("a", "b"), readback))
    process_batch(processor, _batch([3], ("a",), readback))
    assert (processor.num_steps, readback.journeys, readback.elements) == (2, 2, 3)
    processor.reset()
    assert (processor.num_steps, readback.journeys, readback.elements) == (0, 0, 0)
    assert processor.transfers_per_step == 0.0


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


def test_row_order_mismatch_is_a_value_error():
    assert issubclass(RowOrderMismatch, ValueError)


# --------------------------------------------------------------------------------------------
# The stage's rules: stop ids, min_tokens, stop strings, overshoot, logprobs
# --------------------------------------------------------------------------------------------


class _Letters:
    """A tokenizer stand-in: token t decodes to chr(ord('a') + t - 10); 0..9 are special."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i - 10) for i in ids if i >= 10)


def _request(request_id: str, **params) -> Request:
    from nanoserve.detokenize import IncrementalDetokenizer

    request = Request(request_id, [1], SamplingParams(temperature=0.0, **params), frozenset({2}), arrival_time=0.0)
    request.detokenizer = IncrementalDetokenizer(_Letters())
    return request


def _step(processor: OutputProcessor, requests: list[Request], ids: list[int], logprobs=None):
    batch = TokenBatch(torch.tensor(ids), tuple(r.request_id for r in requests), processor.readback, logprobs)
    return processor.process(batch, StepRows.one_each(requests))


def test_a_stop_token_finishes_only_after_min_tokens():
    processor = OutputProcessor()
    early = _request("early", max_tokens=10)
    late = _request("late", max_tokens=10, min_tokens=2)
    result = _step(processor, [early, late], [2, 2])  # EOS for both: "late" has 1 < min_tokens
    assert [(o.request_id, o.finished, o.finish_reason) for o in result.outputs] == [
        ("early", True, "stop"), ("late", False, None)]
    assert result.finished == [early]
    result = _step(processor, [late], [2])
    assert result.finished == [late] and result.outputs[0].token_ids == [2, 2]


def test_a_stop_string_cuts_the_text_before_the_match_and_names_it():
    processor = OutputProcessor()
    request = _request("r", max_tokens=10, stop=["cd"])
    outs = [_step(processor, [request], [t]).outputs[0] for t in (10, 11, 12, 13)]  # a b c d
    assert [o.text for o in outs[:3]] == ["a", "ab", "abc"]
    assert (outs[3].text, outs[3].finished, outs[3].finish_reason, outs[3].stop_reason) == ("ab", True, "stop", "cd")


def test_a_row_whose_request_finished_after_launch_is_overshoot_and_dropped():
    processor = OutputProcessor()
    done, live = _request("done", max_tokens=1), _request("live", max_tokens=5)
    _step(processor, [done, live], [10, 11])
    assert done.is_finished and done.output_token_ids == [10]
    result = _step(processor, [done, live], [12, 13])  # "done" was still in the batch launched before
    assert [o.request_id for o in result.outputs] == ["live"]
    assert done.output_token_ids == [10] and live.output_token_ids == [11, 13]


def test_logprobs_are_attached_from_their_own_journey():
    processor = OutputProcessor()
    request = _request("r", max_tokens=5, logprobs=1)
    other = _request("o", max_tokens=5)
    # Row 0 asks, k = 2 computed: [sampled logprob, 2 top values, 2 top ids]; it wants only its top 1.
    packed = torch.tensor([[-0.5, -0.25, -0.5, 17.0, 12.0]])  # values exact in float32
    result = _step(processor, [request, other], [12, 13], ([0], packed))
    assert result.outputs[0].logprobs == [{17: -0.25, 12: -0.5}]  # its top 1, and the sampled token 12
    assert result.outputs[1].logprobs is None
    assert processor.readback.journeys == 2  # the tokens, then the logprobs



class CountingList(list):
    """A list that counts the elements copied out of it: by iteration (list(), tuple(), a loop)
    and by slicing. Appending, len() and reading one element count nothing."""

    def __init__(self, items=()) -> None:
        super().__init__(items)
        self.num_copied = 0

    def __iter__(self):
        self.num_copied += len(self)
        return super().__iter__()

    def __getitem__(self, index):
        if isinstance(index, slice):
            self.num_copied += len(range(len(self))[index])
        return super().__getitem__(index)


def test_a_steps_outputs_copy_nothing_of_the_requests_history():
    """The output of each step is O(1) in the request's length: over 300 steps not one element of
    the request's token ids, stamps or logprobs is copied (each copy was O(n), so O(n^2) a request)."""
    processor = OutputProcessor()
    request = _request("r", max_tokens=300, logprobs=0)
    spies = [CountingList(request.token_ids), CountingList(request.token_times), CountingList(request.logprobs)]
    request.token_ids, request.token_times, request.logprobs = spies
    outs = []
    for i in range(300):
        packed = torch.tensor([[-0.5, -0.25, 17.0]])  # k = 1: [sampled logprob, top value, top id]
        outs += _step(processor, [request], [10 + i % 20], ([0], packed)).outputs
        assert [spy.num_copied for spy in spies] == [0, 0, 0], f"step {i}"
    final = outs[-1]
    assert final.finished and final.token_ids == [10 + i % 20 for i in range(300)]
    assert len(final.token_times) == len(final.logprobs) == 300 and final.logprobs[0] == {10: -0.5}
    assert len(outs[9].token_ids) == len(outs[9].token_times) == len(outs[9].logprobs) == 10  # as made at step 10
    list(final.token_times)  # a copy the caller makes is seen: the spy can fail
    assert spies[1].num_copied == 300

# --------------------------------------------------------------------------------------------
# The journey home on a GPU: a pinned, non-blocking copy started at build, waited on in collect
# --------------------------------------------------------------------------------------------


def test_a_cpu_batch_starts_no_copy_and_reads_its_tensor_at_resolve(counted_tolist):
    tokens = torch.tensor([4, 5])
    copy = HostCopy(tokens)
    assert copy.host is None and copy.event is None and copy.wait() is tokens
    assert counted_tolist["tolist"] == 0
    assert _batch([4, 5], ("a", "b")).resolve() == [4, 5]
    assert counted_tolist["tolist"] == 1


def test_a_cuda_batch_copies_into_pinned_memory_then_waits_on_its_event_only(monkeypatch):
    calls: list[str] = []

    class FakeEvent:
        def record(self):
            calls.append("event.record")

        def synchronize(self):
            calls.append("event.synchronize")

    class FakeHost:
        def copy_(self, src, non_blocking=False):
            calls.append(f"copy_(non_blocking={non_blocking})")

        def tolist(self):
            calls.append("host.tolist")
            return [7, 8]

    class FakeCudaTensor:
        device = torch.device("cuda", 0)
        shape = (2,)
        dtype = torch.int64

        def tolist(self):
            raise AssertionError("the device tensor itself must not be read")

    def fake_empty(shape, dtype, pin_memory=False):
        calls.append(f"empty(pin_memory={pin_memory})")
        return FakeHost()

    monkeypatch.setattr(torch, "empty", fake_empty)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    copy = HostCopy(FakeCudaTensor())
    assert calls == ["empty(pin_memory=True)", "copy_(non_blocking=True)", "event.record"]
    assert Readback().fetch(copy) == [7, 8]
    assert calls[3:] == ["event.synchronize", "host.tolist"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_cuda_batch_resolves_through_pinned_memory():
    tokens = torch.tensor([3, 1, 4], device="cuda")
    batch = TokenBatch(tokens, ("a", "b", "c"), Readback())
    assert batch._copies[0].host.is_pinned()
    assert batch.resolve() == [3, 1, 4]
