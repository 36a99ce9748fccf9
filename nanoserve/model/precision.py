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

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoserve.model import blockdot
from nanoserve.model.gguf import decode_blocks
from nanoserve.model.kv_quant import BLOCK_BYTES, QK
from nanoserve.model.quant import dense_weight, int4_pass, quantize_int4

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# A K/V cache's element by its name: a torch dtype, or llama.cpp's block kind (nanoserve.model.kv_quant)
KV_DTYPES: dict[str, torch.dtype | str] = {**DTYPES, **{kind: kind for kind in BLOCK_BYTES}}
# What kernels= and dense_kernel= name. blockdot's file-bit panels (quant's "blockdot-int8") are not
# chosen here: the plan takes them per matrix where PlanOverrides.blockdot_int8 and the matrix allow.
KERNELS = ("torch", "blockdot")
# The measurements behind these constants: notes/execution-plan.md, "Why the constants are what they are".
# kernels="auto" keeps blockdot unless torch's int4 kernel times this much faster at one row: blockdot
# also runs a decode step's layers in one C call, which torch's kernels cannot.
BLOCKDOT_MARGIN = 1.3
# max_kernel_rows="auto": blockdot's int16 path up to the widest of WIDE_ROWS where it times within
# WIDE_MARGIN of what the linear runs past it, each narrower one too; DEFAULT_KERNEL_ROWS where it
# loses at 16. Past it: without dense copies (the default), the panels dequantized for the call and
# the plain matmul, timed in cache, as they run; with dense copies, the copy at 16 rows, streamed.
DEFAULT_KERNEL_ROWS = 8
WIDE_ROWS = (16, 32, 64)
WIDE_MARGIN = 1.3
# dense_kernel="auto" times torch's dense matmul against blockdot's dense panels at this many rows:
# what the choice decides is who runs the steps wider than the one-call decode (prefill chunks, and
# decode steps past the one call's routes), which the one-call decode runs on the panels whatever it is.
DENSE_ROWS = 64
# blockdot_amx_rows="auto": file-bit panels on AMX tiles from the narrowest of AMX_ROWS from which on
# the probe times them AMX_MARGIN faster than the vector tiles (a Q4_K matrix, in cache; the tiles'
# fixed cost per panel and group loses at few rows). The margin leaves room for what a matrix in
# cache hides: an earlier kernel timed 1.2x there at 16 rows and 0.92x in a 16-sequence decode
# (notes/amx-tiles.md, which has the current kernel at both). Never where the CPU has no tiles.
AMX_ROWS = (16, 32, 64)
AMX_MARGIN = 1.25
STREAM_MIN, STREAM_MAX = 64 * 2**20, 256 * 2**20  # bytes: the streamed timings' working set (stream_bytes)


def auto_kernel(int4_ms: float, blockdot_ms: float | None) -> str:
    """kernels="auto"'s choice from the one-row timings in cache."""
    return "blockdot" if blockdot_ms is not None and blockdot_ms < int4_ms * BLOCKDOT_MARGIN else "torch"


