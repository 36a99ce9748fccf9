"""The block formats of llama.cpp's quantized tensors, unpacked into codes and per-group scales.

Every type below decodes to the same three arrays, whatever its bit packing: for a row of K
weights in groups of G (32, or 16 where a type scales 16 weights at a time),

    codes  [N, K]      small integers, uint8 (UNSIGNED kinds) or int8
    scales [N, K / G]  float32
    mins   [N, K / G]  float32, or None

and w[n, k] = scales[n, k // G] * codes[n, k] + mins[n, k // G] (Q4_0: codes - 8 in place of codes).
That is gguf.quants.dequantize's arithmetic in float32, product for product: a K-quant's group
scale is its fp16 super-block scale times the 6-bit (or int8) group scale, exact in float32, and
its min the same for the mins, subtracted, so the dense matrix comes out bit for bit
(tests/test_gguf_types.py holds every type to gguf-py).

Layouts, per block of B weights in `nbytes` bytes (ggml-common.h's block_* structs):
  Q4_0   32,  18: fp16 d; 16 bytes of 4-bit q (byte j: weight j low, j + 16 high); w = d (q - 8)
  Q4_1   32,  20: fp16 d, fp16 m; 4-bit q as Q4_0; w = d q + m
  Q5_0   32,  22: fp16 d; uint32 qh (bit j: weight j's fifth bit); 4-bit low parts as Q4_0; w = d (q - 16)
  Q5_1   32,  24: fp16 d, fp16 m; qh; low parts; w = d q + m
  Q8_0   32,  34: fp16 d; 32 int8 q; w = d q
  IQ4_NL 32,  18: fp16 d; 4-bit indices as Q4_0 into the 16 int8 values KVALUES; w = d KVALUES[i]
  Q2_K  256,  84: 16 bytes of group scale (low 4 bits) and min (high 4); 64 bytes of 2-bit q; fp16 d, dmin;
                  16 groups of 16: w = d sc q - dmin mn
  Q3_K  256, 110: 32 bytes of high bits; 64 of 2-bit low parts; 12 of 6-bit group scales; fp16 d;
                  16 groups of 16: w = d (sc - 32) q, q = low - 4 where the high bit is clear, in -4..3
  Q4_K  256, 144: fp16 d, dmin; 12 bytes of 6-bit scales and mins; 128 of 4-bit q; 8 groups of 32:
                  w = d sc q - dmin mn
  Q5_K  256, 176: as Q4_K with 32 bytes of fifth bits before the low parts
  Q6_K  256, 210: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 group scales, fp16 d; 16 groups
                  of 16: w = d sc (q - 32)
  IQ4_XS 256, 136: fp16 d; uint16 and 4 bytes of 6-bit group scales; 128 bytes of indices; 8 groups of
                  32: w = d (ls - 32) KVALUES[i]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)

Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # codes [n, B], scales [n, B / G], mins or None


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of each block [n, bytes] -> [n, 1] float32 (widening is exact)."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] 4-bit values: byte j's low half is value j, its high half j + 16."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(packed: np.ndarray, count: int, width: int = 1) -> np.ndarray:
    """[..., L] unsigned ints -> [..., count, L]: field i (of `width` bits, from the low end) of each."""
    shifts = (np.arange(count, dtype=packed.dtype) * width).reshape(count, 1)
    return (packed[..., None, :] >> shifts) & ((1 << width) - 1)


def _q4_0(b: np.ndarray) -> Unpacked:
    return _nibbles(b[:, 2:18]), _f16(b, 0), None


def _q4_1(b: np.ndarray) -> Unpacked:
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _fifth_bits(b: np.ndarray, at: int) -> np.ndarray:
    """Q5_0/Q5_1's uint32 of fifth bits at byte `at` -> [n, 32] in 0..1."""
    qh = np.ascontiguousarray(b[:, at:at + 4]).view("<u4")  # [n, 1]
    return ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q5_0(b: np.ndarray) -> Unpacked:
    q = _nibbles(b[:, 6:22]) | (_fifth_bits(b, 2) << 4)
    return (q.astype(np.int16) - 16).astype(np.int8), _f16(b, 0), None


def _q5_1(b: np.ndarray) -> Unpacked:
    q = _nibbles(b[:, 8:24]) | (_fifth_bits(b, 4) << 4)
    return q.astype(np.int8), _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray) -> Unpacked:
    return np.array(b[:, 2:34]).view(np.int8), _f16(b, 0), None


def _iq4_nl(b: np.ndarray) -> Unpacked:
    return KVALUES[_nibbles(b[:, 2:18])], _f16(b, 0), None


