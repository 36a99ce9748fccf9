"""model/rope.py against transformers' own rotary embedding: ROPE_INIT_FUNCTIONS for the scaled
frequencies, LlamaRotaryEmbedding for the cos/sin tables, apply_rotary_pos_emb for the rotation."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from conftest import LLAMA3_ROPE, TINY
from transformers import LlamaConfig as HFLlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from nanoserve.model.config import LlamaConfig
from nanoserve.model.rope import apply_rope, inverse_frequencies, rope_table

# head_dim 16 with theta 1e4 puts the 8 wavelengths 2 pi 1e4^(i/8) at 6.3, 19.9, 62.8, ...: below
# original_max / high_freq_factor = 8 (kept), between 8 and original_max / low_freq_factor = 32
# (blended), and above 32 (divided by factor): all three llama3 bands, none near an edge.
ROPES = {
    "default": {},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "llama3": {"rope_scaling": LLAMA3_ROPE, "head_dim": 16},
    "llama3-theta5e5": {"rope_scaling": LLAMA3_ROPE, "head_dim": 16, "rope_theta": 500000.0},
}


def configs(name: str) -> tuple[HFLlamaConfig, LlamaConfig]:
    """The same architecture as transformers and nanoserve read it."""
    hf = HFLlamaConfig(**copy.deepcopy(TINY | ROPES[name]))  # transformers writes into rope_scaling
    return hf, LlamaConfig.from_hf_dict(hf.to_dict())


def transformers_inv_freq(hf: HFLlamaConfig) -> torch.Tensor:
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(hf)[0]
    return ROPE_INIT_FUNCTIONS[rope_type](hf)[0]


@pytest.mark.parametrize("name", sorted(ROPES))
def test_inverse_frequencies_equal_transformers(name):
    hf, config = configs(name)
    ours = inverse_frequencies(config)
    assert ours.dtype == torch.float64 and ours.shape == (config.head_dim // 2,)
    # transformers computes in float32: compare at float32's resolution.
    torch.testing.assert_close(ours.float(), transformers_inv_freq(hf), rtol=2e-7, atol=0.0)


def test_llama3_scaling_keeps_blends_and_divides_by_band():
    _, config = configs("llama3")
    plain = inverse_frequencies(dataclasses.replace(config, rope_scaling=None))
    scaled = inverse_frequencies(config)
    wavelengths = [2 * math.pi / f for f in plain.tolist()]
    assert wavelengths[0] < 8 < wavelengths[1] < 32 < wavelengths[2]  # the three bands all occur
    assert scaled[0].item() == plain[0].item()  # short wavelength: kept
    torch.testing.assert_close(scaled[2:], plain[2:] / 8.0, rtol=1e-15, atol=0.0)  # long: divided by factor
    # Medium, by hand: smooth = (32 / wavelength - 1) / (4 - 1); (1 - smooth) f / 8 + smooth f.
    smooth = (32 / wavelengths[1] - 1.0) / 3.0
    f = plain[1].item()
    assert scaled[1].item() == pytest.approx((1 - smooth) * f / 8 + smooth * f, rel=1e-14)
    assert f / 8 < scaled[1].item() < f


def test_linear_scaling_divides_every_frequency_by_the_factor():
    _, config = configs("linear")
    plain = dataclasses.replace(config, rope_scaling=None)
    torch.testing.assert_close(inverse_frequencies(config), inverse_frequencies(plain) / 4.0, rtol=1e-15, atol=0.0)


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_table_equals_transformers_rotary_embedding(name):
    hf, config = configs(name)
    positions = 256
    ref_cos, ref_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1), torch.arange(positions)[None])  # [1, P, D]
    cos, sin = rope_table(config, positions, torch.float32, torch.device("cpu"))
    assert cos.shape == sin.shape == (positions, config.head_dim)
    assert cos.dtype == sin.dtype == torch.float32
    # transformers forms the angles position * inv_freq in float32 (up to 255 rad, ulp 1.5e-5 / 2);
    # nanoserve in float64. The measured gap is 3e-6; 1e-5 still refuses any wrong frequency.
    torch.testing.assert_close(cos, ref_cos[0], rtol=0.0, atol=1e-5)
    torch.testing.assert_close(sin, ref_sin[0], rtol=0.0, atol=1e-5)


def test_rope_table_is_cast_to_the_asked_dtype():
    _, config = configs("default")
    cos64, sin64 = rope_table(config, 40, torch.float64, torch.device("cpu"))
    cos16, sin16 = rope_table(config, 40, torch.bfloat16, torch.device("cpu"))
    assert cos16.dtype == sin16.dtype == torch.bfloat16
    assert torch.equal(cos16, cos64.to(torch.bfloat16)) and torch.equal(sin16, sin64.to(torch.bfloat16))
    # Position 0 is no rotation; position 1's first angle is 1 rad (inv_freq[0] = theta^0 = 1).
    assert torch.equal(cos64[0], torch.ones(8, dtype=torch.float64))
    assert torch.equal(sin64[0], torch.zeros(8, dtype=torch.float64))
    assert cos64[1, 0].item() == math.cos(1.0) and sin64[1, 4].item() == math.sin(1.0)


def test_apply_rope_equals_transformers_apply_rotary_pos_emb():
    hf, config = configs("llama3")
    gen = torch.Generator().manual_seed(0)
    T, H, Hkv, D = 7, 4, 2, config.head_dim
    q, k = torch.randn(T, H, D, generator=gen), torch.randn(T, Hkv, D, generator=gen)
    positions = torch.tensor([0, 1, 2, 40, 41, 100, 255])  # not contiguous: rows gathered from a table
    cos_table, sin_table = rope_table(config, 256, torch.float32, torch.device("cpu"))
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)  # [T, 1, D]
    # transformers' layout: q, k [B, heads, T, D] with cos, sin [B, T, D].
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_table[positions][None],
                                        sin_table[positions][None])
    # The same elementwise arithmetic on the same numbers: equal to the bit.
    torch.testing.assert_close(apply_rope(q, cos, sin), ref_q[0].transpose(0, 1), rtol=0.0, atol=0.0)
    torch.testing.assert_close(apply_rope(k, cos, sin), ref_k[0].transpose(0, 1), rtol=0.0, atol=0.0)


def test_apply_rope_rotates_each_pair_by_its_angle():
    # Hand arithmetic: D = 2, one pair (x0, x1) rotated by angle a is (x0 cos a - x1 sin a, x1 cos a + x0 sin a).
    a = 0.3
    x = torch.tensor([[[2.0, 5.0]]], dtype=torch.float64)  # [T=1, heads=1, D=2]
    cos = torch.full((1, 1, 2), math.cos(a), dtype=torch.float64)
    sin = torch.full((1, 1, 2), math.sin(a), dtype=torch.float64)
    out = apply_rope(x, cos, sin)[0, 0].tolist()
    assert out == pytest.approx([2 * math.cos(a) - 5 * math.sin(a), 5 * math.cos(a) + 2 * math.sin(a)], rel=1e-15)


def test_partial_rope_rotates_the_first_dimensions_and_passes_the_rest():
    # Phi-3's partial rotary by hand: D = 4, Dr = 2: the pair (x0, x1) rotated by a, x2 and x3 as they are.
    a = 0.7
    x = torch.tensor([[[2.0, 5.0, -3.0, 11.0]]], dtype=torch.float64)  # [T=1, heads=1, D=4]
    cos = torch.full((1, 1, 2), math.cos(a), dtype=torch.float64)  # [T, 1, Dr]
    sin = torch.full((1, 1, 2), math.sin(a), dtype=torch.float64)
    out = apply_rope(x, cos, sin)[0, 0].tolist()
    assert out[:2] == pytest.approx([2 * math.cos(a) - 5 * math.sin(a), 5 * math.cos(a) + 2 * math.sin(a)], rel=1e-15)
    assert out[2:] == [-3.0, 11.0]