@dataclass(frozen=True)
class Probe:
    """Milliseconds per call on one CPU thread, the best of interleaved timings.

    The one-row kernel choice (int4_ms, blockdot_ms) is timed on one matrix, in cache. Whether to
    keep a checkpoint's quantization and how wide the kernels go are timed streamed: each call reads
    another copy of the matrix from a set of stream_mb (twice the last-level cache), as a model's
    layers are read from memory in a decode step. In cache the dense matmul reads its 6x more bytes
    for nothing: on an AVX2 Zen 3 it timed 0.99x blockdot's speed at one row there, and a start that
    took that figure served the default model dequantized, a third as fast at 5x the memory.
    """

    float32_ms: float  # [rows, K] @ [K, N]^T in float32
    bfloat16_ms: float  # the same in bfloat16
    int4_ms: float  # torch's int4 kernel at one row, activations in kernel_dtype, in cache
    kernel_dtype: str  # the faster of the two, unless the caller named one
    shape: tuple[int, int, int]  # (rows, K, N) of the matmul pair
    blockdot_ms: float | None = None  # blockdot on the same int4 matrix at one row, in cache; None: unavailable
    blockdot_note: str = ""  # why blockdot_ms is None
    # one row, streamed: the quantized kernel kernels="auto" runs (blockdot unless torch's is
    # BLOCKDOT_MARGIN times faster in cache), and the dense matmul in kernel_dtype
    quantized_ms: float = float("nan")
    dense_ms: float = float("nan")
    # one row, streamed, each kernel: torch's int4 and blockdot (None: unavailable or not timed)
    int4_stream_ms: float | None = None
    blockdot_stream_ms: float | None = None
    # blockdot (int16 path) and the dense copy at `rows` rows, streamed; None: blockdot unavailable
    blockdot_wide_ms: float | None = None
    dense_wide_ms: float | None = None
    # (rows, blockdot int16 ms, panels dequantized + the plain matmul ms) at each of WIDE_ROWS, in cache
    dequantized_rows: tuple[tuple[int, float, float], ...] = ()
    stream_mb: float = 0.0  # the streamed set's size in dense kernel_dtype
    # a dense matmul at DENSE_ROWS rows in kernel_dtype, in cache: torch's linear (on oneDNN's packed
    # matrix where torch packs one) and blockdot's dense panels; None: blockdot unavailable
    dense_torch_ms: float | None = None
    dense_panels_ms: float | None = None

    @property
    def quantized_kernel(self) -> str:
        """The kernel quantized_ms times."""
        return auto_kernel(self.int4_ms, self.blockdot_ms)

    def stream_ms(self, kernel: str) -> float:
        """One row streamed on `kernel` ("torch" or "blockdot"); NaN where it was not timed."""
        timed = self.blockdot_stream_ms if kernel == "blockdot" else self.int4_stream_ms
        if timed is None:
            timed = self.quantized_ms if kernel == self.quantized_kernel else float("nan")
        return timed

    def describe(self) -> str:
        rows, K, N = self.shape
        blockdot_text = f"{self.blockdot_ms:.3f} ms" if self.blockdot_ms is not None else self.blockdot_note
        wide = (f"; {rows} rows: blockdot {self.blockdot_wide_ms:.3f} ms, dense {self.dense_wide_ms:.3f} ms"
                if self.blockdot_wide_ms is not None else "")
        wide += "".join(f"; {r} rows in cache: blockdot {b:.3f} ms, dequantized {d:.3f} ms" for r, b, d in self.dequantized_rows)
        if self.dense_panels_ms is not None:
            wide += (f"; dense at {DENSE_ROWS} rows in cache: torch {self.dense_torch_ms:.3f} ms, "
                     f"dense panels {self.dense_panels_ms:.3f} ms")
        return (f"[{rows}x{K}]@[{K}x{N}]: float32 {self.float32_ms:.3f} ms, bfloat16 {self.bfloat16_ms:.3f} ms; "
                f"one row in {self.kernel_dtype}, in cache: int4 kernel {self.int4_ms:.3f} ms, blockdot {blockdot_text}; "
                f"streamed from {self.stream_mb:.0f} MB: {self.quantized_kernel} {self.quantized_ms:.3f} ms, "
                f"dense {self.dense_ms:.3f} ms{wide}")


@dataclass(frozen=True)
class Precision:
    """What the engine computes in, and why."""

    dtype: str  # "float32", "bfloat16" or "float16"
    quantization: str | None  # None, "int8", "int4" or "keep" (the checkpoint's own)
    reasons: tuple[str, ...]  # one for each choice, as the plan prints them
    probe: Probe | None = None
    kernels: str = "torch"  # who runs quantized linears at few rows: "torch" or "blockdot"
    max_kernel_rows: int | None = DEFAULT_KERNEL_ROWS  # quantized kernels up to this many rows, the dense matrix above
    # A dense bf16 model's decode steps in one C call up to this many rows (fused_decode.c widens bf16
    # to float32), oneDNN's bf16 linears above; every width where the probe times bf16 below float32.
    bf16_one_call_rows: int = 2
    # Quantized linears past max_kernel_rows read a dense copy held for the model's life (True), or
    # blockdot's panels dequantized per call (False).
    dense_copies: bool = False
    # Who runs the dense matmuls on a CPU: "torch" (F.linear, on oneDNN's packed matrices where torch
    # packs them; the one-call decode reads panel copies), or "blockdot" (the matrices themselves
    # regrouped into blockdot's dense panels, at every width: one copy of each).
    dense_kernel: str = "torch"
    # The K/V cache's dtype: the dtype's, float16, or a block kind "q8_0" / "q4_0" (EngineConfig.kv_cache_dtype).
    kv_cache_dtype: str = "float32"
    # File-bit panels (blockdot-int8) on AMX tiles from this many rows; None: never.
    amx_rows: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


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