def _two_bit_planes(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K's 64 bytes of 2-bit parts [n, 64] -> [n, 256]: weight 128 h + 32 s + l is bits 2 s of byte 32 h + l."""
    n = qs.shape[0]
    return _bits(qs.reshape(n, 2, 32), 4, 2).reshape(n, 256)


def _q2_k(b: np.ndarray) -> Unpacked:
    sc = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    return _two_bit_planes(b[:, 16:80]), d * (sc & 0x0F).astype(np.float32), -(dmin * (sc >> 4).astype(np.float32))


def _q3_k(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    high = _bits(b[:, 0:32], 8).reshape(n, 256)  # weight 32 i + l: bit i of byte l
    q = _two_bit_planes(b[:, 32:96]).astype(np.int8) - 4 * (1 - high).astype(np.int8)
    raw = b[:, 96:108]
    low4 = np.concatenate([raw[:, :8] & 0x0F, raw[:, :8] >> 4], axis=-1)  # groups 0-7, then 8-15
    high2 = _bits(raw[:, 8:12], 4, 2).reshape(n, 16)  # group 4 t + j: bits 2 t of byte 8 + j
    sc = (low4 | (high2 << 4)).astype(np.int8) - 32
    return q, _f16(b, 108) * sc.astype(np.float32), None


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes [n, 12] -> the 8 groups' 6-bit scales and mins, each [n, 8] float32.
    Groups 0-3: low 6 bits of bytes 0-3 (scales) and 4-7 (mins); groups 4-7: the low (scales) and
    high (mins) halves of bytes 8-11, their top 2 bits the top bits of bytes 0-3 and 4-7."""
    d, m, md = raw[:, 0:4], raw[:, 4:8], raw[:, 8:12]
    scales = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes [n, 128] -> [n, 256]: weight 64 c + 32 t + l is half t of byte 32 c + l."""
    n = qs.shape[0]
    return _bits(qs.reshape(n, 4, 32), 2, 4).reshape(n, 256)


def _q4_k(b: np.ndarray) -> Unpacked:
    sc, mn = _k_scales(b[:, 4:16])
    return _k_nibbles(b[:, 16:144]), _f16(b, 0) * sc, -(_f16(b, 2) * mn)


def _q5_k(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    fifth = _bits(b[:, 16:48], 8).reshape(n, 256)  # weight 32 i + l: bit i of byte l
    q = _k_nibbles(b[:, 48:176]) | (fifth << 4)
    return q.astype(np.int8), _f16(b, 0) * sc, -(_f16(b, 2) * mn)


def _q6_k(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    low = _bits(b[:, 0:128].reshape(n, 2, 64), 2, 4).reshape(n, 256)  # 128 h + 64 t + l: half t of byte 64 h + l
    high = _bits(b[:, 128:192].reshape(n, 2, 32), 4, 2).reshape(n, 256)  # 128 h + 32 s + l: bits 2 s of byte 32 h + l
    q = (low | (high << 4)).astype(np.int8) - 32
    sc = np.array(b[:, 192:208]).view(np.int8).astype(np.float32)
    return q, _f16(b, 208) * sc, None


def _iq4_xs(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    high = _bits(np.ascontiguousarray(b[:, 2:4]).view("<u2"), 8, 2).reshape(n, 8)  # group i: bits 2 i
    low = np.stack([b[:, 4:8] & 0x0F, b[:, 4:8] >> 4], axis=-1).reshape(n, 8)  # group i: half i % 2 of byte i // 2
    ls = (low | (high.astype(np.uint8) << 4)).astype(np.int8) - 32
    return KVALUES[_nibbles(b[:, 8:136].reshape(n, 8, 16)).reshape(n, 256)], _f16(b, 0) * ls.astype(np.float32), None


@dataclass(frozen=True)
class BlockType:
    name: str
    type_id: int  # ggml_type
    weights: int  # per block
    nbytes: int  # per block
    group: int  # weights a scale covers once unpacked
    unpack: Callable[[np.ndarray], Unpacked]

    @property
    def has_mins(self) -> bool:
        return self.name in ("Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K")

    @property
    def unsigned(self) -> bool:
        """Codes in uint8 (0..15 or 0..3); the rest are int8."""
        return self.name in UNSIGNED


UNSIGNED = ("Q4_0", "Q4_1", "Q2_K", "Q4_K")
BLOCK_TYPES = {t.name: t for t in (
    BlockType("Q4_0", 2, 32, 18, 32, _q4_0),
    BlockType("Q4_1", 3, 32, 20, 32, _q4_1),
    BlockType("Q5_0", 6, 32, 22, 32, _q5_0),
    BlockType("Q5_1", 7, 32, 24, 32, _q5_1),
    BlockType("Q8_0", 8, 32, 34, 32, _q8_0),
    BlockType("Q2_K", 10, 256, 84, 16, _q2_k),
    BlockType("Q3_K", 11, 256, 110, 16, _q3_k),
    BlockType("Q4_K", 12, 256, 144, 32, _q4_k),
    BlockType("Q5_K", 13, 256, 176, 32, _q5_k),
    BlockType("Q6_K", 14, 256, 210, 16, _q6_k),
    BlockType("IQ4_NL", 20, 32, 18, 32, _iq4_nl),
    BlockType("IQ4_XS", 23, 256, 136, 32, _iq4_xs),
)}
BY_ID = {t.type_id: t for t in BLOCK_TYPES.values()}


def parts(kind: str) -> list[str]:
    """The file types a stored kind holds: itself, or for the rows of several types stacked into one
    matrix (q, k and v of different types: "Q5_0+Q8_0", int8 codes in groups of 32), each of them."""
    return kind.split("+")
UNPACK_ROWS = 4096  # rows unpacked at a time: the temporaries of a wide matrix stay a few tens of MB


def unpack_rows(raw: np.ndarray, kind: str) -> Unpacked:
    """A matrix's stored rows raw [N, K / weights * nbytes] uint8 -> codes [N, K], scales and mins [N, K / group]."""
    t = BLOCK_TYPES[kind]
    N = raw.shape[0]
    K = raw.shape[1] // t.nbytes * t.weights
    codes = np.empty((N, K), dtype=np.uint8 if t.unsigned else np.int8)
    scales = np.empty((N, K // t.group), dtype=np.float32)
    mins = np.empty_like(scales) if t.has_mins else None
    for start in range(0, N, UNPACK_ROWS):
        part = raw[start:start + UNPACK_ROWS]
        rows = part.shape[0]
        q, s, m = t.unpack(part.reshape(-1, t.nbytes))  # [rows * blocks, ...]
        codes[start:start + rows] = q.reshape(rows, K)
        scales[start:start + rows] = s.reshape(rows, -1)
        if mins is not None:
            mins[start:start + rows] = m.reshape(rows, -1)
    return codes, scales, mins
