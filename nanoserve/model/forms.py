"""The weight protocol: what every form of a matmul weight answers, so that the forward, the C
bridge and the plan ask the weight rather than test its class.

A matmul weight is a matrix [N, K] (N output rows, K input columns) in one of several forms: a
dense tensor torch multiplies (`Dense`), the same reordered for oneDNN (`PackedDense`), blockdot's
dense panels (nanoserve.model.blockdot.DensePanels), a quantized matrix as stored in its file
(nanoserve.model.gguf.FileBlocks, still in the file's bytes, and the BlockQuantized it decodes to;
nanoserve.model.quant.ChannelInt8: the slow float32 reference), a quantized matrix in a kernel's
layout (nanoserve.model.quant.QuantLinear), or a tensor-parallel slice that completes its matmul
with an all-reduce (nanoserve.model.shard.AllReduced).
Each answers:

- `weight(x)`: x [M, K] -> [M, N] in x's dtype;
- `form`: a `Form`, what it is and how it runs, which the execution plan names for it;
- `dequantize(dtype)`: the dense matrix [N, K];
- `nbytes_by_kind()`: the bytes it holds, by kind (Engine.memory());
- `c_form(regroup)`: what fused_decode.c reads for it (`CForm`), or None where it reads nothing;
  a dense matrix torch runs is regrouped into dense panels by `regroup` (blockdot.pack_dense), a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F


class FormKind(StrEnum):
    """What a matmul weight is and who runs it (Form.name). A StrEnum: each equals its name as a string."""

    TORCH = "torch"  # a dense matrix, torch's F.linear
    ONEDNN = "onednn"  # a dense matrix in oneDNN's packed layout
    DENSE_PANELS = "dense-panels"  # a dense matrix in blockdot's dense panels
    BLOCKDOT = "blockdot"  # a quantized matrix on blockdot's panels
    BLOCKDOT_INT8 = "blockdot-int8"  # a K-quant on blockdot's file-bit panels, x rounded to int8, integer sums
    TORCH_INT4 = "torch-int4"  # a quantized matrix on torch's int4 kernel
    TORCH_INT8 = "torch-int8"  # int8 per channel on torch's int8 kernel
    STORED = "stored"  # a quantized matrix as loaded: dequantized at every call (the reference, never planned)

    @property
    def in_c(self) -> bool:
        """Whether fused_decode.c reads the weight itself (no copy): blockdot's or dense panels."""
        return self in (FormKind.BLOCKDOT, FormKind.BLOCKDOT_INT8, FormKind.DENSE_PANELS)

    @property
    def on_torch(self) -> bool:
        """Whether torch's own kernels run it (what torch.compile traces, and what no batch-invariant plan runs)."""
        return self in (FormKind.TORCH, FormKind.ONEDNN, FormKind.TORCH_INT4, FormKind.TORCH_INT8)


STORED = FormKind.STORED

# fused_decode.c's codes for a matmul's C form (struct fused_layer's *_planes): blockdot's panels are
# their planes (1: 4-bit codes, 2: int8 codes); dense panels are negative.
DENSE_F32, DENSE_BF16 = -1, -2


@dataclass(frozen=True)
class Form:
    """What a weight is and how it runs: the unit the execution plan lays out and checks."""

    name: FormKind
    dtype: str  # the activations' dtype it computes in: "float32", "bfloat16", "float16"
    kernel_rows: int | None = None  # a quantized form: its kernel up to this many rows (None: every width)
    wide: str | None = None  # past kernel_rows: "dense copy" or "dequantized" (its panels, per call); None where the form runs every width
    int16_rows: int | None = None  # blockdot: x rounded to int16 per block from this many rows (None: never)
    amx_rows: int | None = None  # blockdot-int8: on AMX tiles from this many rows, the same sums (None: never)
    all_reduced: bool = False  # a tensor-parallel slice whose output is all-reduced
    in_rank_order: bool = False  # all_reduced: the ranks' partials gathered and added rank 0 first
    stored: str | None = None  # a quantized matrix as loaded (STORED): its kind, "Q4_1" or "int8"

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", FormKind(self.name))  # a plan sent as JSON names it as a string

    def __str__(self) -> str:
        if self.name == STORED:
            return f"{self.stored} as stored, dequantized at every call"
        text = f"{self.name} {self.dtype}"
        if self.kernel_rows is not None:
            text += f" up to {self.kernel_rows} rows, {self.wide} past"
        if self.int16_rows is not None:
            text += f", x in int16 from {self.int16_rows} row{'s' if self.int16_rows > 1 else ''}"
        if self.amx_rows is not None:
            text += f", AMX tiles from {self.amx_rows} row{'s' if self.amx_rows > 1 else ''}"
        if self.all_reduced:
            text += ", all-reduced" + (" in rank order" if self.in_rank_order else "")
        return text


