"""nanoserve's Llama forward against transformers' LlamaForCausalLM with the same weights.

Logits are captured inside the real engine loop (paged KV, continuous batching, several
sequences of different lengths at once) and compared with transformers' full forward over each
sequence's tokens at the same position: prefill and every decode step, within 1e-4 in fp32.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    LLAMA3_ROPE,
    TINY,
    CharTokenizer,
    config_of,
    forms,
    make_hf_llama,
    nanoserve_model_from_hf,
    prepared,
)

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.model import blockdot
from nanoserve.model.forms import Dense, can_pack, pack

ARCHITECTURES = {
    "gqa": {},
    "mha": {"num_key_value_heads": 4},
    "llama3-rope": {"rope_scaling": LLAMA3_ROPE, "head_dim": 16, "rope_theta": 500000.0},
    "tied": {"tie_word_embeddings": True},
    "gqa-4-to-1": {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 4},
}

PROMPTS = [[5, 9, 13, 22, 7, 41, 3, 8, 60, 33, 21], [17, 4], [30 + i % 50 for i in range(40)], [11, 12, 13, 14, 15]]


def run_and_capture(engine: Engine, prompts, max_tokens: int | list[int]):
    """Runs greedy generation (max_tokens for every prompt, or one each); returns {request_id:
    [(num_tokens, logits_row)]} and the final outputs."""
    captured: dict[str, list[tuple[int, torch.Tensor]]] = {}
    original = engine._sample

    def spy(logits, rows, *args):
        for row, request in enumerate(rows.requests):
            captured.setdefault(request.request_id, []).append((request.num_tokens, logits[row].clone()))
        return original(logits, rows, *args)

    engine._sample = spy
    each = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    outputs = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in each])
    return captured, outputs


def assert_logits_match(hf, captured, outputs, atol: float = 1e-4) -> int:
    """Each captured logits row against transformers' forward over the request's final tokens; returns
    how many rows were checked."""
    checked = 0
    for out in outputs:
        full = out.prompt_token_ids + out.token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([full])).logits[0]  # [N, V]
        for num_tokens, row in captured[out.request_id]:
            torch.testing.assert_close(row, ref[num_tokens - 1], atol=atol, rtol=atol)
            checked += 1
        assert len(captured[out.request_id]) == len(out.token_ids)  # one prefill + each decode
    return checked


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("block_size", [1, 4, 16])
# the dense matrices on torch's linears (oneDNN-packed, or plain) or on blockdot's dense panels
@pytest.mark.parametrize("form", ["packed", "plain", "panels"])
def test_logits_equal_transformers_at_prefill_and_every_decode(arch, block_size, form):
    if form == "panels" and blockdot.library() is None:
        pytest.skip(f"blockdot not built here: {blockdot.failure()}")
    hf = make_hf_llama(seed=1, **ARCHITECTURES[arch])
    config = config_of(dtype="float32", quantization=None, block_size=block_size, num_kv_blocks=256 // block_size + 8, max_num_seqs=4,
                          pack_weights=form == "packed", dense_kernel="blockdot" if form == "panels" else "torch")
    engine = Engine(nanoserve_model_from_hf(hf), CharTokenizer(TINY["vocab_size"]), config)
    expected = {"panels": "dense-panels", "packed": "onednn" if can_pack(torch.float32) else "torch"}.get(form, "torch")
    assert forms(engine.model) == {expected} and engine.plan.exact == (form != "panels")
    captured, outputs = run_and_capture(engine, PROMPTS, max_tokens=12)
    assert assert_logits_match(hf, captured, outputs) == len(PROMPTS) * 12
    engine.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.parametrize("rows", [1, 2, 5, 33, 70])
def test_packed_linear_equals_the_plain_matmul(rows):
    # Each row is a dot product done by hand in float64: the reference owes nothing to oneDNN or MKL.
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(48, 40, generator=gen), torch.randn(rows, 40, generator=gen)
    if not can_pack(weight.dtype):
        pytest.skip("no oneDNN here")
    packed = pack(weight)
    assert packed.weight.is_mkldnn and packed.form.name == "onednn" and not weight.is_mkldnn
    expected = torch.tensor([[sum(float(a) * float(b) for a, b in zip(xr, wr, strict=True)) for wr in weight] for xr in x],
                            dtype=torch.float64)
    torch.testing.assert_close(packed(x).double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(Dense(weight)(x).double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(packed.dequantize(), weight)


def test_packing_leaves_float16_and_the_embedding_plain():
    model = nanoserve_model_from_hf(make_hf_llama(seed=4, tie_word_embeddings=True))
    laid = prepared(model, dtype="float32", quantization=None, dense_kernel="torch")
    native = can_pack(torch.float32)
    assert forms(laid) == {"onednn" if native else "torch"} and forms(model) == {"torch"}  # the given model unchanged
    assert not laid.embed.is_mkldnn and laid.lm_head is laid.embed  # the lookup still reads plain rows
    assert prepared(laid, dtype="float32", quantization=None, dense_kernel="torch") is laid  # twice is once
    half = nanoserve_model_from_hf(make_hf_llama(seed=4), dtype=torch.float16)
    assert forms(prepared(half, dtype="float16", quantization=None)) == {"torch"}
    # bfloat16 packs where oneDNN computes it natively (a CPU with AVX-512 bf16 or AMX), else stays plain.
    bf16 = nanoserve_model_from_hf(make_hf_llama(seed=4), dtype=torch.bfloat16)
    packs_bf16 = can_pack(torch.bfloat16)
    assert forms(prepared(bf16, dtype="bfloat16", quantization=None, dense_kernel="torch", fused_decode=False)) == {
        "onednn" if packs_bf16 else "torch"}


def test_llama3_rope_reaches_scaled_positions():
    # Positions past original_max_position_embeddings are where llama3 scaling changes anything.
    hf = make_hf_llama(seed=2, **ARCHITECTURES["llama3-rope"])
    engine = Engine(nanoserve_model_from_hf(hf), None, EngineConfig(dtype="float32", quantization=None, block_size=8, num_kv_blocks=40))
    long_prompt = [[7 + (i * 13) % 80 for i in range(120)]]
    captured, outputs = run_and_capture(engine, long_prompt, max_tokens=8)
    assert assert_logits_match(hf, captured, outputs) == 8


def test_chunked_prefill_logits_equal_transformers():
    hf = make_hf_llama(seed=3)
    config = EngineConfig(dtype="float32", quantization=None, block_size=4, num_kv_blocks=80, max_num_seqs=4, max_num_batched_tokens=7)
    engine = Engine(nanoserve_model_from_hf(hf), None, config)
    captured, outputs = run_and_capture(engine, PROMPTS, max_tokens=6)
    assert assert_logits_match(hf, captured, outputs) == len(PROMPTS) * 6

