"""llama.cpp's Q8_0 and Q4_0 blocks for a quantized K/V cache (EngineConfig.kv_cache_dtype "q8_0", "q4_0").

Each head's D values are cut into blocks of QK = 32 along D, each stored as its fp16 scale d and its
codes, as ggml lays block_q8_0 and block_q4_0 out:
- q8_0, 34 bytes: d = amax / 127, then 32 int8 codes q = roundf(x / d) (half away from zero); x = q d.
- q4_0, 18 bytes: d = max / -8, max the signed value of the first largest |x|, then 16 bytes, byte j
  holding value j's code in its low nibble and value j + 16's in its high one, q = min(15,
  trunc(x / d + 8.5)); x = (q - 8) d.
As ggml-quants.c's quantize_row_q8_0_ref / quantize_row_q4_0_ref round: in float32, x multiplied by
the float32 1 / d (not the fp16 d it stores), each operation rounded on its own, the scale rounded to
fp16 to nearest even last; so the bytes are gguf-py's `gguf.quants.quantize` bytes, and fused_decode.c's
store writes the same. Dequantized values d q are exact in float32 (11 bits times at most 8).

Before they are quantized, heads whose D is a multiple of 64 are turned by an orthonormal Walsh-Hadamard
matrix, as llama.cpp turns them for a quantized cache (llama-kv-cache.cpp's attn_rot_k / attn_rot_v,
llama-graph.cpp's build_attn): each run of n values of q and k by H_n, n the largest power of two
dividing D, and each run of 64 values of v by H_64, the attention's output turned back by H_64. The
scores q . k and the output are unchanged in exact arithmetic (H is orthonormal and its own
inverse); what changes is what a block of 32 holds: each turned value is a sum over its whole run,
so one outlier no longer sets the scale a block is rounded to. `rotate` turns, `quantize` does not:
paged_attention and fused_decode.c's attention turn q, k and v before the store, so the bytes a cache
holds are gguf-py's bytes of the turned values. On the default model
(SmolLM2-135M, D = 64, windows of 1024 tokens) this is most of q4_0's cost: perplexity over the float16
cache's +16.0% unturned, +5.5% turned (llama.cpp's own: +22.6% and +5.65%; notes/quantbench.md).

A cache row of Hkv heads is [Hkv, (D / 32) * BLOCK_BYTES[kind]] uint8; `kind_of` tells a quantized
cache from its row width and D. Dimension names: D head dim, W a head's bytes, nb its blocks, n a
rotation's width.
"""

from __future__ import annotations

import functools
import math

import torch

QK = 32  # values a block
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}  # bytes a block: the fp16 scale, then the codes


def check(kind: str, head_dim: int) -> None:
    """Raises ValueError where kind is no block kind, or a head of head_dim values cannot be cut into blocks."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"kv_cache_dtype={kind!r} is not one of the block kinds {list(BLOCK_BYTES)}")
    if head_dim % QK:
        raise ValueError(f"kv_cache_dtype={kind!r} stores blocks of {QK} values along each head, but head_dim="
                         f"{head_dim} is not a multiple of {QK}; use 'float16' or 'auto'")


def head_bytes(head_dim: int, kind: str) -> int:
    """W: the bytes one head's D values take."""
    return head_dim // QK * BLOCK_BYTES[kind]


def kind_of(cache: torch.Tensor, head_dim: int) -> str | None:
    """The block kind a cache [..., W] holds heads of head_dim values in; None for a float cache."""
    if cache.dtype != torch.uint8:
        return None
    for kind in BLOCK_BYTES:
        if cache.shape[-1] == head_bytes(head_dim, kind):
            return kind
    raise ValueError(f"a uint8 K/V cache of {cache.shape[-1]} bytes a head holds no block kind of head_dim {head_dim}")


def rotations(head_dim: int) -> tuple[int, int] | None:
    """(n_qk, n_v): the widths of the Walsh-Hadamard runs a quantized cache turns q and k, and v (and
    the output back), by; None where head_dim is not a multiple of 64 (nothing turned), as llama.cpp."""
    if head_dim % 64:
        return None
    return head_dim & -head_dim, 64  # the largest power of two dividing D: llama.cpp doubles 64 while it divides


def rotate(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., D] -> [..., D] in x's dtype: each run of n values times H_n / sqrt(n), in float32."""
    *lead, D = x.shape
    turned = x.float().reshape(*lead, D // n, n) @ _hadamard(n, x.device)  # [..., D / n, n]: H is symmetric
    return turned.reshape(*lead, D).to(x.dtype)


@functools.cache
def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    """[n, n] float32: Sylvester's Walsh-Hadamard matrix over sqrt(n) (n a power of two), as ggml_gen_hadamard."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)])  # [[H, H], [H, -H]]
    return (h / math.sqrt(n)).to(device)


def quantize(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x [..., D] (any float dtype, rounded from float32) -> [..., W] uint8 blocks of `kind`."""
    *lead, D = x.shape
    blocks = x.float().reshape(*lead, D // QK, QK)  # [..., nb, 32]
    if kind == "q8_0":
        amax = blocks.abs().amax(-1, keepdim=True)  # [..., nb, 1]
        # Divided by a tensor: CUDA divides by a scalar as a product with its reciprocal, a different rounding.
        d = amax / torch.full_like(amax, 127.0)
        scaled = blocks * _inverse(d)
        codes = _roundf(scaled).to(torch.int8).view(torch.uint8)  # [..., nb, 32]
    elif kind == "q4_0":
        first = blocks.abs().argmax(-1, keepdim=True)  # the first of equal |x|, as the reference's strict <
        largest = blocks.gather(-1, first)  # [..., nb, 1], signed
        d = largest / torch.full_like(largest, -8.0)
        scaled = blocks * _inverse(d) + 8.5  # two roundings, as the reference's x * id + 8.5f
        q = scaled.trunc().clamp(max=15).to(torch.uint8)  # [..., nb, 32], 0..15
        codes = q[..., : QK // 2] | (q[..., QK // 2:] << 4)  # [..., nb, 16]
    else:
        raise ValueError(f"kind={kind!r} is not one of {list(BLOCK_BYTES)}")
    scale = d.to(torch.float16).view(torch.uint8)  # [..., nb, 2], little-endian as ggml stores it
    return torch.cat([scale, codes], dim=-1).reshape(*lead, head_bytes(D, kind))  # [..., W]


def dequantize(data: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data [..., W] uint8 blocks of `kind` -> [..., D] in dtype (exact in float32)."""
    *lead, W = data.shape
    blocks = data.reshape(*lead, W // BLOCK_BYTES[kind], BLOCK_BYTES[kind])  # [..., nb, bytes]
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [..., nb, 1]
    codes = blocks[..., 2:]
    if kind == "q8_0":
        q = codes.contiguous().view(torch.int8).float()  # [..., nb, 32]
    else:
        q = torch.cat([codes & 15, codes >> 4], dim=-1).float() - 8  # [..., nb, 32]: values 0..15, then 16..31
    return (q * d).reshape(*lead, W // BLOCK_BYTES[kind] * QK).to(dtype)  # [..., D]


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d in float32, 0 where d is 0 (an all-zero block's codes are all 0, or all 8 in q4_0)."""
    return torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d) / d)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (half away from zero; torch.round goes to even), exactly: floor(|x|) plus 1 where the
    fraction |x| - floor(|x|), exact in float32, is at least a half (|x| + 0.5 would round up 0.49999997)."""
    a = x.abs()
    whole = a.floor()
    return torch.copysign(whole + (2 * (a - whole)).floor(), x)
