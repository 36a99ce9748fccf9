"""The real default model (SmolLM2-135M-Instruct): greedy token ids equal transformers' generate.

transformers runs each prompt alone (no padding can change its answer); nanoserve runs all eight
together at several slot counts and with a KV pool small enough to force preemption.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.weights

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers, separated by commas:",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a dragon who",
    "Explain in one sentence why the sky is blue, then explain why sunsets are red, and finally say "
    "what colour the sky is on Mars and why it differs from the sky on Earth.",
    " ".join(["The quick brown fox jumps over the lazy dog."] * 12) + " How many times did the fox jump?",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference(hf_default):
    """transformers' greedy ids for each prompt alone: (prompt ids, output ids)."""
    model, tokenizer = hf_default
    refs = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            # EOS disabled on both sides: every request runs its full length, so the pool fills.
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
        refs.append((ids, out[0, len(ids):].tolist()))
        assert len(refs[-1][1]) == MAX_TOKENS
    assert len({len(ids) for ids, _ in refs}) == len(PROMPTS)  # eight different prompt lengths
    return refs


@pytest.fixture(scope="module")
def model_and_tokenizer(default_model_dir):
    engine = Engine.from_pretrained(default_model_dir, EngineConfig(dtype="float32", quantization=None, max_model_len=512))
    return engine.model, engine.tokenizer


@pytest.mark.parametrize("max_num_seqs, num_kv_blocks, deferred", [
    (1, None, False), (2, None, False), (4, None, False), (8, None, False), (8, 12, False), (8, 12, True),
])
def test_greedy_ids_equal_transformers_generate(reference, model_and_tokenizer, max_num_seqs, num_kv_blocks, deferred):
    model, tokenizer = model_and_tokenizer
    config = EngineConfig(dtype="float32", quantization=None, max_num_seqs=max_num_seqs, num_kv_blocks=num_kv_blocks, max_model_len=512,
                          kv_cache_memory_bytes=64 * 2**20, deferred_output=deferred)
    engine = Engine(model, tokenizer, config)
    outputs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for (prompt_ids, ref_ids), out in zip(reference, outputs, strict=False):
        assert out.prompt_token_ids == prompt_ids
        assert out.token_ids == ref_ids, f"diverges at {next(i for i, (a, b) in enumerate(zip(out.token_ids, ref_ids, strict=True)) if a != b)}"
    if num_kv_blocks is not None:
        assert sum(out.num_preemptions for out in outputs) > 0, "the small pool was meant to force preemption"
    engine.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_text_matches_tokenizer_decode(reference, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = Engine(model, tokenizer, EngineConfig(dtype="float32", quantization=None, max_num_seqs=4, max_model_len=512))
    outputs = engine.generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for (_, ref_ids), out in zip(reference, outputs, strict=False):
        assert out.text == tokenizer.decode(ref_ids, skip_special_tokens=True)


def test_the_gguf_served_as_stored_in_float32_equals_transformers_generate(reference):
    """The default model straight from its Q4_1 file (no conversion), dtype float32 and no
    quantization: the blocks dequantized exactly, so the exact path stays token-identical, and
    the tokenizer built from the GGUF's metadata encodes the prompts as transformers' does."""
    engine = Engine.from_pretrained(None, EngineConfig(dtype="float32", quantization=None, max_num_seqs=8,
                                                       max_model_len=512))
    assert (engine.plan.dtype, engine.plan.quantization) == ("float32", None)
    outputs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [(out.prompt_token_ids, out.token_ids) for out in outputs] == reference