@dataclass(frozen=True)
class CForm:
    """A matmul as fused_decode.c reads it."""

    data: torch.Tensor  # blockdot's panels [panels, K / 32, bytes] uint8, or dense panels [panels, K, 16]
    code: int  # planes (1 or 2) for blockdot's panels, DENSE_F32 or DENSE_BF16 for dense panels
    copied: bool  # a copy made for the C call (the weight itself runs elsewhere): counted in fused_copies


@runtime_checkable
class Weight(Protocol):
    """A matmul weight [N, K] in any form (the module docstring)."""

    shape: tuple[int, int]

    @property
    def form(self) -> Form: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def nbytes_by_kind(self) -> dict[str, int]: ...

    def c_form(self, regroup: Regroup) -> CForm | None: ...


# Regroups a dense float32 or bf16 matrix [N, K] on the CPU into dense panels (blockdot.pack_dense).
Regroup = Callable[[torch.Tensor], Any]
C_DTYPES = (torch.float32, torch.bfloat16)  # the dense matrices fused_decode.c reads


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dense_code(dtype: torch.dtype) -> int:
    return DENSE_BF16 if dtype == torch.bfloat16 else DENSE_F32


def _dense_c_form(matrix: torch.Tensor, regroup: Regroup) -> CForm | None:
    """A float32 or bf16 matrix on the CPU regrouped into dense panels (a copy); None for other dtypes."""
    if matrix.dtype not in C_DTYPES or matrix.device.type != "cpu":
        return None
    return CForm(regroup(matrix).data, dense_code(matrix.dtype), copied=True)


@dataclass(frozen=True)
class Dense:
    """A dense matrix [N, K] multiplied by torch's F.linear."""

    weight: torch.Tensor  # [N, K]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def form(self) -> Form:
        return Form(FormKind.TORCH, dtype_name(self.weight.dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)

    def nbytes_by_kind(self) -> dict[str, int]:
        return {"dense": self.weight.nbytes}

    def c_form(self, regroup: Regroup) -> CForm | None:
        return _dense_c_form(self.weight, regroup)


@dataclass(frozen=True)
class PackedDense:
    """A dense matrix [N, K] reordered once into oneDNN's blocked layout (an opaque tensor only
    oneDNN's linear reads): what torch.compile's freezing does for CPU linears. Measured over all 30
    layers of the default model, 2 threads, float32 (notes/peerbench.md): 1.3x faster than F.linear
    at 1 row, 1.5-2.4x at 2-64 rows, and 1.8x on the 113 MB head."""

    weight: torch.Tensor  # oneDNN's packed [N, K]
    shape: tuple[int, int]

    @property
    def form(self) -> Form:
        return Form(FormKind.ONEDNN, dtype_name(self.weight.dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to_dense().to(dtype)

    def nbytes_by_kind(self) -> dict[str, int]:
        N, K = self.shape
        return {"dense": N * K * self.weight.element_size()}  # an opaque tensor has no plain storage

    def c_form(self, regroup: Regroup) -> CForm | None:
        return _dense_c_form(self.weight.to_dense(), regroup)


def can_pack(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """oneDNN's packed linear applies on a CPU whose torch has oneDNN, to float32 weights, and to
    bfloat16 ones where oneDNN computes bf16 natively."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def pack(matrix: torch.Tensor) -> PackedDense:
    """A dense matrix [N, K] reordered for oneDNN (see can_pack)."""
    return PackedDense(torch.ops.mkldnn._reorder_linear_weight(matrix.contiguous()), tuple(matrix.shape))


def as_weight(value: torch.Tensor | Weight) -> Weight:
    """A loaded matrix as a weight: a plain tensor becomes `Dense`; any other form is one already."""
    return Dense(value) if isinstance(value, torch.Tensor) else value
