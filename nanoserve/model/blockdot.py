"""blockdot: nanoserve's own CPU kernel for block-quantized linears at few rows (blockdot.c).

torch's one-row int4 kernel rounds a GGUF file's fp16 scales to bf16, runs a Q8_0 matrix (the
default model's embedding and tied head) as two int4 passes, and has no fast path on a CPU without
AVX-512 bf16. blockdot reads the file's 4- and 8-bit codes and fp16 scales exactly, 16 output rows
to a vector (AVX-512, AVX2, or plain C), against x in float32 or, from `int16_rows` rows of x
(PlanOverrides.blockdot_int16_rows), x rounded to int16 per block of 32 and summed in integers. The C
source (with fused_decode.c, the decode step's glue that calls it) is compiled once per machine at
first use (`cc -O3 -march=native -fopenmp`, cached; nanoserve.model.cabi builds, loads and checks
it) and loaded with ctypes; where there is no compiler, or the build fails, `library()` is None,
torch's kernels serve, and a WARNING says so.
Whether it is used is not assumed: nanoserve.model.precision times it against torch's kernel at
start-up.

`pack` turns a `BlockQuantized` matrix (every kind in KINDS, and nanoserve's own int4) into `Panels`
without a float round trip: the codes regrouped into panels of 16 output rows, the scales as stored.
A block of 16 rows by 32 weights is its head (fp16 d and m: 64 bytes; float32: 128) and its codes
(256 bytes of 4-bit ones, 512 of int8): 5 bits a weight for Q4_0 (4.5 in its file) and Q4_1 (5); 6
for Q4_K (4.5); 9 for Q8_0 (8.5), Q5_0 (5.5), Q5_1 (6) and IQ4_NL (4.5); 10 for Q5_K (5.5), Q6_K
(6.6), IQ4_XS (4.25) and Q3_K (3.4): the price of reading each exactly with two kernels
(notes/gguf-types.md). `Panels` take x [M, K] in float32 or bfloat16 and return [M, N] in x's dtype.

`pack_int8` holds a Q4_K, Q6_K or IQ4_XS matrix, or one of the 32-weight kinds (Q4_0, IQ4_NL, Q8_0,
Q4_1, Q5_0, Q5_1; K a multiple of 32), at its file's bits instead (file-bit panels, x rounded to int8
per block of 32, sums in int32); on a CPU with AMX tiles (`amx()`), from `amx_rows` rows of x
(PlanOverrides.blockdot_amx_rows), a K-quant's sums come from the tiles, bit for bit.
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# BUILDS, FLAGS, _BASE: re-exported, where the kernel's tests and benchmarks find the builds
from nanoserve.model.cabi import BASE_FLAGS as _BASE  # noqa: F401
from nanoserve.model.cabi import BUILDS, FLAGS, Library, load  # noqa: F401
from nanoserve.model.forms import CForm, Form, FormKind, Regroup, dense_code, dtype_name
from nanoserve.model.ggml_blocks import KVALUES, parts
from nanoserve.model.gguf import BLOCK, BlockQuantized, FileBlocks

logger = logging.getLogger(__name__)

PANEL = 16  # output rows a panel holds: one 16-lane vector
# What blockdot runs: one scale (and min) per group of 32, exactly as stored; 4-bit codes (Q4_0,
# Q4_1, Q4_K) in 1 plane, int8 codes in 2 (Q8_0's, Q5_0's q - 16, Q5_1's and Q5_K's q, IQ4_NL's and
# IQ4_XS's table values). Scales that fp16 holds exactly (every 32-weight kind's, stored as fp16) go
# in fp16 heads; the K-quants' (fp16 d times a 6-bit group scale) in float32 heads (F32_HEADS).
# Q6_K and Q3_K scale each 16 weights and have no mins: their int8 codes in panels whose float32
# heads hold the two scales of each block of 32 (G16); Q2_K's mins for each 16 after them (G16M).
KINDS = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "IQ4_XS", "Q6_K", "Q3_K", "Q2_K")
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
F32_HEADS = 4  # blockdot.c's flag on `planes`: the heads hold float32 d and m
G16 = 8  # blockdot.c's flag on `planes` (with F32_HEADS): the heads hold the d of each 16 weights, no m
G16M = 16  # blockdot.c's flag on `planes` (with G16): the m of each 16 weights after their d
DTYPES = (torch.float32, torch.bfloat16)  # the activations it takes
# File-bit panels (blockdot.c's I8P): a matrix at its file's bits, run on x rounded to int8 per block
# of 32 and summed in integers. planes = I8P | type << 8; a K-quant's panels go by super-blocks of 256
# weights (16 rows): Q4_K 4.75 bits a weight (the file's 4.5), Q6_K 6.625 (6.5625), IQ4_XS 4.375
# (4.25); a 32-weight kind's by blocks of 32 (BLOCK_KINDS, K a multiple of 32), at exactly the file's
# bits: Q4_0 and IQ4_NL 4.5, Q4_1 5, Q5_0 5.5, Q5_1 6, Q8_0 8.5 (fp16 scales, as stored).
I8P = 32
INT8_KINDS = {"Q4_K": 1, "Q6_K": 2, "IQ4_XS": 3, "Q4_0": 4, "IQ4_NL": 5, "Q8_0": 6, "Q4_1": 7, "Q5_0": 8, "Q5_1": 9}
BLOCK_KINDS = ("Q4_0", "IQ4_NL", "Q8_0", "Q4_1", "Q5_0", "Q5_1")
# The kinds the plan puts on file-bit panels (PlanOverrides.blockdot_int8, `takes_int8`): the K-quants,
# and the 32-weight kinds blockdot's other panels hold as int8 codes (9 bits a weight against the file's
# 4.5 for IQ4_NL, 5.5 for Q5_0, 6 for Q5_1, 8.5 for Q8_0). Q4_0 and Q4_1 keep those panels' 4-bit codes
# (5 bits a weight, about their file's) on the int16 path: notes/file-bit-panels.md has the timings.
INT8_CHOSEN = ("Q4_K", "Q6_K", "IQ4_XS", "IQ4_NL", "Q5_0", "Q5_1", "Q8_0")
MIXED = 15  # blockdot.c's I8_MIXED: runs of rows of those kinds stacked, each run's panels after a head
SEGMENTS = 7  # runs a mixed matrix may hold
SUPER = 256  # weights a super-block


def unit(kind: str) -> int:
    """The k a file-bit panel of this kind goes by: a block of 32 (BLOCK_KINDS) or a super-block of 256."""
    return BLOCK if kind in BLOCK_KINDS else SUPER


# The process's build, made once (cabi.load); here rather than in cabi so that a test can fake a
# machine without a compiler by setting these two.
_library: Library | None = None
_failure: str | None = None


def library() -> Library | None:
    """The compiled kernel, built on first call and cached on disk; None where it cannot be built
    (`failure()` says why)."""
    global _library, _failure
    if _library is None and _failure is None:
        try:
            _library = load()
        except (OSError, subprocess.SubprocessError) as exc:
            _failure = f"{type(exc).__name__}: {exc}"
            logger.warning("nanoserve: the blockdot kernels could not be built (%s): quantized GGUF linears fall back "
                           "to torch's kernels and decode steps to torch's ops, several times slower on a CPU; install "
                           "a C compiler (gcc) with OpenMP", _failure)
    return _library


def failure() -> str | None:
    """Why `library()` is None, once it has been tried."""
    return _failure


def supports(w: object, dtype: torch.dtype) -> bool:
    """Whether blockdot runs this stored matrix with activations in dtype."""
    return (isinstance(w, BlockQuantized) and runs(w.kind) and dtype in DTYPES and w.codes.device.type == "cpu")


def runs(kind: str) -> bool:
    """Whether blockdot runs a stored kind (rows of several kinds stacked: each of them)."""
    return all(part in KINDS for part in parts(kind))


def _fp16_exact(w: BlockQuantized) -> bool:
    """The kernel reads fp16 d and m: a GGUF file's are, nanoserve's own int4 rounds to them; Q4_0's m
    (-8 d) is then exact too unless it overflows fp16, and the kinds without mins add 0."""
    return all(torch.equal(t.half().float(), t) for t in (w.scales, _mins(w)))


def _mins(w: BlockQuantized) -> torch.Tensor:
    """Every block's additive min: Q4_0's d (q - 8) = d q + (-8 d); kinds without mins add 0."""
    if w.kind == "Q4_0":
        return -8 * w.scales
    return torch.zeros_like(w.scales) if w.mins is None else w.mins


@dataclass
class Panels:
    """A matrix of one of KINDS [N, K] in blockdot's panels: [ceil(N / 16), K / 32, 64 + 256 planes]
    uint8 (blockdot.c's header gives the bytes: 4-bit codes where planes is 1, int8 where 2)."""

    data: torch.Tensor
    planes: int  # 1 (4-bit codes) or 2 (int8 codes, two nibbles' room), | F32_HEADS for float32 heads
    shape: tuple[int, int]  # (N, K)
    kernel: Library  # the build that runs it
    int16_rows: int = 0  # from this many rows of x on, the int16 path (x rounded to int16 per block); 0: never
    amx_rows: int = 0  # file-bit panels: from this many rows of x on, AMX tiles (the same sums); 0: never

    def __post_init__(self) -> None:
        """blockdot.c reads the panels by their shape alone: checked here, once, for every later call."""
        N, K = self.shape
        if K % BLOCK:
            raise ValueError(f"blockdot panels hold matrices whose K is a multiple of {BLOCK}; got K = {K}")
        if self.planes & I8P:
            data = self.data
            if self.planes >> 8 == MIXED:  # a head of segments, then their panels: one byte string
                ok = data.dim() == 1 and data.numel() >= 64 and data.dtype == torch.uint8
                expected = self.kernel.lib.blockdot_i8_mixed_bytes(data.data_ptr(), N, K) if ok else -1
                if expected != data.numel() or not data.is_contiguous() or data.device.type != "cpu":
                    raise ValueError(f"mixed file-bit panels of [{N}, {K}]: a head naming segments of known types "
                                     f"whose panels add up to {-(-N // PANEL)}, then their bytes ({expected}); got "
                                     f"{data.dtype} {list(data.shape)}")
                return
            sb, weights = self.kernel.lib.blockdot_i8_bytes(self.planes), self.kernel.lib.blockdot_i8_weights(self.planes)
            expected = [-(-N // PANEL), K // max(weights, 1), sb]
            if not sb or K % weights or list(data.shape) != expected or data.dtype != torch.uint8 \
                    or data.device.type != "cpu" or not data.is_contiguous():
                raise ValueError(f"file-bit panels (planes {self.planes}) of [{N}, {K}] are a contiguous uint8 tensor "
                                 f"{expected} on the CPU with K a multiple of {weights or SUPER}; got "
                                 f"{self.data.dtype} {list(self.data.shape)} on {self.data.device}")
            return
        if self.planes not in (1, 2, 1 | F32_HEADS, 2 | F32_HEADS, 2 | F32_HEADS | G16, 2 | F32_HEADS | G16 | G16M):
            raise ValueError(f"blockdot panels have 1 plane (4-bit codes) or 2 (int8 codes), | {F32_HEADS} for float32 "
                             f"heads, | {G16} for two scales a block (int8), | {G16M} for two mins too; "
                             f"got planes = {self.planes}")
        head = 256 if self.planes & G16M else 128 if self.planes & F32_HEADS else 64
        expected = [-(-N // PANEL), K // BLOCK, head + 256 * (self.planes & 3)]
        data = self.data
        if list(data.shape) != expected or data.dtype != torch.uint8 or data.device.type != "cpu" \
                or not data.is_contiguous():
            raise ValueError(f"blockdot panels of [{N}, {K}] in {self.planes} plane(s) are a contiguous uint8 tensor "
                             f"{expected} on the CPU; got {data.dtype} {list(data.shape)} on {data.device}"
                             f"{'' if data.is_contiguous() else ', not contiguous'}")

    @property
    def form_name(self) -> FormKind:
        """QuantLinear.form's name for a linear on these panels."""
        return FormKind.BLOCKDOT_INT8 if self.planes & I8P else FormKind.BLOCKDOT

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        N, K = self.shape
        if x.dtype not in DTYPES:
            raise ValueError(f"blockdot takes activations in {[str(d) for d in DTYPES]}, got {x.dtype}")
        if x.dim() != 2 or x.shape[1] != K:
            raise ValueError(f"blockdot panels [{N}, {K}] take x [M, {K}], got {list(x.shape)}")
        if x.device.type != "cpu":
            raise ValueError(f"blockdot runs on the CPU; got x on {x.device}")
        x = x.contiguous()
        M = x.shape[0]
        y = torch.empty(M, N, dtype=x.dtype)
        bf16 = int(x.dtype == torch.bfloat16)
        if self.kernel.lib.blockdot(x.data_ptr(), bf16, M, K, N, self.data.data_ptr(), self.planes,
                                    y.data_ptr(), bf16, torch.get_num_threads(), self.int16_rows,
                                    self.amx_rows):
            raise MemoryError(f"blockdot: no memory for float32 copies of [{M}, {K}] activations")
        return y

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense matrix [N, K] in dtype (float32 or bfloat16), bit for bit the stored matrix's
        dequantize() (rounded to bf16 as torch rounds, where bfloat16)."""
        if dtype not in DTYPES:
            raise ValueError(f"blockdot dequantizes to {[str(d) for d in DTYPES]}, got {dtype}")
        out = torch.empty(self.shape, dtype=dtype)
        self.kernel.lib.blockdot_dequantize(self.data.data_ptr(), self.planes, *self.shape, out.data_ptr(),
                                            int(dtype == torch.bfloat16), torch.get_num_threads())
        return out

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ids [T] of the matrix [T, K] in dtype, bit for bit dequantize()'s: an embedding's lookup
        read from the tied head's file-bit panels (I8P only), so the table is held once."""
        if not self.planes & I8P or dtype not in DTYPES:
            raise ValueError(f"lookup reads file-bit panels into {[str(d) for d in DTYPES]}; got planes "
                             f"{self.planes}, {dtype}")
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), self.shape[1], dtype=dtype)
        if self.kernel.lib.blockdot_dequantize_rows(self.data.data_ptr(), self.planes, *self.shape, ids.data_ptr(),
                                                    ids.numel(), out.data_ptr(), int(dtype == torch.bfloat16)):
            raise ValueError(f"token ids must be in [0, {self.shape[0]}); got {ids.min().item()}..{ids.max().item()}")
        return out

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


@dataclass
class DensePanels:
    """A dense float32 or bf16 matrix [N, K] regrouped once into blockdot.c's dense panels (16 output
    rows a panel, k-major; see pack_dense) and multiplied there, bf16 widened to float32 in registers
    and summed in float32: the fused decode's dense matmuls, and any linear a model hands it (a bf16
    model's head where the probe times torch's bf16 slower than float32). Returns [M, N] in x's
    dtype, as `linear` does."""

    data: torch.Tensor  # [ceil(N / 16), K, 16] in the matrix's dtype (bf16 in blockdot.c's word order)
    shape: tuple[int, int]  # (N, K)
    kernel: Library

    def __post_init__(self) -> None:
        """blockdot.c reads the panels by their shape alone: checked here, once, for every later call."""
        N, K = self.shape
        expected, data = [-(-N // PANEL), K, PANEL], self.data
        if list(data.shape) != expected or data.dtype not in DTYPES or data.device.type != "cpu" \
                or not data.is_contiguous():
            raise ValueError(f"dense panels of [{N}, {K}] are a contiguous float32 or bf16 tensor {expected} on the "
                             f"CPU; got {data.dtype} {list(data.shape)} on {data.device}"
                             f"{'' if data.is_contiguous() else ', not contiguous'}")

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def form(self) -> Form:
        return Form(FormKind.DENSE_PANELS, dtype_name(self.dtype))

    def nbytes_by_kind(self) -> dict[str, int]:
        return {"dense": self.data.nbytes}

    def c_form(self, regroup: Regroup) -> CForm:
        return CForm(self.data, dense_code(self.dtype), copied=False)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.dense().to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in DTYPES:
            raise ValueError(f"dense panels take activations in {[str(d) for d in DTYPES]}, got {x.dtype}")
        if x.dim() != 2 or x.shape[1] != self.shape[1]:
            raise ValueError(f"dense panels [{self.shape[0]}, {self.shape[1]}] take x [M, {self.shape[1]}], "
                             f"got {list(x.shape)}")
        if x.device.type != "cpu":
            raise ValueError(f"dense panels run on the CPU; got x on {x.device}")
        x32 = x.float().contiguous()  # bf16 widens exactly
        M, K = x32.shape
        y = torch.empty(M, self.shape[0], dtype=torch.float32)
        self.kernel.lib.blockdot_dense(x32.data_ptr(), M, K, self.shape[0], self.data.data_ptr(),
                                       int(self.dtype == torch.bfloat16), y.data_ptr(), torch.get_num_threads())
        return y.to(x.dtype)

    def dense(self) -> torch.Tensor:
        """The matrix [N, K] as it was given (its values and dtype)."""
        N, K = self.shape
        data = self.data
        if data.dtype == torch.bfloat16 and self.kernel.lib.blockdot_dense_pairs():
            data = data[..., _PAIR_ORDER.argsort()]
        return data.transpose(1, 2).reshape(-1, K)[:N]


# An AVX2 build's bf16 panels: each k's 16 weights in this row order, so that the 32-bit word j holds
# rows j and j + 8 (blockdot.c's dense_k widens them with a shift and a mask).
_PAIR_ORDER = torch.tensor([j // 2 + 8 * (j % 2) for j in range(PANEL)])


def pack_dense(w: torch.Tensor, kernel: Library | None = None) -> DensePanels:
    """A dense float32 or bf16 matrix [N, K] (plain or oneDNN-packed) regrouped into blockdot.c's
    dense panels, run by `kernel` (None: this machine's build). Rows past N pad the last panel with
    zeros. A copy: the matrix given is left as it was.

    Raises:
        ValueError: another dtype or rank, a matrix off the CPU, or no build to run it.
    """
    kernel = kernel or library()
    if kernel is None:
        raise ValueError(f"the blockdot kernel could not be built: {failure()}")
    if w.dtype not in DTYPES or w.dim() != 2 or w.device.type != "cpu":
        raise ValueError(f"dense panels take a float32 or bf16 matrix [N, K] on the CPU; got {w.dtype} "
                         f"{list(w.shape)} on {w.device}")
    plain = w.to_dense() if w.is_mkldnn else w
    N, K = plain.shape
    padded = F.pad(plain, (0, 0, 0, -N % PANEL)) if N % PANEL else plain
    data = padded.view(-1, PANEL, K).transpose(1, 2)  # [panels, K, 16]
    if w.dtype == torch.bfloat16 and kernel.lib.blockdot_dense_pairs():
        data = data[..., _PAIR_ORDER]
    return DensePanels(data.contiguous(), (N, K), kernel)


def _float_bytes(t: torch.Tensor) -> torch.Tensor:
    """float32 values [..., n] -> their bytes [..., 4 n] uint8."""
    return t.float().contiguous().view(torch.uint8)


def _half_bytes(t: torch.Tensor) -> torch.Tensor:
    """float32 values exact in fp16 [..., n] -> their fp16 bytes [..., 2 n] uint8."""
    return t.half().contiguous().view(torch.uint8)


# Where the code of k = 8 o + i sits in its octet's uint32: bits 4 i .. 4 i + 3.
SHIFTS = 4 * torch.arange(8, dtype=torch.int32)


OCTET_ROWS = 1024  # rows regrouped at a time: their int32 temporaries, 1024 x 576 codes, take 2.4 MB each


def _octets(codes: torch.Tensor) -> torch.Tensor:
    """codes [Np, K] in 0..15 (Np a multiple of 16) -> [panels, K / 32, 256] uint8: per block, 4
    octets of 16 uint32, lane n holding row 16 p + n's 8 codes."""
    Np, K = codes.shape
    B = K // BLOCK
    out = torch.empty(Np // PANEL, B, 256, dtype=torch.uint8)
    for start in range(0, Np, OCTET_ROWS):
        part = codes[start:start + OCTET_ROWS]
        panels = part.shape[0] // PANEL
        # disjoint 4-bit fields, so their sum is their OR; int32 wraps code 7's top bit into the sign, the same 32 bits
        words = (part.to(torch.int32).view(panels, PANEL, B, 4, 8) << SHIFTS).sum(-1, dtype=torch.int32)  # [panels, 16, B, 4]
        out[start // PANEL:start // PANEL + panels] = words.permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(
            panels, B, 256)
    return out


def _pairs(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [Np, K] (Np a multiple of 16) -> [panels, K / 32, 512] uint8: per block, for each octet
    o and j = 0..3, row n's codes at k = 8 o + j and k + 4 in bytes 2 n and 2 n + 1."""
    Np, K = codes.shape
    B = K // BLOCK
    # k = 32 b + 8 o + 4 e + j -> [panels, b, o, j, n, e]
    return codes.view(torch.uint8).view(Np // PANEL, PANEL, B, 4, 2, 4).permute(0, 2, 3, 5, 1, 4).reshape(
        Np // PANEL, B, 2 * 256)


def pack(w: BlockQuantized, kernel: Library | None = None, int16_rows: int | None = None) -> Panels:
    """The blockdot form of a stored matrix (see `supports`): codes regrouped, scales as stored, run
    by `kernel` (None: this machine's build, `library()`), on the int16 path from int16_rows rows of x
    (None: never). Scales and mins that fp16 holds exactly go in fp16 heads, others (a K-quant's)
    in float32 heads (the module docstring gives the bytes).

    Raises:
        ValueError: a matrix `supports` refuses, or no build to run it (failure() says why).
    """
    kernel = kernel or library()
    if kernel is None:
        raise ValueError(f"the blockdot kernel could not be built: {failure()}")
    if not supports(w, torch.float32):
        raise ValueError(f"blockdot runs {KINDS} matrices on the CPU; got {getattr(w, 'kind', type(w).__name__)}")
    N, K = w.shape
    if K % BLOCK:
        raise ValueError(f"blockdot packs matrices whose K is a multiple of {BLOCK}; got K = {K}")
    sixteens = w.group == 16
    # the two halves' scales of each block of 32 in the heads' d and m (then their mins, G16M), or d
    # and m as they are
    heads = ([w.scales[:, 0::2], w.scales[:, 1::2]] + ([] if w.mins is None else [w.mins[:, 0::2], w.mins[:, 1::2]])
             if sixteens else [w.scales, _mins(w)])
    pad = -N % PANEL  # rows past N: codes, d and m all zero, so their outputs are 0 and cut
    *heads, codes = (F.pad(t, (0, 0, 0, pad)) if pad else t for t in (*heads, w.codes))
    panels, B = (N + pad) // PANEL, K // BLOCK
    f32_heads = sixteens or not _fp16_exact(w)
    as_bytes = _float_bytes if f32_heads else _half_bytes
    head = [as_bytes(t.view(panels, PANEL, B).transpose(1, 2)) for t in heads]  # [panels, B, 32 or 64] each
    body, planes = (_octets(codes), 1) if w.kind in FOUR_BIT else (_pairs(codes), 2)
    planes |= (F32_HEADS if f32_heads else 0) | (G16 if sixteens else 0) | (G16M if len(heads) == 4 else 0)
    return Panels(torch.cat([*head, body], dim=-1).contiguous(), planes, (N, K), kernel, int16_rows or 0)


def _factor(values: torch.Tensor, low: int, high: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """values [R, G] float32 -> d [R] float32 and integers q [R, G] in low..high with d q == values
    exactly, or None where some row has no such d. A K-quant's group scales are its fp16 d times small
    integers, so d = (the largest |value|) / c for one c up to max(-low, high) is always found: the
    file's own d, or another that gives the same products."""
    R = values.shape[0]
    amax = values.abs().amax(dim=1)
    d = torch.zeros(R, dtype=torch.float32)
    q = torch.zeros(values.shape, dtype=torch.int32)
    left = torch.nonzero(amax > 0).flatten()  # an all-zero row: d = 0, q = 0
    for c in range(max(-low, high), 0, -1):
        for sign in (1, -1):
            if left.numel() == 0:
                return d, q
            cand = sign * amax[left] / c
            codes = torch.round(values[left] / cand.unsqueeze(1))
            exact = ((codes >= low) & (codes <= high) & (cand.unsqueeze(1) * codes == values[left])).all(dim=1)
            done = left[exact]
            d[done], q[done] = cand[exact], codes[exact].to(torch.int32)
            left = left[~exact]
    return (d, q) if left.numel() == 0 else None


def can_pack_int8(w: object) -> bool:
    """Whether a stored matrix has a file-bit form (pack_int8): a kind blockdot.c multiplies on int8
    activations (INT8_KINDS), K a whole number of its units (`unit`), on the CPU; or rows of those kinds
    stacked (cat_rows) in known runs of whole panels (the last may end short). A matrix still in its
    file (FileBlocks) is asked as the BlockQuantized it decodes to."""
    if not (isinstance(w, FileBlocks) or isinstance(w, BlockQuantized) and w.codes.device.type == "cpu"):
        return False
    if w.kind in INT8_KINDS:
        return w.shape[1] % unit(w.kind) == 0
    runs = w.row_kinds or ()
    return 0 < len(runs) <= SEGMENTS and all(kind in INT8_KINDS and w.shape[1] % unit(kind) == 0 for kind, _ in runs) \
        and all(rows % PANEL == 0 for _, rows in runs[:-1])


def takes_int8(w: object) -> bool:
    """Whether the plan puts a stored matrix on file-bit panels: it has that form (can_pack_int8) and
    every kind in it is one of INT8_CHOSEN."""
    return can_pack_int8(w) and all(kind in INT8_CHOSEN for kind in parts(w.kind))


def _runs(w: BlockQuantized) -> list[BlockQuantized]:
    """A stacked matrix's runs of rows back in their own kinds: Q4_K's and Q4_1's codes 0..15, Q4_0's
    q (cat_rows' q - 8 plus 8), the others' int8 codes as they are, and their one scale (and min, for
    the kinds with mins) a group of 32 (cat_rows gave them to both halves of it beside Q6_K), Q6_K's
    as they are."""
    out, start = [], 0
    for kind, rows in w.row_kinds:
        codes, scales = w.codes[start:start + rows], w.scales[start:start + rows]
        mins = None if w.mins is None else w.mins[start:start + rows]
        halves = w.group == 16 and kind != "Q6_K"  # a 32-weight group's scale given to both its halves
        scales = (scales[:, 0::2] if halves else scales).contiguous()
        mins = (mins[:, 0::2] if halves else mins).contiguous() if kind in ("Q4_K", "Q4_1", "Q5_1") else None
        if kind in ("Q4_K", "Q4_1"):
            codes = codes.to(torch.uint8)
        elif kind == "Q4_0":
            codes = (codes.to(torch.int16) + 8).to(torch.uint8)
        out.append(BlockQuantized(kind, codes.contiguous(), scales, mins))
        start += rows
    return out


def _panel_bytes(t: torch.Tensor, panels: int) -> torch.Tensor:
    """Per-row values [Np, S, n] (Np = 16 panels) -> [panels, S, n * 16 * itemsize] uint8, row-minor."""
    S = t.shape[1]
    return t.view(panels, PANEL, S, -1).permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(panels, S, -1)


def _nibble_octets(low: torch.Tensor, panels: int, weights: int = SUPER) -> torch.Tensor:
    """4-bit values [Np, K] -> [panels, K / weights, weights * 8] uint8: octet t of a super-block of
    `weights` holds, in lane n, row n's values at k = 8 t + i in the low half of byte i and k + 4 in its
    high half (i = 0..3)."""
    S = low.shape[1] // weights
    v = low.view(panels, PANEL, S, weights // 8, 2, 4)
    packed = v[..., 0, :] | (v[..., 1, :] << 4)  # [panels, n, S, t, i]
    return packed.permute(0, 2, 3, 1, 4).reshape(panels, S, weights // 8 * 64)


def _iq4_indices(values: torch.Tensor, kind: str = "IQ4_XS") -> torch.Tensor:
    """IQ4_XS's or IQ4_NL's values (ggml_blocks.KVALUES) back to their 4-bit indices, uint8.

    Raises:
        ValueError: a value that is not one of the table's.
    """
    table = torch.tensor(KVALUES.tolist())  # ascending
    index = torch.searchsorted(table, values.to(torch.int64)).clamp_(max=15)
    if not torch.equal(table[index], values.to(torch.int64)):
        raise ValueError(f"{kind} codes are the 16 values {KVALUES.tolist()}; some are not")
    return index.to(torch.uint8)


def amx(kernel: Library | None = None) -> bool:
    """Whether file-bit panels can multiply on AMX tiles here: a build with them (-march=native on a
    CPU with AMX-INT8) and Linux granting the tiles' state to this process (asked once)."""
    kernel = kernel or library()
    return kernel is not None and bool(kernel.lib.blockdot_amx())


def pack_int8(w: BlockQuantized, kernel: Library | None = None, amx_rows: int | None = None) -> Panels:
    """The file-bit form of a matrix of one of INT8_KINDS (blockdot.c's I8P panels, the layout in its
    comments): its codes at the file's bits (IQ4_XS's and IQ4_NL's as 4-bit indices into their table);
    a K-quant's super-block d (and dmin) as float32 beside the groups' 6-bit (Q6_K, IQ4_XS: int8) scales
    and mins, so that d sc is the stored scale bit for bit (`_factor`); a 32-weight kind's d (and m) in
    fp16, as stored (_pack_blocks). Run on x rounded to int8 per block of 32, summed in integers; a
    K-quant on AMX tiles from amx_rows rows of x (None: never), which give the same bits (the 32-weight
    kinds stay on the vector tiles).

    Raises:
        ValueError: a matrix can_pack_int8 refuses, scales that are not a factor times small integers
            (never so in a file llama.cpp wrote), or no build to run it.
    """
    kernel = kernel or library()
    if kernel is None:
        raise ValueError(f"the blockdot kernel could not be built: {failure()}")
    if not can_pack_int8(w):
        raise ValueError(f"file-bit panels hold {tuple(INT8_KINDS)} matrices (or known runs of their rows) on the "
                         f"CPU with K a multiple of {SUPER}; got {getattr(w, 'kind', type(w).__name__)} "
                         f"{list(getattr(w, 'shape', ()))}")
    if w.kind not in INT8_KINDS:  # runs of rows: a head naming each run's panels and type, then theirs
        runs = [pack_int8(run, kernel) for run in _runs(w)]
        head = torch.zeros(16, dtype=torch.int32)
        head[0] = len(runs)
        for i, run in enumerate(runs):
            head[1 + 2 * i], head[2 + 2 * i] = run.data.shape[0], run.planes >> 8
        data = torch.cat([head.view(torch.uint8), *(run.data.flatten() for run in runs)])
        return Panels(data, I8P | MIXED << 8, w.shape, kernel, amx_rows=amx_rows or 0)
    if w.kind in BLOCK_KINDS:
        return Panels(_pack_blocks(w), I8P | INT8_KINDS[w.kind] << 8, w.shape, kernel, amx_rows=amx_rows or 0)
    N, K = w.shape
    S, pad = K // SUPER, -N % PANEL
    panels = (N + pad) // PANEL
    groups = SUPER // w.group  # 8 (Q4_K, IQ4_XS) or 16 (Q6_K)
    factored = [_factor(t.reshape(N * S, groups), 0 if w.kind == "Q4_K" else -128, 63 if w.kind == "Q4_K" else 127)
                for t in ([w.scales, -w.mins] if w.kind == "Q4_K" else [w.scales])]
    if any(f is None for f in factored):
        raise ValueError(f"a {w.kind} matrix [{N}, {K}] whose group scales are not a factor times "
                         f"{'6-bit' if w.kind == 'Q4_K' else 'int8'} integers in some super-block: not a {w.kind} file's")

    def rows(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (0, 0, 0, 0, 0, pad)) if pad else t

    heads = [_panel_bytes(rows(d.view(N, S, 1)), panels) for d, _ in factored]
    codes = rows((_iq4_indices(w.codes) if w.kind == "IQ4_XS" else w.codes).view(N, S, SUPER))  # padding: index 0
    if w.kind == "Q4_K":
        (_, sc), (_, mn) = factored
        scale_bytes = [_panel_bytes(rows(t.to(torch.uint8).view(N, S, groups)), panels) for t in (sc, mn)]
        body = [_nibble_octets(codes.reshape(-1, K), panels)]
    elif w.kind == "IQ4_XS":
        (_, sc), = factored
        scale_bytes = [_panel_bytes(rows(sc.to(torch.int8).view(N, S, groups)), panels)]
        body = [_nibble_octets(codes.reshape(-1, K), panels)]
    else:
        (_, sc), = factored
        scale_bytes = [_panel_bytes(rows(sc.to(torch.int8).view(N, S, groups)), panels)]
        q = (codes.to(torch.int16) + 32).to(torch.uint8).reshape(-1, K)  # 0..63
        high = (q >> 4).view(panels, PANEL, S, 16, 4, 4)  # [panels, n, S, group, quad, i]
        high = (high[..., 0, :] | high[..., 1, :] << 2 | high[..., 2, :] << 4 | high[..., 3, :] << 6)
        body = [_nibble_octets(q & 15, panels), high.permute(0, 2, 3, 1, 4).reshape(panels, S, 16 * 64)]
    data = torch.cat([*heads, *scale_bytes, *body], dim=-1).contiguous()
    return Panels(data, I8P | INT8_KINDS[w.kind] << 8, (N, K), kernel, amx_rows=amx_rows or 0)


def _pack_blocks(w: BlockQuantized) -> torch.Tensor:
    """A 32-weight kind's file-bit panels [panels, K / 32, bytes] (blockdot.c's layout comment above
    tile8_block): per block of 16 rows, fp16 d[16] (and m[16]), Q5_0's and Q5_1's fifth bits (a uint32 a
    row: bit 8 i + j is k = 4 j + i), then the codes: 4-bit ones as Q4_K's octets, Q8_0's int8 in 8
    vectors (vector j, lane n: row n's at k = 4 j .. 4 j + 3).

    Raises:
        ValueError: scales or mins that fp16 does not hold (a file's always are), or IQ4_NL codes off its table.
    """
    N, K = w.shape
    B, pad = K // BLOCK, -N % PANEL
    panels = (N + pad) // PANEL
    heads = [w.scales] if w.mins is None else [w.scales, w.mins]
    if not all(torch.equal(t.half().float(), t) for t in heads):
        raise ValueError(f"a {w.kind} matrix [{N}, {K}] whose scales or mins fp16 does not hold: not a {w.kind} file's")

    def rows(t: torch.Tensor) -> torch.Tensor:  # rows past N: codes, d and m zero, so their outputs are 0 and cut
        return F.pad(t, (0, 0, 0, pad)) if pad else t

    head = [_panel_bytes(rows(t.half()).view(N + pad, B, 1), panels) for t in heads]  # [panels, B, 32] each
    codes = w.codes
    if w.kind == "Q8_0":  # [panels, n, b, j, i] -> [panels, b, j, n, i]
        q8 = rows(codes.to(torch.int8)).view(torch.uint8).view(panels, PANEL, B, 8, 4)
        return torch.cat([*head, q8.permute(0, 2, 3, 1, 4).reshape(panels, B, 512)], dim=-1).contiguous()
    if w.kind == "IQ4_NL":
        q = _iq4_indices(codes, "IQ4_NL")
    elif w.kind == "Q5_0":
        q = (codes.to(torch.int16) + 16).to(torch.uint8)  # 0..31
    else:
        q = codes.to(torch.uint8)
    q = rows(q)
    fifth = []
    if w.kind in ("Q5_0", "Q5_1"):
        bits = (q >> 4).to(torch.int32).view(N + pad, B, 8, 4)  # [Np, b, j, i]: k = 4 j + i
        shifts = 8 * torch.arange(4, dtype=torch.int32) + torch.arange(8, dtype=torch.int32).view(8, 1)  # [j, i]
        words = (bits << shifts).sum(dim=(-2, -1), dtype=torch.int32)  # disjoint bits: their sum is their OR
        fifth = [_panel_bytes(words.view(N + pad, B, 1), panels)]  # [panels, B, 64]
    body = _nibble_octets(q & 15, panels, BLOCK)  # [panels, B, 256]
    return torch.cat([*head, *fifth, body], dim=-1).contiguous()
