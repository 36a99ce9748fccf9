"""nanoserve/request.py: a Request's counters, its stop rules in append_token, and its clocks,
each worked out by hand from the prompt length, max_tokens and the stamps handed in; the prompt
types the door takes and refuses; ListView, what an output holds of a request's lists."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from conftest import greedy
from transformers import BatchEncoding

from nanoserve import SamplingParams
from nanoserve.request import FinishReason, ListView, Request, RequestStatus, prompt_token_ids

PROMPT = [11, 12, 13, 14]
EOS = frozenset({2})


def request(params: SamplingParams, prompt: list[int] = PROMPT) -> Request:
    return Request("r", prompt, params, EOS, arrival_time=100.0)


def feed(req: Request, tokens: list[int], start: float = 101.0) -> list[bool]:
    """append_token for each token at stamps start, start + 1, ...; returns what each call returned."""
    return [req.append_token(t, start + i) for i, t in enumerate(tokens)]


def test_a_new_request_counts_its_prompt():
    req = request(SamplingParams(max_tokens=5))
    assert (req.num_prompt_tokens, req.num_tokens, req.num_output_tokens, req.num_computed_tokens) == (4, 4, 0, 0)
    assert req.output_token_ids == []
    assert req.status is RequestStatus.WAITING and not req.is_finished
    assert req.arrival_time == 100.0
    assert req.logprobs is None and request(SamplingParams(logprobs=2)).logprobs == []


def test_the_prompt_is_copied():
    prompt = [5, 6]
    req = request(SamplingParams(), prompt)
    prompt.append(7)
    assert req.prompt_token_ids == [5, 6] and req.token_ids == [5, 6]


def test_a_pending_token_counts_toward_num_tokens_and_the_length_cap():
    req = request(greedy(3))
    feed(req, [20, 21])
    assert (req.num_tokens, req.num_output_tokens, req.is_length_capped) == (6, 2, False)
    req.num_pending_tokens = 1  # the third token is sampled on the device, not yet home
    assert (req.num_tokens, req.num_output_tokens, req.is_length_capped) == (7, 2, True)


def test_length_finishes_at_max_tokens():
    req = request(greedy(3))
    assert feed(req, [20, 21, 22]) == [False, False, True]
    assert req.finish_reason is FinishReason.LENGTH and req.status is RequestStatus.FINISHED
    assert req.output_token_ids == [20, 21, 22] and req.token_ids == PROMPT + [20, 21, 22]
    assert req.stop_reason is None


def test_eos_stops_unless_ignored():
    req = request(SamplingParams(max_tokens=5))
    assert feed(req, [20, 2]) == [False, True]
    assert (req.finish_reason, req.stop_reason, req.output_token_ids) == (FinishReason.STOP, None, [20, 2])
    ignoring = request(greedy(5))
    assert feed(ignoring, [20, 2, 21]) == [False, False, False]


def test_a_stop_token_stops_even_with_ignore_eos_and_is_the_stop_reason():
    req = request(greedy(5, stop_token_ids=[21]))
    assert feed(req, [20, 21]) == [False, True]
    assert (req.finish_reason, req.stop_reason) == (FinishReason.STOP, 21)


def test_min_tokens_holds_off_every_stop_rule():
    # min_tokens=3: the first two output tokens cannot stop the request, the third can.
    req = request(SamplingParams(max_tokens=6, min_tokens=3, stop_token_ids=[21]))
    assert feed(req, [2, 21, 21]) == [False, False, True]
    assert (req.finish_reason, req.stop_reason, req.num_output_tokens) == (FinishReason.STOP, 21, 3)


def test_min_tokens_equal_to_max_tokens_lets_the_last_token_stop():
    req = request(SamplingParams(max_tokens=2, min_tokens=2))
    assert feed(req, [2, 2]) == [False, True]
    assert req.finish_reason is FinishReason.STOP  # the 2nd token is EOS, allowed now: a stop, not a length
    req = request(SamplingParams(max_tokens=2, min_tokens=2))
    assert feed(req, [2, 20]) == [False, True]
    assert req.finish_reason is FinishReason.LENGTH


def test_eos_at_the_last_allowed_token_is_a_stop_not_a_length():
    req = request(SamplingParams(max_tokens=2))
    assert feed(req, [20, 2]) == [False, True]
    assert req.finish_reason is FinishReason.STOP


def test_token_stamps_and_first_token_time():
    req = request(greedy(3))
    feed(req, [20, 21, 22], start=101.5)
    assert req.token_times == [101.5, 102.5, 103.5]
    assert req.first_token_time == 101.5
    assert req.finished_time == 103.5


def test_running_time_is_summed_over_admissions():
    req = request(greedy(3))
    req.mark_running(102.0)
    assert req.status is RequestStatus.RUNNING and req.first_scheduled_time == 102.0
    req.mark_not_running(104.5)  # preempted after 2.5 s
    req.mark_not_running(105.0)  # not running: nothing to add
    req.mark_running(106.0)
    assert req.first_scheduled_time == 102.0  # the first admission's stamp stays
    req.finish(FinishReason.ABORT, 107.25)  # 1.25 s more
    assert req.running_s == 2.5 + 1.25  # exact in binary
    assert (req.finish_reason, req.finished_time, req.is_finished) == (FinishReason.ABORT, 107.25, True)


def test_finish_reasons_are_their_openai_strings():
    assert [r.value for r in FinishReason] == ["stop", "length", "abort"]
    assert FinishReason.STOP == "stop"  # a str enum: RequestOutput carries it as the plain string


# ---- the prompt at the door ----------------------------------------------------------------------

TOKEN_ID_PROMPTS = {
    "list": [5, 6],
    "tuple": (5, 6),
    "numpy scalars": [np.int64(5), np.uint8(6)],
    "torch scalars": [torch.tensor(5), torch.tensor(6, dtype=torch.int32)],
    "numpy array": np.array([5, 6]),
    "tensor": torch.tensor([5, 6]),
    "range": range(5, 7),
    "an output's view": ListView([1, 5, 6], 1),
}


@pytest.mark.parametrize("name", sorted(TOKEN_ID_PROMPTS))
def test_token_ids_come_as_integers_of_any_kind(name):
    token_ids = prompt_token_ids(TOKEN_ID_PROMPTS[name], tokenizer=None)
    assert token_ids == [5, 6] and [type(t) for t in token_ids] == [int, int]


EXPECTED = r"prompt must be a str or a list of token ids \(int\); got "
BAD_PROMPTS = {  # name -> (prompt, what the error names)
    "dict": ({"input_ids": [5, 6]}, r"dict \(a mapping: pass its \['input_ids'\]\)$"),
    "BatchEncoding": (BatchEncoding({"input_ids": [5, 6], "attention_mask": [1, 1]}),
                      r"BatchEncoding \(a mapping: pass its \['input_ids'\]\)$"),
    "None": (None, "None$"),
    "bytes": (b"\x05\x06", "bytes$"),
    "an int": (5, "int$"),
    "a set": ({5, 6}, "set$"),
    "floats": ([5.0, 6.0], "a list holding float at index 0$"),
    "nested lists": ([[5, 6], [7]], "a list holding list at index 0$"),
    "a bool": ([5, True], "a list holding bool at index 1$"),
    "a numpy bool": ((5, np.bool_(True)), "a tuple holding bool at index 1$"),
    "a str id": ([5, "6"], "a list holding str at index 1$"),
    "None in a list": ([5, None], "a list holding None at index 1$"),
    "a 1-element tensor": ([torch.tensor([5])], "a list holding Tensor of torch.int64 at index 0$"),
    "a float tensor": (torch.tensor([5.0, 6.0]), "a Tensor of torch.float32 holding float at index 0$"),
    "a bool tensor": (torch.tensor([True]), "a Tensor of torch.bool holding bool at index 0$"),
    "a 2-D tensor": (torch.tensor([[5, 6]]), "a 2-D Tensor of torch.int64$"),
    "a 0-D tensor": (torch.tensor(5), "a 0-D Tensor of torch.int64$"),
    "a float array": (np.array([5.0]), "a ndarray of float64 holding float at index 0$"),
}


@pytest.mark.parametrize("name", sorted(BAD_PROMPTS))
def test_a_prompt_of_another_type_is_refused_naming_the_type(name):
    prompt, names = BAD_PROMPTS[name]
    with pytest.raises(ValueError, match=EXPECTED + names):
        prompt_token_ids(prompt, tokenizer=None)


# ---- ListView ------------------------------------------------------------------------------------


def test_a_list_view_keeps_its_length_as_the_list_grows():
    items = [10, 11, 12]
    view = ListView(items, 1)
    items += [13, 14]
    assert len(view) == 2 and list(view) == [11, 12] and view == [11, 12]
    assert [11, 12] == view  # noqa: SIM300 -- the list on the left: Python asks the view (reflected)
    assert view != [11, 12, 13] and view == (11, 12) and view == ListView([0, 11, 12], 1)
    assert (view[0], view[-1], view[1:], view[::-1], view[5:]) == (11, 12, [12], [12, 11], [])
    with pytest.raises(IndexError):
        view[2]  # the list holds 13 there, the view does not
    assert [9] + view == [9, 11, 12] and view + (13,) == [11, 12, 13]
    assert repr(view) == "[11, 12]" and 12 in view and 13 not in view
    assert pickle.loads(pickle.dumps(view)) == [11, 12]
    with pytest.raises(TypeError):
        hash(view)
