"""Choosing the precision by measurement: dtype="auto" and quantization="auto" resolved at start-up.

On a CPU the right precision depends on the instructions it has: with AVX-512 bf16 (and AMX) a
bf16 matmul runs several times faster than float32; on an AVX2-only CPU it runs tens of times
slower (measured about 70x on an AMD EPYC Zen 3). So nothing here reads a CPU's name: a probe of a
few milliseconds times both, and the int4 kernel beside the dense matmul at one row in the chosen
dtype, and the choice follows the figures, which the engine logs once and reports. The same probe
times nanoserve's own blockdot kernel (nanoserve.model.blockdot) beside torch's int4 kernel at one
row, and kernels="auto" takes the faster.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoserve.model import blockdot
from nanoserve.model.quant import KERNELS, int4_pass, quantize_int4

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# kernels="auto" keeps blockdot unless torch's int4 kernel times this much faster at one row: blockdot
# also runs a decode step's layers in one C call (fused_decode), which torch's kernels cannot, and
# that was worth 1.33x at one slot on a Zen 5 (181.6 against 136.9 tok/s, peerbench --kernels torch
# blockdot) and 1.42x on a Xeon (notes/fused_decode.md), where the one-row timings alone were within
# noise of each other on the Zen 5 (blockdot 0.84-1.49x torch's, run to run).
BLOCKDOT_MARGIN = 1.3
# max_kernel_rows="auto": the kernels up to this many rows, or up to the probe's row count (16) unless
# it times the dense matmul KERNEL_ROWS_MARGIN times faster than blockdot's int16 path there. 8 is the
# Xeon's crossover (AMX's bf16 dense linears). The margin: the probe's matrix sits in cache, where
# dense reads its 7x more bytes for free. On an AVX2 Zen 3 the probe put blockdot at 0.92-1.04x
# dense's speed at 16 rows, run to run, where over the model's 30 streamed layers it took 0.72x
# dense float32's time (benchmarks/matmulbench.py --quant --activations float32) and the engine
# decoded 16 slots 1.4x faster in one call (202.4 against 145.0 tok/s, three alternating rounds).
DEFAULT_KERNEL_ROWS = 8
KERNEL_ROWS_MARGIN = 1.25


@dataclass(frozen=True)
class Probe:
    """Milliseconds per call, the best of seven interleaved timings, on one CPU thread."""

    float32_ms: float  # [rows, K] @ [K, N]^T in float32
    bfloat16_ms: float  # the same in bfloat16
    int4_ms: float  # the int4 kernel at one row, activations in kernel_dtype
    dense_ms: float  # the dense matmul at one row, in kernel_dtype
    kernel_dtype: str  # the faster of the two, unless the caller named one
    shape: tuple[int, int, int]  # (rows, K, N) of the matmul pair
    blockdot_ms: float | None = None  # blockdot on the same int4 matrix at one row; None: unavailable
    blockdot_note: str = ""  # why blockdot_ms is None
    # blockdot (int16 path) and the dense matmul at `rows` rows, in kernel_dtype; None: blockdot unavailable
    blockdot_wide_ms: float | None = None
    dense_wide_ms: float | None = None

    @property
    def quantized_ms(self) -> float:
        """The faster one-row int4 kernel."""
        return min(self.int4_ms, self.blockdot_ms or float("inf"))

    def describe(self) -> str:
        rows, K, N = self.shape
        blockdot_text = f"{self.blockdot_ms:.3f} ms" if self.blockdot_ms is not None else self.blockdot_note
        wide = (f"; {rows} rows: blockdot {self.blockdot_wide_ms:.3f} ms, dense {self.dense_wide_ms:.3f} ms"
                if self.blockdot_wide_ms is not None else "")
        return (f"[{rows}x{K}]@[{K}x{N}]: float32 {self.float32_ms:.3f} ms, bfloat16 {self.bfloat16_ms:.3f} ms; "
                f"one row in {self.kernel_dtype}: int4 kernel {self.int4_ms:.3f} ms, blockdot {blockdot_text}, "
                f"dense {self.dense_ms:.3f} ms{wide}")


@dataclass(frozen=True)
class Precision:
    """What the engine computes in, and why."""

    dtype: str  # "float32", "bfloat16" or "float16"
    quantization: str | None  # None, "int8", "int4" or "keep" (the checkpoint's own)
    reason: str
    probe: Probe | None = None
    kernels: str = "torch"  # who runs quantized linears at few rows: "torch" or "blockdot"
    max_kernel_rows: int | None = DEFAULT_KERNEL_ROWS  # quantized kernels up to this many rows, dense copies above
    # A dense bf16 model's decode steps in one C call up to this many rows (fused_decode.c widens bf16
    # to float32), oneDNN's bf16 linears above; every width where the probe times bf16 below float32.
    bf16_one_call_rows: int = 2

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _best_ms(a: Callable[[], object], b: Callable[[], object], rounds: int = 7) -> tuple[float, float]:
    """The best of `rounds` timings of each, the two interleaved so that a burst of other load on
    the machine falls on both alike rather than on one."""
    a(), b()  # first calls: allocation, oneDNN primitive creation
    best_a = best_b = float("inf")
    for _ in range(rounds):
        for fn, is_a in ((a, True), (b, False)):
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if is_a:
                best_a = min(best_a, elapsed)
            else:
                best_b = min(best_b, elapsed)
    return best_a * 1e3, best_b * 1e3


@functools.cache  # once per process and argument set: the choice is logged once
def probe_cpu(kernel_dtype: str | None = None, rows: int = 16, K: int = 512, N: int = 1024) -> Probe:
    """Times float32 against bfloat16 on one matmul, then the int4 kernel against the dense matmul
    at one row in kernel_dtype (None: the faster of the two): 8 MFLOP per call, a few milliseconds
    in all on a CPU with bf16 (tens of milliseconds on one without, where bf16 is emulated)."""
    # One thread: the ratio is a property of the core's instructions, and one thread's timing is far
    # less disturbed than a team's when other processes share the cores (a team waits for its slowest).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _probe(kernel_dtype, rows, K, N)
    finally:
        torch.set_num_threads(threads)


def _probe(kernel_dtype: str | None, rows: int, K: int, N: int) -> Probe:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=gen) * 0.02
    x = torch.randn(rows, K, generator=gen)
    with torch.inference_mode():
        wb, xb = w.bfloat16(), x.bfloat16()
        fp32, bf16 = _best_ms(lambda: torch.nn.functional.linear(x, w), lambda: torch.nn.functional.linear(xb, wb))
        dtype = DTYPES[kernel_dtype] if kernel_dtype else (torch.bfloat16 if bf16 < fp32 else torch.float32)
        stored = quantize_int4(w)
        kernel = int4_pass(stored.codes, stored.scales, stored.mins + 8 * stored.scales, dtype)
        one, dense = x[:1].to(dtype), w.to(dtype)
        int4, dense_ms = _best_ms(lambda: kernel(one), lambda: torch.nn.functional.linear(one, dense))
        blockdot_ms, note = None, ""
        if not blockdot.supports(stored, dtype):
            note = f"not for {dtype} activations"
        elif blockdot.library() is None:
            note = f"not built ({blockdot.failure()})"
        else:
            packed = blockdot.pack(stored)
            blockdot_ms, _ = _best_ms(lambda: packed(one), lambda: kernel(one))
            wide, wide_dense = blockdot.pack(stored, int16_rows=1), w.to(dtype)
            xs = x.to(dtype)
            blockdot_wide_ms, dense_wide_ms = _best_ms(lambda: wide(xs), lambda: torch.nn.functional.linear(xs, wide_dense))
            return Probe(fp32, bf16, int4, dense_ms, str(dtype).removeprefix("torch."), (rows, K, N), blockdot_ms, note,
                         blockdot_wide_ms, dense_wide_ms)
    return Probe(fp32, bf16, int4, dense_ms, str(dtype).removeprefix("torch."), (rows, K, N), blockdot_ms, note)


def resolve(dtype: str, quantization: str | None, device: torch.device, checkpoint_quantized: bool,
            probe: Callable[..., Probe] | None = None, kernels: str = "auto",
            max_kernel_rows: int | str | None = "auto") -> Precision:
    """Turns the config's "auto" values into a Precision.

    dtype "auto": bfloat16 on a CUDA device that supports it; on a CPU, bfloat16 when the probe
    times it faster than float32; float32 otherwise. quantization "auto": a checkpoint's own
    quantized matrices are kept in kernel form when the probe times the int4 kernel faster than
    the dense matmul at one row (where it is not, as with float32 activations on a CPU, they are
    dequantized into dense); a dense checkpoint stays dense. kernels "auto": blockdot unless the
    probe times torch's int4 kernel BLOCKDOT_MARGIN times faster at one row, torch's kernels then;
    "blockdot" asks for it (a ValueError where it cannot be built), "torch" for torch's.
    max_kernel_rows "auto": the probe's row count unless it times the dense matmul KERNEL_ROWS_MARGIN
    times faster than blockdot's int16 path there, DEFAULT_KERNEL_ROWS then. A bf16 engine on a CPU
    whose probe times bf16 slower than float32 runs its dense decode steps in one call at every width.
    """
    probe = probe or probe_cpu  # looked up at call time, so a test can stand in for it
    figures: Probe | None = None
    reasons = []
    if dtype == "auto":
        if device.type == "cuda":
            dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
            reasons.append(f"dtype {dtype}: CUDA device {torch.cuda.get_device_name(device)}")
        elif device.type == "cpu":
            figures = probe()
            dtype = "bfloat16" if figures.bfloat16_ms < figures.float32_ms else "float32"
            reasons.append(f"dtype {dtype}: bfloat16 {figures.float32_ms / figures.bfloat16_ms:.2f}x float32's speed")
        else:
            dtype = "float32"
            reasons.append(f"dtype float32: no probe for device type {device.type!r}")
    else:
        reasons.append(f"dtype {dtype}: as configured")
    if quantization == "auto":
        if not checkpoint_quantized:
            quantization = None
            reasons.append("dense: the checkpoint is not quantized")
        elif device.type != "cpu":
            quantization = None
            reasons.append(f"the checkpoint's quantization dequantized: no quantized kernels on {device.type}")
        else:
            if figures is None or figures.kernel_dtype != dtype:
                figures = probe(kernel_dtype=dtype)
            faster = figures.quantized_ms < figures.dense_ms
            quantization = "keep" if faster else None
            reasons.append(f"the checkpoint's quantization {'kept' if faster else 'dequantized'}: the faster int4 "
                           f"kernel {figures.dense_ms / figures.quantized_ms:.2f}x the dense matmul's speed at one row")
    elif quantization is not None and device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on torch's CPU kernels; device={device.type!r} has "
                         "none here: use quantization=None")
    else:
        reasons.append(f"quantization {quantization}: as configured")
    chosen = "torch"
    if kernels == "blockdot":
        if blockdot.library() is None:
            raise ValueError(f"kernels='blockdot' but the blockdot kernel could not be built: {blockdot.failure()}")
        chosen = "blockdot"
        reasons.append("kernels blockdot: as configured")
    elif kernels == "auto" and quantization == "int8":
        reasons.append("kernels torch: blockdot does not run int8 per channel")
    elif kernels == "auto" and quantization is not None and device.type == "cpu":
        if figures is None or figures.kernel_dtype != dtype:
            figures = probe(kernel_dtype=dtype)
        if figures.blockdot_ms is not None and figures.blockdot_ms < figures.int4_ms * BLOCKDOT_MARGIN:
            chosen = "blockdot"
            reasons.append(f"kernels blockdot: {figures.int4_ms / figures.blockdot_ms:.2f}x torch's int4 kernel's "
                           f"speed at one row (kept unless torch's is {BLOCKDOT_MARGIN}x faster: it also runs the one-call "
                           "decode)")
        elif figures.blockdot_ms is not None:
            reasons.append(f"kernels torch: blockdot {figures.int4_ms / figures.blockdot_ms:.2f}x torch's int4 "
                           f"kernel's speed at one row (torch's {BLOCKDOT_MARGIN}x faster or more)")
        else:
            reasons.append(f"kernels torch: blockdot not timed ({figures.blockdot_note or 'no figure'})")
    elif kernels not in ("auto", *KERNELS):
        raise ValueError(f"kernels={kernels!r} is not one of {['auto', *KERNELS]}")
    if max_kernel_rows == "auto":
        max_kernel_rows = DEFAULT_KERNEL_ROWS
        if chosen == "blockdot" and quantization is not None and device.type == "cpu":
            if figures is None or figures.kernel_dtype != dtype:
                figures = probe(kernel_dtype=dtype)
            if figures.blockdot_wide_ms is not None and figures.blockdot_wide_ms < figures.dense_wide_ms * KERNEL_ROWS_MARGIN:
                max_kernel_rows = figures.shape[0]
            if figures.blockdot_wide_ms is not None:
                reasons.append(f"kernels up to {max_kernel_rows} rows: blockdot {figures.dense_wide_ms / figures.blockdot_wide_ms:.2f}x "
                               f"the dense matmul's speed at {figures.shape[0]} rows")
    bf16_one_call_rows = 2
    if dtype == "bfloat16" and device.type == "cpu":
        if figures is None:
            figures = probe()
        if figures.bfloat16_ms > figures.float32_ms:
            bf16_one_call_rows = 2**31
            reasons.append(f"bf16 decode steps in one call at every width: bfloat16 {figures.float32_ms / figures.bfloat16_ms:.2f}x "
                           "float32's speed")
    return Precision(dtype, quantization, "; ".join(reasons), figures, chosen, max_kernel_rows, bf16_one_call_rows)
