"""Quantized layouts against their dequantized float32 reference.

The reference for a kernel is x @ w^T in float64, where w is the layout's dequantize(): the stored
form's own arithmetic, checked against gguf's in test_gguf. Tolerances come from the precision:
float32 activations sum K products each exact to float32's 2^-24, so 1e-5 of the output's scale;
bf16 activations and scales carry 8 bits of mantissa (2^-9 relative), so the output is held to 2%
of its scale.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_llama, nanoserve_model_from_hf, prepared
from test_precision import fake

from nanoserve.model.attention import AttentionMetadata, PrefillRun
from nanoserve.model.forms import Dense
from nanoserve.model.gguf import BlockQuantized
from nanoserve.model.kv_cache import KVCache
from nanoserve.model.llama import ModelInputs
from nanoserve.model.quant import (
    ChannelInt8,
    QuantLinear,
    cat_rows,
    kernel_passes,
    quant_linear,
    quantize_int4,
    quantize_int8,
)


def random_stored(kind: str, N: int, K: int, seed: int = 0):
    """A stored matrix with random codes and scales of the kind, as a GGUF file would hold it."""
    gen = torch.Generator().manual_seed(seed)
    B = K // 32
    scales = torch.rand(N, B, generator=gen) * 0.02 + 0.001
    if kind == "int8":
        return ChannelInt8(torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8), scales[:, 0])
    if kind == "Q8_0":
        return BlockQuantized("Q8_0", torch.randint(-128, 128, (N, K), generator=gen, dtype=torch.int8), scales, None)
    codes = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    mins = -8 * scales + torch.randn(N, B, generator=gen) * 0.01 if kind == "Q4_1" else None
    return BlockQuantized(kind, codes, scales, mins)


KINDS = ["Q4_0", "Q4_1", "Q8_0", "int8"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("N", [48, 40])  # 40: not a multiple of 16, the int4 kernel's padding
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_kernel_passes_equal_the_dequantized_matmul_in_float32(kind, N, rows):
    stored = random_stored(kind, N, 64)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(1))
    expected = x.double() @ stored.dequantize().double().T
    linear = quant_linear(stored, torch.float32, None, pack=False)
    assert linear.dense is None and len(linear.passes) == (2 if kind == "Q8_0" else 1)
    scale = expected.abs().max().item()
    torch.testing.assert_close(linear(x).double(), expected, atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_kernel_passes_in_bfloat16_stay_within_bf16_precision(kind):
    stored = random_stored(kind, 64, 128)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(2))
    expected = x.double() @ stored.dequantize().double().T
    out = quant_linear(stored, torch.bfloat16, None, pack=False)(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, atol=0.02 * expected.abs().max().item(), rtol=0)


def test_q8_0_splits_into_two_int4_passes_exactly():
    # Q8_0 code -77 = 16 * (-5) + 3: the high pass stores -5 + 8 = 3 at scale 16 d and zero 0; the
    # low pass stores 3 at scale d and zero 8 d. One row, one group, d = 0.5: w = -38.5 everywhere.
    stored = BlockQuantized("Q8_0", torch.full((16, 32), -77, dtype=torch.int8), torch.full((16, 1), 0.5), None)
    high, low = kernel_passes(stored, torch.float32)
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    assert high(x)[0, 0].item() == (3 - 8) * 8.0 + 0.0  # (q - 8) * 16 d + 0 = -40
    assert low(x)[0, 0].item() == (3 - 8) * 0.5 + 4.0  # (q - 8) * d + 8 d = 1.5
    assert (high(x) + low(x))[0, 0].item() == -38.5


def test_quantizers_round_to_the_nearest_level():
    # Bounds from the formulas: int8 error <= s / 2 with s = max|w| / 127 per row; int4 error
    # <= d / 2 with d = (max - min) / 15 per group of 32.
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(3))
    q8 = quantize_int8(w)
    assert q8.codes.dtype == torch.int8 and q8.codes.abs().max().item() == 127
    assert ((q8.dequantize() - w).abs() <= w.abs().amax(1, keepdim=True) / 127 / 2 + 1e-6).all()
    q4 = quantize_int4(w)
    assert q4.kind == "Q4_1" and q4.codes.min().item() == 0 and q4.codes.max().item() == 15
    groups = w.view(24, 2, 32)
    d = (groups.amax(-1) - groups.amin(-1)) / 15
    # d and m are fp16 (11 bits): m rounded down and d up, so d grows by at most a part in 2^10
    assert torch.equal(q4.scales.half().float(), q4.scales) and torch.equal(q4.mins.half().float(), q4.mins)
    assert (q4.scales >= d).all() and (q4.scales <= d * (1 + 2**-9)).all()
    assert ((q4.dequantize().view(24, 2, 32) - groups).abs() <= q4.scales.unsqueeze(-1) / 2 + 1e-6).all()


def test_rows_past_max_kernel_rows_read_the_dense_copy():
    stored = random_stored("Q4_1", 32, 64)
    linear = quant_linear(stored, torch.float32, 4, pack=False)
    assert linear.nbytes_by_kind() == {"dense_copies": 32 * 64 * 4, "quantized": 32 * 32 + 2 * 32 * 2 * 4}
    calls = []
    original = linear.passes[0]
    linear.passes[0] = lambda x: calls.append(x.shape[0]) or original(x)
    expected = lambda x: x @ stored.dequantize().T  # noqa: E731
    for rows in (1, 4, 5, 64):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(linear(x), expected(x), atol=1e-4, rtol=1e-4)
    assert calls == [1, 4]  # 5 and 64 rows went to the dense copy


def test_cat_rows_keeps_kinds_quantized_and_mixes_the_rest_into_dense():
    a, b = random_stored("Q4_1", 16, 32, 1), random_stored("Q4_1", 16, 32, 2)
    joined = cat_rows([a, b])
    assert isinstance(joined, BlockQuantized) and joined.kind == "Q4_1"
    torch.testing.assert_close(joined.dequantize(), torch.cat([a.dequantize(), b.dequantize()]), atol=0, rtol=0)
    q8 = random_stored("Q8_0", 16, 32, 3)
    two_kinds = cat_rows([a, q8])  # groups of 32 both: int8 codes, the same weights
    assert isinstance(two_kinds, BlockQuantized) and two_kinds.kind == "Q4_1+Q8_0"
    assert torch.equal(two_kinds.dequantize(), torch.cat([a.dequantize(), q8.dequantize()]))
    mixed = cat_rows([a, random_stored("int8", 16, 32, 4)])
    assert isinstance(mixed, torch.Tensor) and mixed.shape == (32, 32)


def _logits(model, token_ids):
    T = len(token_ids)
    kv = KVCache(model.config, -(-T // 4), 4, model.dtype, torch.device("cpu"))
    meta = AttentionMetadata(torch.arange(T), [], [PrefillRun(0, T, None, None)], 4)
    with torch.inference_mode():
        return model(ModelInputs(torch.tensor(token_ids), torch.arange(T), torch.arange(T), meta), kv)


def _dense_twin(model, quantization):
    """The float32 model whose matmul weights are `model`'s quantized by the same quantizers and
    dequantized by the stored forms' own arithmetic (as test_gguf checks it), not by the kernels:
    int8 everywhere, or int4 with the head in int8."""
    twin = prepared(model, dtype="float32", quantization=None, pack_weights=False)
    layer_quantizer = quantize_int8 if quantization == "int8" else quantize_int4
    for layer in twin.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(layer, name, Dense(layer_quantizer(getattr(layer, name).weight).dequantize()))
    twin.lm_head_weight = Dense(quantize_int8(model.lm_head).dequantize())
    return twin


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_tiny_model_equals_its_dequantized_float32_twin(quantization):
    model = nanoserve_model_from_hf(make_hf_llama(seed=5, intermediate_size=64))
    settings = dict(quantization=quantization, max_kernel_rows=None, pack_weights=False, kernels="torch",
                    fused_decode=False, kv_cache_dtype="float32")
    quantized = prepared(model, dtype="float32", **settings)
    assert all(isinstance(layer.qkv, QuantLinear) for layer in quantized.layers)
    assert isinstance(model.layers[0].qkv, Dense) and not stored_matrices(model)  # the given model unchanged
    tokens = [5, 17, 33, 2, 9, 60, 61, 12]
    torch.testing.assert_close(_logits(quantized, tokens), _logits(_dense_twin(model, quantization), tokens),
                               atol=1e-4, rtol=1e-4)
    # And in bf16 the same model stays within bf16's precision of its float32 run.
    bf16 = prepared(model, dtype="bfloat16", **settings)
    reference = _logits(quantized, tokens)
    torch.testing.assert_close(_logits(bf16, tokens), reference, atol=0.05 * reference.abs().max().item(), rtol=0)


def test_a_checkpoints_own_blocks_are_kept_and_run_as_stored():
    """A model loaded with GGUF-style blocks (Q4_1 linears, a Q8_0 tied embedding) runs the same
    logits as stored (dequantized on the fly: the reference) and in kernel form, in float32."""
    hf = make_hf_llama(seed=6, tie_word_embeddings=True)
    tensors = {}
    for name, w in hf.state_dict().items():
        if w.dim() == 2 and name != "lm_head.weight":
            tensors[name] = quantize_int4(w) if "layers" in name else _as_q8_0(w)
        else:
            tensors[name] = w
    from nanoserve.model.config import LlamaConfig
    from nanoserve.model.llama import LlamaModel

    stored = LlamaModel.from_state_dict(LlamaConfig.from_hf_dict(hf.config.to_dict()), tensors, torch.float32, "cpu")
    assert stored_matrices(stored) and isinstance(stored.embed, BlockQuantized)
    # a probe that times torch's int4 kernel faster than the dense matmul: the blocks are kept
    kept = prepared(stored, probe=fake(0.2, 14.0, int4_ms=0.01, dense_ms=1.0), dtype="float32", quantization="auto",
                    max_kernel_rows=None, pack_weights=False, kernels="torch", fused_decode=False, kv_cache_dtype="float32")
    assert isinstance(kept.layers[0].qkv, QuantLinear) and isinstance(kept.lm_head_weight, QuantLinear)
    assert len(kept.lm_head_weight.passes) == 2  # Q8_0: the two int4 passes
    tokens = [5, 17, 33, 2, 9, 60]
    torch.testing.assert_close(_logits(kept, tokens), _logits(stored, tokens), atol=1e-4, rtol=1e-4)
    dense = prepared(stored, dtype="float32", quantization=None, pack_weights=False)
    assert not stored_matrices(dense) and isinstance(dense.layers[0].qkv, Dense)
    torch.testing.assert_close(_logits(dense, tokens), _logits(stored, tokens), atol=1e-5, rtol=1e-5)


def _as_q8_0(w: torch.Tensor) -> BlockQuantized:
    N, K = w.shape
    groups = w.view(N, K // 32, 32)
    d = groups.abs().amax(-1) / 127
    codes = torch.round(groups / d.unsqueeze(-1)).to(torch.int8).view(N, K)
    return BlockQuantized("Q8_0", codes, d, None)


def stored_matrices(model) -> list:
    """The matmul weights of a model still quantized as stored."""
    return [w for _, _, w in model.matrices() if w.form.name == "stored"]
