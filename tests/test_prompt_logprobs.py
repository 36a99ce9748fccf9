"""SamplingParams.prompt_logprobs (vLLM's): each prompt token's log-probability under the model at
its position, and the top k there, the first token's None. Held to transformers' own forward over
the same tokens (log_softmax of its logits), through chunked prompts, preemption, the prefix cache
(a cached prefix has no logits: such a request forwards its whole prompt) and deferred output."""

from __future__ import annotations

import pytest
import torch
from conftest import DEFAULT_MODEL_NAME as MODEL
from conftest import CharTokenizer, config_of, error_of, greedy, make_hf_model, nanoserve_model_from_hf

from nanoserve import Engine, SamplingParams

openai = pytest.importorskip("openai")

PROMPTS = [[5, 9, 13, 22, 7, 41, 3, 8, 60, 33, 21], [17, 4], [30 + i % 50 for i in range(40)], [11, 12, 13, 14, 15]]


def reference(hf, prompt: list[int], k: int) -> list[dict[int, float] | None]:
    """transformers' prompt logprobs: position p's log_softmax gives token p + 1's, and the top k."""
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), dim=-1)  # [P, V]
    out: list[dict[int, float] | None] = [None]
    for p in range(len(prompt) - 1):
        top = logprobs[p].topk(k)
        out.append({int(i): float(v) for i, v in zip(top.indices, top.values, strict=True)}
                   | {prompt[p + 1]: float(logprobs[p, prompt[p + 1]])})
    return out


def assert_matches(got, expected, atol: float = 1e-4) -> None:
    assert len(got) == len(expected) and got[0] is None
    for p, (g, e) in enumerate(zip(got[1:], expected[1:], strict=True), start=1):
        assert set(g) == set(e), (p, g, e)
        for token, value in e.items():
            assert abs(g[token] - value) <= atol, (p, token, g[token], value)


@pytest.fixture(scope="module")
def hf():
    return make_hf_model("llama", seed=3)


def engine_of(hf, **config) -> Engine:
    config = config_of(**({"dtype": "float32", "quantization": None, "block_size": 4, "num_kv_blocks": 64,
                           "max_num_seqs": 4} | config))
    return Engine(nanoserve_model_from_hf(hf), CharTokenizer(hf.config.vocab_size), config)


@pytest.mark.parametrize("config", [
    {},
    {"max_num_batched_tokens": 7},  # every long prompt in chunks, a chunk's rows scored where it lands
    {"num_kv_blocks": 16, "max_num_batched_tokens": 7},  # preempted and recomputed: each entry once
    {"deferred_output": True, "max_num_batched_tokens": 7},
])
def test_prompt_logprobs_equal_transformers(hf, config):
    engine = engine_of(hf, **config)
    k = [0, 2, 5, 1]
    outputs = engine.generate(PROMPTS, [greedy(12, prompt_logprobs=n) for n in k])
    for out, prompt, n in zip(outputs, PROMPTS, k, strict=True):
        assert_matches(out.prompt_logprobs, reference(hf, prompt, n))
    # and the sampled tokens are what they are without prompt logprobs
    plain = engine_of(hf, **config).generate(PROMPTS, greedy(12))
    assert [out.token_ids for out in outputs] == [out.token_ids for out in plain]
    if config.get("num_kv_blocks") == 16:
        assert sum(out.num_preemptions for out in outputs) > 0
    engine.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_a_cached_prefix_is_forwarded_again_for_prompt_logprobs(hf):
    engine = engine_of(hf)
    prompt = PROMPTS[2]
    first = engine.generate([prompt], greedy(2))[0]
    again = engine.generate([prompt], greedy(2))[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0  # the cache serves plain requests
    scored = engine.generate([prompt], greedy(2, prompt_logprobs=3))[0]
    assert scored.num_cached_tokens == 0
    assert_matches(scored.prompt_logprobs, reference(hf, prompt, 3))


def test_requests_without_prompt_logprobs_have_none(hf):
    out = engine_of(hf).generate([PROMPTS[0]], greedy(2))[0]
    assert out.prompt_logprobs is None


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True, "3"])
def test_prompt_logprobs_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


# ---- the server: echo with logprobs (OpenAI's legacy completions, what lm-evaluation-harness sends) ----

def hf_prompt_logprobs(hf_default, prompt: list[int]) -> torch.Tensor:
    model, _ = hf_default
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)  # [P, V]


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, hf_default):
    _, tokenizer = hf_default
    prompt = tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    reference = hf_prompt_logprobs(hf_default, prompt)
    got = client.completions.create(model=MODEL, prompt=[prompt], echo=True, logprobs=2, max_tokens=1,
                                    temperature=0).choices[0]
    lp = got.logprobs
    assert got.text.startswith(tokenizer.decode(prompt)) and len(got.text) > len(tokenizer.decode(prompt))
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(prompt)):
        assert abs(lp.token_logprobs[p] - float(reference[p - 1, prompt[p]])) < 1e-3, p
        top = reference[p - 1].topk(2)
        assert sorted(lp.top_logprobs[p].values(), reverse=True) == pytest.approx(top.values.tolist(), abs=1e-3)
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    # max_tokens 0: the prompt alone, scored
    alone = client.completions.create(model=MODEL, prompt=[prompt], echo=True, logprobs=1, max_tokens=0,
                                      temperature=0)
    assert alone.choices[0].text == tokenizer.decode(prompt) and alone.usage.completion_tokens == 0
    assert alone.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(prompt)]


def test_vllms_prompt_logprobs_field_and_a_streamed_echo(client, hf_default):
    _, tokenizer = hf_default
    prompt = tokenizer.encode("Once upon a time there was a")
    reference = hf_prompt_logprobs(hf_default, prompt)
    got = client.completions.create(model=MODEL, prompt=[prompt], max_tokens=3, temperature=0,
                                    extra_body={"prompt_logprobs": 1}).choices[0]
    entries = got.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    for p in range(1, len(prompt)):
        assert abs(entries[p][str(prompt[p])]["logprob"] - float(reference[p - 1, prompt[p]])) < 1e-3
        assert len(entries[p]) in (1, 2)  # the token itself and the top 1, the same token or another
    chunks = list(client.completions.create(model=MODEL, prompt=[prompt], echo=True, logprobs=0, max_tokens=3,
                                            temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text.startswith(tokenizer.decode(prompt)) and first.logprobs.token_logprobs[0] is None
    assert len(first.logprobs.tokens) >= len(prompt)


def test_chat_refuses_echo_and_prompt_logprobs(client):
    for extra in ({"echo": True}, {"prompt_logprobs": 1}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_body=extra)
        assert error_of(e.value)["param"] == next(iter(extra))
