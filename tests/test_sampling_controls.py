"""Stop strings, min_tokens, penalties and logprobs, against hand arithmetic and transformers."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY, CharTokenizer, greedy, make_hf_llama, nanoserve_model_from_hf

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.sampling import BatchedSampler, RowHistory, apply_history

PROMPT = [5, 9, 13, 22, 7, 41, 3, 8]


@pytest.fixture(scope="module")
def hf():
    return make_hf_llama(seed=6)


def engine_for(hf) -> Engine:
    return Engine(nanoserve_model_from_hf(hf), CharTokenizer(TINY["vocab_size"]),
                  EngineConfig(dtype="float32", quantization=None, block_size=4, num_kv_blocks=64, enable_prefix_caching=False))


def test_stop_string_across_token_boundaries_cuts_the_text_before_the_match(hf):
    full = engine_for(hf).generate([PROMPT], greedy(16))[0]
    # CharTokenizer decodes one character per token, so a 2-character stop string spans 2 tokens.
    i = 5
    stop = full.text[i:i + 2]
    first = full.text.find(stop)  # the earliest occurrence is where generation must end
    out = engine_for(hf).generate([PROMPT], greedy(16, stop=(stop, "never-there")))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:first]
    assert out.token_ids == full.token_ids[:first + 2]  # the token completing the match is the last


def test_min_tokens_masks_stop_tokens_until_reached(hf):
    ref = engine_for(hf).generate([PROMPT], greedy(16))[0].token_ids
    stop_token = ref[0]
    early = engine_for(hf).generate([PROMPT], greedy(16, stop_token_ids=[stop_token]))[0]
    assert early.token_ids == [stop_token] and early.stop_reason == stop_token
    held = engine_for(hf).generate([PROMPT], greedy(16, stop_token_ids=[stop_token], min_tokens=3))[0]
    # The first token is transformers' second choice at the prompt's last position.
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0, -1]
    assert held.token_ids[0] == logits.topk(2).indices[1].item()
    assert len(held.token_ids) >= 3 and stop_token not in held.token_ids[:3]


def test_repetition_penalty_equals_transformers_generate(hf):
    out = engine_for(hf).generate([PROMPT], greedy(16, repetition_penalty=1.8))[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, repetition_penalty=1.8,
                          eos_token_id=None)
    assert out.token_ids == ref[0, len(PROMPT):].tolist()
    plain = engine_for(hf).generate([PROMPT], greedy(16))[0]
    assert out.token_ids != plain.token_ids  # the penalty changed something on this prompt


def test_penalties_against_hand_arithmetic():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)]
    history = [RowHistory(prompt_token_ids=[0], output_token_ids=[1, 1, 3], stop_token_ids=frozenset())]
    out = apply_history(logits, params, history)[0].tolist()
    # token 0: in prompt, positive -> 2/2 = 1; no output occurrences.
    # token 1: seen, negative -> -1*2 = -2; output twice -> -2 - 0.5 - 2*0.25 = -3.
    # token 2: unseen -> 0.5. token 3: seen, positive -> 1.5; once -> 1.5 - 0.5 - 0.25 = 0.75.
    assert out == pytest.approx([1.0, -3.0, 0.5, 0.75, -2.0])
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0, -2.0]]  # the caller's logits are untouched


def test_penalties_apply_to_greedy_rows_in_a_mixed_batch():
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    params = [SamplingParams(temperature=0.0, presence_penalty=1.0), SamplingParams(temperature=0.0)]
    history = [RowHistory([2], [0], frozenset()), None]
    assert BatchedSampler().sample_batch(logits, params, histories=history) == [1, 0]


def test_logprobs_equal_log_softmax_of_transformers_logits(hf):
    out = engine_for(hf).generate([PROMPT], greedy(max_tokens=6, logprobs=3))[0]
    full = PROMPT + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].double(), dim=-1)  # [N, V]
    assert len(out.logprobs) == 6
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(PROMPT) + step - 1]
        top = row.topk(3)
        assert set(entry) == set(top.indices.tolist()) | {token}
        for token_id, value in entry.items():
            assert math.isclose(value, row[token_id].item(), abs_tol=1e-4)