@functools.cache  # once per process: the tiles are the CPU's
def probe_amx(K: int = 1024, N: int = 1024) -> tuple[tuple[int, float, float], ...]:
    """(rows, vector tiles ms, AMX tiles ms) at each of AMX_ROWS for a random Q4_K matrix [N, K] on
    file-bit panels, in cache, one thread, interleaved; () where this build or CPU has no AMX tiles."""
    if not blockdot.amx():
        return ()
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (N * K // 256, 144), dtype=torch.uint8, generator=gen)
    raw[:, 0:4] = torch.tensor([0.002, 0.001], dtype=torch.float16).view(torch.uint8)  # d, dmin: finite
    vector = blockdot.pack_int8(decode_blocks(raw.reshape(N, -1).numpy(), "Q4_K"))
    tiles = dataclasses.replace(vector, amx_rows=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ladder = []
        for rows in AMX_ROWS:
            x = torch.randn(rows, K, generator=gen)
            a, b = _best_ms(functools.partial(vector, x), functools.partial(tiles, x), rounds=5)
            ladder.append((rows, a, b))
        return tuple(ladder)
    finally:
        torch.set_num_threads(threads)


def amx_rows(ladder: tuple[tuple[int, float, float], ...]) -> int | None:
    """blockdot_amx_rows="auto"'s choice from probe_amx's ladder: the narrowest width from which on
    the tiles time AMX_MARGIN faster at every width timed; None where they do not at the widest."""
    chosen = None
    for rows, vector_ms, tiles_ms in reversed(ladder):
        if tiles_ms * AMX_MARGIN > vector_ms:
            break
        chosen = rows
    return chosen


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


def cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest cache CPU 0 has (Linux's sysfs), 32 MiB where the system does not say. Not
    glibc's figure: on an AMD EPYC VM `getconf LEVEL3_CACHE_SIZE` said 256 MiB where sysfs said 32."""
    sizes = []
    for entry in root.glob("index*/size"):
        try:
            text = entry.read_text().strip()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=32 * 2**20)


def stream_bytes() -> int:
    """The streamed timings' working set: twice the last-level cache, 64-256 MiB."""
    return min(max(2 * cache_bytes(), STREAM_MIN), STREAM_MAX)


def _passes(fns: list[Callable[[], object]]) -> Callable[[], None]:
    def run() -> None:
        for fn in fns:
            fn()
    return run


def _probe(kernel_dtype: str | None, rows: int, K: int, N: int) -> Probe:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=gen) * 0.02
    x = torch.randn(rows, K, generator=gen)
    linear = torch.nn.functional.linear
    with torch.inference_mode():
        wb, xb = w.bfloat16(), x.bfloat16()
        fp32, bf16 = _best_ms(lambda: linear(x, w), lambda: linear(xb, wb))
        dtype = DTYPES[kernel_dtype] if kernel_dtype else (torch.bfloat16 if bf16 < fp32 else torch.float32)
        stored = quantize_int4(w)
        kernel = int4_pass(stored.codes, stored.scales, stored.mins + 8 * stored.scales, dtype)
        one, xs, dense = x[:1].to(dtype), x.to(dtype), w.to(dtype)
        figures = dict(float32_ms=fp32, bfloat16_ms=bf16, kernel_dtype=str(dtype).removeprefix("torch."),
                       shape=(rows, K, N))
        packed = None
        if not blockdot.supports(stored, dtype):
            figures["blockdot_note"] = f"not for {dtype} activations"
        elif blockdot.library() is None:
            figures["blockdot_note"] = f"not built ({blockdot.failure()})"
        else:
            packed = blockdot.pack(stored)
            figures["blockdot_ms"], _ = _best_ms(lambda: packed(one), lambda: kernel(one))
        figures["int4_ms"], _ = _best_ms(lambda: kernel(one), lambda: linear(one, dense))
        # The streamed set: copies of the matrix in one allocation (freed whole, back to the system),
        # each call reading the next; a pass of the dense set evicts the quantized one and itself.
        copies = -(-stream_bytes() // dense.nbytes)
        dense_set = dense.expand(copies, N, K).contiguous()
        figures["stream_mb"] = dense_set.nbytes / 2**20
        panels = [] if packed is None else [dataclasses.replace(packed, data=data)
                                            for data in packed.data.expand(copies, *packed.data.shape).contiguous()]
        int4_set = [dataclasses.replace(kernel, packed=p)
                    for p in kernel.packed.expand(copies, *kernel.packed.shape).contiguous()]
        int4_ms, dense_ms = _best_ms(_passes([functools.partial(q, one) for q in int4_set]),
                                     _passes([functools.partial(linear, one, d) for d in dense_set]), rounds=5)
        figures.update(int4_stream_ms=int4_ms / copies, dense_ms=dense_ms / copies, quantized_ms=int4_ms / copies)
        if panels:
            blockdot_ms, _ = _best_ms(_passes([functools.partial(q, one) for q in panels]),
                                      _passes([functools.partial(q, one) for q in int4_set]), rounds=5)
            figures["blockdot_stream_ms"] = blockdot_ms / copies
            if auto_kernel(figures["int4_ms"], figures.get("blockdot_ms")) == "blockdot":
                figures["quantized_ms"] = blockdot_ms / copies
        if panels:
            wide = [dataclasses.replace(q, int16_rows=1) for q in panels]
            wide_ms, dense_wide_ms = _best_ms(_passes([functools.partial(q, xs) for q in wide]),
                                              _passes([functools.partial(linear, xs, d) for d in dense_set]), rounds=5)
            figures.update(blockdot_wide_ms=wide_ms / copies, dense_wide_ms=dense_wide_ms / copies)
            ladder, one16 = [], dataclasses.replace(packed, int16_rows=1)
            for r in WIDE_ROWS:
                xr = torch.randn(r, K, generator=gen).to(dtype)
                b, d = _best_ms(functools.partial(one16, xr),
                                lambda xr=xr: linear(xr, packed.dequantize(dtype)), rounds=5)
                ladder.append((r, b, d))
            figures["dequantized_rows"] = tuple(ladder)
        if blockdot.library() is not None and dtype in blockdot.DTYPES:
            xd = torch.randn(DENSE_ROWS, K, generator=gen).to(dtype)
            on_torch = dense_weight(dense, packed=True)
            dense_panels = blockdot.pack_dense(dense)
            figures["dense_torch_ms"], figures["dense_panels_ms"] = _best_ms(
                lambda: on_torch(xd), lambda: dense_panels(xd), rounds=5)
    return Probe(**figures)


def resolve(dtype: str, quantization: str | None, device: torch.device, checkpoint_quantized: bool,
            probe: Callable[..., Probe] | None = None, kernels: str = "auto",
            max_kernel_rows: int | str | None = "auto", dense_copies: bool | str = "auto",
            dense_kernel: str = "auto", kv_cache_dtype: str = "auto", fused_decode: bool = True,
            chosen_by: str = "as configured", amx: int | bool | str = "auto") -> Precision:
    """Turns the config's "auto" values into a Precision.

    dtype "auto": bfloat16 on a CUDA device that supports it; on a CPU, bfloat16 when the probe
    times it faster than float32; float32 otherwise. quantization "auto": a checkpoint's own
    quantized matrices are kept in kernel form when the probe times the quantized kernel faster
    than the dense matmul at one row, both streamed from memory (where it is not, as with torch's
    kernel on float32 activations, they are dequantized into dense); a dense checkpoint stays dense. kernels "auto": blockdot unless the
    probe times torch's int4 kernel BLOCKDOT_MARGIN times faster at one row, torch's kernels then;
    "blockdot" asks for it (a ValueError where it cannot be built), "torch" for torch's.
    dense_copies "auto": on blockdot, none where the probe times its int16 path within WIDE_MARGIN
    of the panels dequantized per call at 16 rows (wide decode steps stay on the kernels, only
    wider ones dequantize), kept where it does not (a CPU whose dense matmuls outrun blockdot at
    decode widths, which would dequantize every such step); torch's kernels always keep them.
    max_kernel_rows "auto": on blockdot without copies, the widest of WIDE_ROWS up to which the
    probe times its int16 path within WIDE_MARGIN of the dequantized matmul; with copies, 16 where
    it is no slower than the streamed copy at 16 rows; DEFAULT_KERNEL_ROWS otherwise. A bf16 engine on a CPU
    whose probe times bf16 slower than float32 runs its dense decode steps in one call at every width.
    dense_kernel "auto": on a CPU, blockdot's dense panels where the probe times them no slower than
    torch's dense matmul at DENSE_ROWS rows in the chosen dtype, torch's otherwise; "blockdot" asks
    for them (a ValueError where the kernel cannot be built), "torch" for torch's.
    chosen_by: what the reasons say chose a kernel or dense kernel given here ("as configured").
    amx (PlanOverrides.blockdot_amx_rows), where a checkpoint's quantization is kept on blockdot: an
    int puts file-bit panels on AMX tiles from that many rows (a ValueError where there are none),
    False never, "auto" from the probe's choice (amx_rows; never where the CPU has no tiles).
    kv_cache_dtype "auto": float16 where quantized weights on blockdot compute in float32 on a CPU
    whose blockdot build has vectors (fused_decode.c widens a float16 cache with F16C's instructions):
    half float32's bytes a token, llama.cpp's default, and no loss quantbench can see (perplexity
    +0.00%, top-1 agreement with float32 99.96%, notes/quantbench.md); the dtype elsewhere, the
    exact path's float32 included. "q8_0", "q4_0" (llama.cpp's blocks, kv_quant) only where asked
    for; the reason says how they are read (fused_decode: whether the C decode may run them).
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
            # timed on the kernel that would run it: the one asked for, else the one kernels="auto" takes
            kernel = kernels if kernels in KERNELS else figures.quantized_kernel
            quantized_ms = figures.stream_ms(kernel)
            faster = quantized_ms < figures.dense_ms
            quantization = "keep" if faster else None
            reasons.append(f"the checkpoint's quantization {'kept' if faster else 'dequantized'}: "
                           f"{kernel}'s int4 {figures.dense_ms / quantized_ms:.2f}x the dense "
                           "matmul's speed at one row, streamed")
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
        reasons.append(f"kernels blockdot: {chosen_by}")
    elif kernels == "auto" and quantization == "int8":
        reasons.append("kernels torch: blockdot does not run int8 per channel")
    elif kernels == "auto" and quantization is not None and device.type == "cpu":
        if figures is None or figures.kernel_dtype != dtype:
            figures = probe(kernel_dtype=dtype)
        if auto_kernel(figures.int4_ms, figures.blockdot_ms) == "blockdot":
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
    on_blockdot = chosen == "blockdot" and quantization is not None and device.type == "cpu"
    if not on_blockdot:
        dense_copies = True  # torch's kernels have no per-call dequantizing: their linears keep copies
    if on_blockdot and "auto" in (max_kernel_rows, dense_copies):
        if figures is None or figures.kernel_dtype != dtype:
            figures = probe(kernel_dtype=dtype)
        # without copies: the widest ladder step blockdot holds within the margin, None where it loses at 16
        lean_rows = None
        for rows, kernel_ms, dequantized_ms in figures.dequantized_rows:
            if kernel_ms > dequantized_ms * WIDE_MARGIN:
                break
            lean_rows = rows
        ladder = (", ".join(f"{d / b:.2f}x" for _, b, d in figures.dequantized_rows) + " the dequantized matmul's speed at "
                  + ", ".join(str(r) for r, _, _ in figures.dequantized_rows) + " rows")
        if dense_copies == "auto":
            dense_copies = lean_rows is None and figures.blockdot_wide_ms is not None
            reasons.append(f"dense copies {'kept' if dense_copies else 'none'}: blockdot {ladder}" if figures.dequantized_rows
                           else "dense copies none: no wide timing")
        if max_kernel_rows == "auto":
            max_kernel_rows = DEFAULT_KERNEL_ROWS
            if dense_copies and figures.blockdot_wide_ms is not None:
                if figures.blockdot_wide_ms <= figures.dense_wide_ms:
                    max_kernel_rows = figures.shape[0]
                reasons.append(f"kernels up to {max_kernel_rows} rows: blockdot {figures.dense_wide_ms / figures.blockdot_wide_ms:.2f}x "
                               f"the dense copy's speed at {figures.shape[0]} rows, streamed")
            elif not dense_copies:
                max_kernel_rows = lean_rows or DEFAULT_KERNEL_ROWS
                if figures.dequantized_rows:
                    reasons.append(f"kernels up to {max_kernel_rows} rows: blockdot {ladder}")
    if max_kernel_rows == "auto":
        max_kernel_rows = DEFAULT_KERNEL_ROWS
    if dense_copies == "auto":
        dense_copies = False
    bf16_one_call_rows = 2
    if dtype == "bfloat16" and device.type == "cpu":
        if figures is None:
            figures = probe()
        if figures.bfloat16_ms > figures.float32_ms:
            bf16_one_call_rows = 2**31
            reasons.append(f"bf16 decode steps in one call at every width: bfloat16 {figures.float32_ms / figures.bfloat16_ms:.2f}x "
                           "float32's speed")
    if dense_kernel not in ("auto", *KERNELS):
        raise ValueError(f"dense_kernel={dense_kernel!r} is not one of {['auto', *KERNELS]}")
    if dense_kernel == "blockdot":
        if blockdot.library() is None or device.type != "cpu":
            raise ValueError(f"dense_kernel='blockdot' runs on a CPU build of the blockdot kernel; device={device.type!r}, "
                             f"build: {blockdot.failure() or 'ok'}")
        reasons.append(f"dense kernel blockdot: {chosen_by}")
    elif dense_kernel == "auto":
        dense_kernel = "torch"
        if device.type == "cpu" and DTYPES[dtype] in blockdot.DTYPES and blockdot.library() is not None:
            if figures is None or figures.kernel_dtype != dtype:
                figures = probe(kernel_dtype=dtype)
            if figures.dense_panels_ms is not None:
                dense_kernel = "blockdot" if figures.dense_panels_ms <= figures.dense_torch_ms else "torch"
                reasons.append(f"dense kernel {dense_kernel}: blockdot's dense panels "
                               f"{figures.dense_torch_ms / figures.dense_panels_ms:.2f}x torch's speed at {DENSE_ROWS} rows")
    if kv_cache_dtype == "auto":
        library = blockdot.library() if on_blockdot and fused_decode and dtype == "float32" else None
        kv_cache_dtype = "float16" if library is not None and library.simd > 0 else dtype
        reasons.append("kv cache float16: quantized weights on blockdot in float32, whose fused decode widens float16 "
                       "K/V in vectors (half float32's bytes a token)" if kv_cache_dtype == "float16"
                       else f"kv cache {dtype}: the dtype's")
    elif kv_cache_dtype not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not one of {['auto', *KV_DTYPES]}")
    elif kv_cache_dtype in BLOCK_BYTES:
        reads = ("fused_decode.c widens each run of keys and values to float32 before its dot products (torch's "
                 "steps dequantize the blocks they gather)" if fused_decode
                 else "attention dequantizes the blocks it gathers to the dtype")
        reasons.append(f"kv cache {kv_cache_dtype}: as configured; llama.cpp's blocks of {QK} values along each head "
                       f"({BLOCK_BYTES[kv_cache_dtype]} bytes), quantized as written; {reads}")
    else:
        reasons.append(f"kv cache {kv_cache_dtype}: as configured")
    tiles_from = None
    if on_blockdot and quantization == "keep" and amx is not False:
        if amx == "auto":
            ladder = probe_amx()
            tiles_from = amx_rows(ladder)
            if ladder:
                timed = (", ".join(f"{v / t:.2f}x" for _, v, t in ladder) + " the vector tiles' speed at "
                         + ", ".join(str(r) for r, _, _ in ladder) + " rows")
                reasons.append(f"file-bit panels on AMX tiles from {tiles_from} rows: {timed}" if tiles_from
                               else f"file-bit panels never on AMX tiles: {timed}")
        elif not blockdot.amx():
            raise ValueError(f"blockdot_amx_rows={amx!r} but this CPU or build has no AMX tiles (amx_int8 in "
                             "/proc/cpuinfo and Linux's permission); use False or 'auto'")
        else:
            tiles_from = amx
            reasons.append(f"file-bit panels on AMX tiles from {amx} rows: as configured")
    return Precision(dtype, quantization, tuple(reasons), figures, chosen, max_kernel_rows, bf16_one_call_rows,
                     dense_copies, dense_kernel, kv_cache_dtype, tiles_from)
