"""Weight-only quantized linears on torch's own CPU kernels, and the dense copy they fall back to.

Two forms of a quantized matrix [N, K] (N output rows, K input columns, G = 32 per group):

- as stored: `BlockQuantized` (nanoserve.model.gguf; every GGUF block type, or nanoserve's own
  int4 in groups of 32, which is Q4_1's form: w = d q + m, q in 0..15) and `ChannelInt8` (int8 per
  output channel, w = s[n] q). Both dequantize exactly to float32, the reference every test uses;
- as run: `QuantLinear`, one or two kernel passes summed, in the activations' dtype: torch's
  kernels (below), or nanoserve's own blockdot (nanoserve.model.blockdot: one pass over the codes as
  stored for each of Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K, IQ4_XS, Q6_K, Q3_K and Q2_K,
  nanoserve's own int4, and rows of several of them in one matrix, the scales exact in fp16 or
  float32 heads, x in float32 or rounded to int16 per block), as the execution plan chooses:
  blockdot unless the start-up probe times torch's kernel precision.BLOCKDOT_MARGIN times faster.

The kernels: `_weight_int4pack_mm_for_cpu` reads 4-bit codes in groups of 32 with a scale and a
zero per group, w = (q - 8) s + z; `_weight_int8pack_mm` reads int8 with one scale per output
channel. Both take scales in the activations' dtype, so bf16 activations round a GGUF fp16 scale
to bf16 (8 bits of mantissa): that rounding, not the mapping, is the only change from the file.

- Q4_0 (w = d (q - 8)): one int4 pass, s = d, z = 0;
- Q4_1 (w = d q + m): one int4 pass, s = d, z = m + 8 d;
- Q8_0 (w = d q, q int8 in groups of 32): two int4 passes, exact: q = 16 hi + lo with lo in 0..15
  and hi in -8..7, so w = (hi + 8 - 8) 16 d + (lo - 8) d + 8 d; the high pass's scale 16 d is d in
  bf16 times a power of two, so both passes round d alike; every other kind with int8 codes and
  groups of 32 (Q5_0, Q5_1, Q5_K, IQ4_NL, IQ4_XS) the same way, its min added to the low pass's zero;
  Q4_K as Q4_1. Q2_K, Q3_K and Q6_K scale groups of 16, which these kernels do not take;
- int8 per channel: one int8 pass.

The kernels are shaped for few rows: past `max_kernel_rows` rows a linear multiplies by the dense
matrix (in the activations' dtype) instead, so prefill and large batches never pay the slow path.
On blockdot that matrix is the panels dequantized for the call (blockdot.c, bit for bit the stored
matrix's dequantize(): a pass over the weights far cheaper than the wide step's matmuls, measured in
notes/memory.md); on torch's kernels, or where asked (dense_copy), a dense copy held for the model's
life, which costs memory (4 bytes a weight in float32, 2 in bf16): `weight_bytes` counts it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve.model import blockdot
from nanoserve.model.forms import (
    STORED,
    CForm,
    Dense,
    Form,
    FormKind,
    Regroup,
    Weight,
    can_pack,
    dtype_name,
    pack,
)
from nanoserve.model.ggml_blocks import BLOCK_TYPES, parts
from nanoserve.model.gguf import BLOCK, BlockQuantized, FileBlocks, stack_rows

GROUP = BLOCK  # 32: the group size of every int4 layout here
KERNELS = ("torch", "blockdot", "blockdot-int8")  # who runs a quantized linear's few-row passes


@dataclass
class ChannelInt8:
    """int8 per output channel: w[n, k] = scales[n] * codes[n, k]."""

    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N] float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def form(self) -> Form:
        return Form(STORED, "float32", stored="int8")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype))  # the exact, slow reference

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.scales.unsqueeze(1) * self.codes.float()).to(dtype)  # [N, K], computed in float32

    def nbytes_by_kind(self) -> dict[str, int]:
        return {"stored": self.codes.nbytes + self.scales.nbytes}

    def c_form(self, regroup: Regroup) -> None:
        return None

    def rows(self, index: torch.Tensor) -> ChannelInt8:
        return ChannelInt8(self.codes.index_select(0, index), self.scales.index_select(0, index))


Stored = BlockQuantized | ChannelInt8


def quantize_int8(w: torch.Tensor) -> ChannelInt8:
    """w [N, K] -> int8 per output channel, symmetric: s = max |w[n]| / 127, q = round(w / s)."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [N]
    codes = torch.round(w / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return ChannelInt8(codes, scales)


def _to_fp16(t: torch.Tensor, up: bool) -> torch.Tensor:
    """float32 -> the nearest fp16 value at or above t (up) or at or below it, as float32."""
    h = t.half()
    wrong_side = h.float() < t if up else h.float() > t
    toward = torch.full_like(h, float("inf") if up else float("-inf"))
    return torch.where(wrong_side, torch.nextafter(h, toward), h).float()


def quantize_int4(w: torch.Tensor) -> BlockQuantized:
    """w [N, K] -> 4 bits in groups of 32, asymmetric over each group's range (GGUF's Q4_1 form,
    w = d q + m, q in 0..15), with d and m in fp16 as the file format stores them (blockdot reads
    them exactly): m = min rounded down, d = (max - m) / 15 rounded up, so every weight lies within
    the 16 levels, and q = round((w - m) / d), an error of at most d / 2."""
    N, K = w.shape
    if K % GROUP:
        raise ValueError(f"int4 needs the input width a multiple of {GROUP}; this matrix has K={K}")
    groups = w.float().view(N, K // GROUP, GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, B]
    mins = _to_fp16(low, up=False)
    scales = _to_fp16((high - mins) / 15, up=True)  # > 0: the smallest fp16 step at least
    codes = torch.round((groups - mins.unsqueeze(-1)) / scales.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    return BlockQuantized("Q4_1", codes.view(N, K), scales, mins)




def cat_rows(matrices: list[torch.Tensor | Stored | FileBlocks]) -> torch.Tensor | Stored | FileBlocks:
    """Stacks matrices along N (q, k, v into one qkv): quantized matrices still in their file stay
    there, stacked when decoded; decoded ones are stacked by gguf.stack_rows (of one kind as they
    are; of several, codes widened to int8: the same weights, exactly); anything else mixed becomes
    dense float32."""
    if all(isinstance(m, torch.Tensor) for m in matrices):
        return torch.cat(matrices).contiguous()
    if all(isinstance(m, FileBlocks) for m in matrices):
        return FileBlocks(tuple(piece for m in matrices for piece in m.pieces))
    if all(isinstance(m, BlockQuantized) for m in matrices):
        return stack_rows(matrices)
    if all(isinstance(m, ChannelInt8) for m in matrices):
        return ChannelInt8(torch.cat([m.codes for m in matrices]), torch.cat([m.scales for m in matrices]))
    return torch.cat([m.float() if isinstance(m, torch.Tensor) else m.dequantize() for m in matrices]).contiguous()


@dataclass
class Int4Pass:
    """One _weight_int4pack_mm_for_cpu call: w = (q - 8) s + z per group of 32."""

    form_name = FormKind.TORCH_INT4
    packed: torch.Tensor  # [Np, K / 2] uint8, the kernel's layout; Np: N rounded up to 16 (zero rows)
    scales_and_zeros: torch.Tensor  # [K / 32, Np, 2] in the activations' dtype
    num_rows: int  # N

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)
        return out if out.shape[-1] == self.num_rows else out[:, :self.num_rows]

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


@dataclass
class Int8Pass:
    """One _weight_int8pack_mm call: w = s[n] q."""

    form_name = FormKind.TORCH_INT8

    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N] in the activations' dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


def int4_pass(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> Int4Pass:
    """codes [N, K] in 0..15, scales and zeros [N, K / 32] float32 -> one kernel pass. The kernel
    takes N in multiples of 16: the rows past N are zeros (scale and zero 0), cut from the output."""
    N = codes.shape[0]
    pad = -N % 16
    if pad:
        codes, scales, zeros = (F.pad(t, (0, 0, 0, pad)) for t in (codes, scales, zeros))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)  # [B, Np, 2]
    return Int4Pass(packed, scales_and_zeros, N)


def torch_runs(kind: str) -> bool:
    """Whether torch's kernels run a stored kind: one scale (and zero) per group of 32, as theirs take."""
    return kind == "int8" or all(BLOCK_TYPES[part].group == GROUP for part in parts(kind))


def kernel_passes(w: Stored, dtype: torch.dtype) -> list[Int4Pass | Int8Pass]:
    """The kernel passes whose sum is x @ w^T, for activations in `dtype` (see the module docstring):
    4-bit codes (Q4_0, Q4_1, Q4_K) in one int4 pass, int8 codes (Q8_0, Q5_0, Q5_1, Q5_K, IQ4_NL,
    IQ4_XS) in two, split as Q8_0's are.

    Raises:
        ValueError: a kind whose groups are not 32 weights (Q2_K, Q3_K, Q6_K: torch_runs).
    """
    if isinstance(w, ChannelInt8):
        return [Int8Pass(w.codes.contiguous(), w.scales.to(dtype).contiguous())]
    if not torch_runs(w.kind):
        raise ValueError(f"torch's int4 kernel takes groups of {GROUP} weights; {w.kind} scales groups of {w.group}")
    mins = torch.zeros_like(w.scales) if w.mins is None else w.mins
    if w.kind == "Q4_0":
        return [int4_pass(w.codes, w.scales, mins, dtype)]  # w = d (q - 8): z = 0
    if w.codes.dtype == torch.uint8:  # 4-bit codes in 0..15
        return [int4_pass(w.codes, w.scales, mins + 8 * w.scales, dtype)]  # w = d q + m = d (q - 8) + (m + 8 d)
    codes = w.codes.to(torch.int32)  # int8 codes
    low = codes & 15  # 0..15
    high = (codes - low) // 16 + 8  # (-8..7) + 8
    return [int4_pass(high, 16 * w.scales, torch.zeros_like(w.scales), dtype),
            int4_pass(low, w.scales, 8 * w.scales + mins, dtype)]


@dataclass
class QuantLinear:
    """A linear run by quantized kernels for up to max_kernel_rows rows (None: every row count) and
    by the dense matrix above: its dense copy where it keeps one, else blockdot's panels dequantized
    for the call (the copy's memory saved for a pass over the weights each wide step)."""

    passes: list[Int4Pass | Int8Pass | blockdot.Panels]
    dense: Weight | None  # [N, K] in the activations' dtype (oneDNN-packed where that runs faster), or None
    max_kernel_rows: int | None
    shape: tuple[int, int]  # (N, K)
    dtype: torch.dtype  # the activations'

    def __post_init__(self) -> None:
        if self.max_kernel_rows is not None and self.dense is None and not self.dequantizes:
            raise ValueError("a quantized linear with max_kernel_rows needs a dense copy unless it runs on blockdot's "
                             f"panels alone; got {[type(p).__name__ for p in self.passes]}")

    @property
    def dequantizes(self) -> bool:
        """Whether wide steps dequantize the panels per call (no dense copy)."""
        return self.dense is None and len(self.passes) == 1 and isinstance(self.passes[0], blockdot.Panels)

    @property
    def form(self) -> Form:
        first = self.passes[0]
        wide = None if self.max_kernel_rows is None else ("dense copy" if self.dense is not None else "dequantized")
        int16_rows = getattr(first, "int16_rows", 0) or None
        amx_rows = getattr(first, "amx_rows", 0) or None
        return Form(first.form_name, dtype_name(self.dtype), self.max_kernel_rows, wide, int16_rows, amx_rows=amx_rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.max_kernel_rows is not None and x.shape[0] > self.max_kernel_rows:
            if self.dense is not None:
                return self.dense(x)
            return F.linear(x, self.passes[0].dequantize(x.dtype))
        out = self.passes[0](x)
        for kernel_pass in self.passes[1:]:
            out = out + kernel_pass(x)
        return out

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense matrix [N, K]: the copy's, or the panels' (exact); torch's passes hold none of their own."""
        if self.dense is not None:
            return self.dense.dequantize(dtype)
        if self.dequantizes:
            return self.passes[0].dequantize(dtype)
        eye = torch.eye(self.shape[1], dtype=self.dtype)
        return self(eye).t().to(dtype)  # each column of the identity picks a column of w

    @property
    def looks_up(self) -> bool:
        """Whether an embedding can read its rows from this linear (file-bit panels: `lookup`)."""
        return self.dequantizes and bool(self.passes[0].planes & blockdot.I8P)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ids [T] of the matrix, as an embedding looks them up (looks_up linears only)."""
        return self.passes[0].lookup(ids, dtype)

    def nbytes_by_kind(self) -> dict[str, int]:
        dense = 0 if self.dense is None else sum(self.dense.nbytes_by_kind().values())
        return {"quantized": sum(p.nbytes for p in self.passes), "dense_copies": dense}

    def c_form(self, regroup: Regroup) -> CForm | None:
        """blockdot's panels as they are; torch's kernels' layouts are not fused_decode.c's."""
        if len(self.passes) == 1 and isinstance(self.passes[0], blockdot.Panels):
            panels = self.passes[0]
            return CForm(panels.data, panels.planes, copied=False)
        return None


def dense_weight(matrix: torch.Tensor, packed: bool) -> Weight:
    """A dense matrix as torch runs it: reordered for oneDNN where asked and oneDNN takes it."""
    return pack(matrix) if packed and can_pack(matrix.dtype, matrix.device) else Dense(matrix)


def quant_linear(w: Stored, dtype: torch.dtype, max_kernel_rows: int | None, pack: bool,
                 kernels: str = "torch", int16_rows: int | None = None, dense_copy: bool = True,
                 amx_rows: int | None = None) -> QuantLinear:
    """The kernel form of a stored quantized matrix, its kernels taking up to max_kernel_rows rows
    (None: every row count) and the dense matrix more: a dense copy held for the model's life, or,
    where dense_copy is False and the matrix runs on blockdot, its panels dequantized per call.
    kernels: "blockdot" (on its int16 path from int16_rows rows; None: never), "blockdot-int8" (a
    K-quant on file-bit panels, x in int8: blockdot.pack_int8, on AMX tiles from amx_rows rows) or "torch". Who runs
    which matrix is the execution plan's choice (nanoserve.model.plan): nothing falls back here.

    Raises:
        ValueError: an unknown kernels, or kernels "blockdot" for a matrix blockdot does not run in `dtype`.
    """
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r} is not one of {KERNELS}")
    on_blockdot = kernels.startswith("blockdot")
    if kernels == "blockdot-int8" and not (blockdot.can_pack_int8(w) and dtype in blockdot.DTYPES):
        raise ValueError(f"kernels='blockdot-int8' for a {w.form.stored} matrix with {dtype} activations: file-bit "
                         f"panels hold {tuple(blockdot.INT8_KINDS)} matrices")
    if on_blockdot and not blockdot.supports(w, dtype):
        raise ValueError(f"kernels='blockdot' for a {w.form.stored} matrix with {dtype} activations, which blockdot "
                         "does not run")
    if kernels == "blockdot-int8":
        passes = [blockdot.pack_int8(w, amx_rows=amx_rows)]
    else:
        passes = [blockdot.pack(w, int16_rows=int16_rows)] if on_blockdot else kernel_passes(w, dtype)
    dense = None
    if max_kernel_rows is not None and (dense_copy or not on_blockdot):
        dense = dense_weight(w.dequantize(dtype), pack)
    return QuantLinear(passes, dense, max_kernel_rows, w.shape, dtype)


def embedding(ids: torch.Tensor, table: torch.Tensor | Stored | FileBlocks | QuantLinear,
              dtype: torch.dtype) -> torch.Tensor:
    """ids [T] -> rows [T, E] in `dtype`; a quantized table dequantizes only the rows it looks up."""
    if isinstance(table, torch.Tensor):
        return F.embedding(ids, table).to(dtype)
    if isinstance(table, QuantLinear):  # a tied head on file-bit panels: the table held once
        return table.lookup(ids, dtype)
    return table.rows(ids).dequantize(dtype)
