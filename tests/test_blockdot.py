"""blockdot, nanoserve's own kernel for GGUF blocks, against the stored forms' dequantized float32.

The reference is x @ w^T in float64 with w the stored form's own dequantize() (checked against
gguf's arithmetic in test_gguf). Tolerances from the precision: the kernel's weights and scales are
exact and its sums float32, so float32 activations land within 1e-5 of the output's scale (K
products, each rounded at 2^-24); bf16 activations are exact inputs too, and only the bf16 output's
rounding is added: within 2^-8 of the output's scale. Every build the probe could meet is run: this
machine's (-march=native), AVX-512 without VNNI and AVX2 where the CPU has them, and plain C.

The int16 path (from int16_rows rows) rounds x to int16 per block of 32 first: its reference is
that rounding done here by hand (q = round(x 32767 / amax) to nearest even, in float32 as the kernel
does), then the same float64 matmul, and it is held to the same 1e-5; and against the unrounded
product to the bound the rounding allows, sum over k of |w[n, k]| amax(k's block) / 65534.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch
from test_gguf_types import random_blocks
from test_quant import random_stored

from nanoserve.model import blockdot, cabi, precision
from nanoserve.model.gguf import BlockQuantized, decode_blocks
from nanoserve.model.quant import QuantLinear, cat_rows, quant_linear, quantize_int4

# Tests of this machine's own build; without a C compiler torch's kernels serve and they have nothing to run.
needs_build = pytest.mark.skipif(blockdot.library() is None, reason=f"blockdot not built here: {blockdot.failure()}")


def _cpu_has(flag: str) -> bool:
    try:
        return f" {flag} " in open("/proc/cpuinfo").read().replace("\n", " ")
    except OSError:
        return False


# The AVX-512 branch on a CPU without AVX-512: its intrinsics emulated by SIMDe's headers, found in
# the directory NANOSERVE_SIMDE names (one holding simde/, e.g. a checkout of
# github.com/simd-everywhere/simde) or else in /usr/include (Debian's libsimde-dev, which .ci/run installs).
# Built on AVX2 where the CPU has it; the library then holds no AVX-512 instruction, and reports 512.
SIMDE = os.environ.get("NANOSERVE_SIMDE") or ("/usr/include" if Path("/usr/include/simde/x86/avx512.h").is_file() else None)
PRELUDE = Path(__file__).with_name("simde_avx512.h")
EMULATED = {"avx512-simde": [], "avx512vnni-simde": ["-DEMULATE_VNNI"]}


def build(name: str) -> blockdot.Library:
    """blockdot built as `name` (one of blockdot.BUILDS or EMULATED), or the test skipped with the reason."""
    if name == "avx2" and not _cpu_has("avx2"):
        pytest.skip("this CPU has no AVX2")
    if name == "avx512" and not _cpu_has("avx512bw"):
        pytest.skip("this CPU has no AVX-512 BW")
    if name in EMULATED and not (SIMDE and (Path(SIMDE) / "simde" / "x86" / "avx512.h").exists()):
        pytest.skip("AVX-512 under emulation needs SIMDe: apt-get install libsimde-dev, or NANOSERVE_SIMDE=<a directory holding simde/>")
    flags = blockdot.BUILDS.get(name)
    if flags is None:
        vector = ["-mavx2", "-mfma", "-mf16c"] if _cpu_has("avx2") and _cpu_has("fma") else []
        digest = hashlib.sha256(PRELUDE.read_bytes()).hexdigest()[:12]  # in the flags, so in the cache key
        flags = [*blockdot._BASE, *vector, "-Wno-psabi", f"-I{SIMDE}", *EMULATED[name], f"-DPRELUDE={digest}",
                 "-include", str(PRELUDE)]
    if shutil.which(cabi.compiler()[0]) is None:
        pytest.skip(f"no C compiler here ({cabi.compiler()[0]})")
    return blockdot.load(flags)  # with a compiler, a build that fails is a failure, not a skip


@pytest.fixture(scope="module", params=[*blockdot.BUILDS, *EMULATED])
def kernel(request):
    return request.param, build(request.param)


def test_each_build_has_the_vector_width_its_flags_ask_for(kernel):
    name, built = kernel
    native = 512 if _cpu_has("avx512f") else 256 if _cpu_has("avx2") and _cpu_has("fma") else None
    expected = {"avx512": 512, "avx2": 256, "plain": 0, "native": native, "avx512-simde": 512,
                "avx512vnni-simde": 512}[name]
    if expected is None:
        pytest.skip("neither AVX-512 nor AVX2 here: what -march=native gives is the compiler's to say")
    assert built.simd == expected


# Every kind blockdot runs: the 4-bit and int8 codes in fp16 heads, the K-quants' in float32 heads, Q6_K's
# and Q3_K's two scales a block, Q2_K's two scales and two mins; and rows of several kinds stacked
# (a llama.cpp mix's qkv): Q4_K rows (a min a group of 32) beside Q6_K rows (groups of 16, no min).
KINDS = ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "IQ4_XS", "Q6_K", "Q3_K", "Q2_K",
         "Q4_K+Q6_K"]


def stored_of(kind: str, N: int, K: int = 96) -> BlockQuantized:
    """A random matrix of `kind` as a GGUF file stores it: Q4_0/Q4_1/Q8_0 from random weights with
    their scales rounded to fp16, the others from random blocks (test_gguf_types), K a whole number of
    the kind's blocks (256 weights for the K-quants and IQ4_XS)."""
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        stored = random_stored(kind, N, K)
        stored.scales = stored.scales.half().float()  # GGUF's scales are fp16
        if stored.mins is not None:
            stored.mins = stored.mins.half().float()
        return stored
    K = -(-K // 256) * 256 if kind.endswith("_K") or kind in ("IQ4_XS", "Q4_K+Q6_K") else K
    if "+" in kind:  # the first kind's rows, then 16 of the second's
        first, second = kind.split("+")
        return cat_rows([decode_blocks(random_blocks(first, N - 16, K, seed=N, finite=True), first),
                         decode_blocks(random_blocks(second, 16, K, seed=N + 1, finite=True), second)])
    return decode_blocks(random_blocks(kind, N, K, seed=N, finite=True), kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("N", [48, 40, 200])  # 40: a panel's padding; 200: 13 panels, a tail of one
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9])  # every tile shape, and a second pass of 8 rows
def test_equals_the_dequantized_matmul(kernel, kind, N, rows):
    _, kernel = kernel
    stored = stored_of(kind, N)
    K = stored.shape[1]
    panels = blockdot.pack(stored, kernel)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    expected = x.double() @ stored.dequantize().double().T
    scale = expected.abs().max().item()
    out = panels(x)
    assert out.shape == (rows, N) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=1e-5 * scale, rtol=0)
    xb = x.bfloat16()
    expected = xb.double() @ stored.dequantize().double().T
    out = panels(xb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, atol=2**-8 * expected.abs().max().item(), rtol=0)


def int16_rounded(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the int16 path reads it, xd q per block of 32, in float64 (the rounding by hand)."""
    M, K = x.shape
    blocks = x.float().view(M, K // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 32767 / amax, torch.zeros_like(amax))  # float32, as the kernel computes it
    q = torch.round(blocks * inv)  # to nearest even
    assert q.abs().max() <= 32767
    return (q.double() * (amax / 32767).double()).view(M, K)


def block_mins(stored: BlockQuantized) -> torch.Tensor:
    """m of w = d q + m per (row, group) as the kernel splits it: Q4_0's -8 d (q in 0..15), a kind's own
    mins where it has them, else 0 (its int8 q as stored)."""
    if stored.kind == "Q4_0":
        return -8 * stored.scales.double()
    N, K = stored.shape
    return torch.zeros(N, K // stored.group, dtype=torch.float64) if stored.mins is None else stored.mins.double()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("N", [40, 200])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17])
def test_the_int16_path_equals_its_rounding_done_by_hand(kernel, kind, N, rows):
    _, kernel = kernel
    stored = stored_of(kind, N)
    K = stored.shape[1]
    panels = blockdot.pack(stored, kernel, int16_rows=1)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    x[0, 32:64] = 0  # a block of zeros: scale 0, codes 0
    w = stored.dequantize().double()
    # The kernel takes m sum(x), the m part, from x itself: only the d q part sees the rounding.
    rounded = int16_rounded(x)
    G = stored.group
    sums = lambda t: t.view(rows, K // G, G).sum(-1)  # noqa: E731
    expected = rounded @ w.T + (sums(x.double()) - sums(rounded)) @ block_mins(stored).T
    # float32's rounding scales with the largest term: the min part m sum(x) where it outweighs the
    # result (Q2_K's random mins do)
    scale = max(expected.abs().max().item(), (sums(x.double()).abs() @ block_mins(stored).abs().T).max().item())
    out = panels(x)
    torch.testing.assert_close(out.double(), expected, atol=1e-5 * scale, rtol=0)
    # against the unrounded product: within what rounding each x by at most half a step allows
    exact = x.double() @ w.T
    amax = x.double().view(rows, K // 32, 32).abs().amax(-1)  # [rows, B]
    bound = (w.abs().view(N, K // 32, 32).sum(-1) @ (amax / 65534).T).T  # [rows, N]
    assert ((out.double() - exact).abs() <= bound + 1e-5 * scale).all()
    assert (out.double() - exact).abs().max() > 1e-6 * scale  # it did round: this is not the float path
    bf16 = panels(x.bfloat16())  # bf16 activations are widened exactly, then rounded alike
    expected = int16_rounded(x.bfloat16().float()) @ w.T + (
        sums(x.bfloat16().double()) - sums(int16_rounded(x.bfloat16().float()))) @ block_mins(stored).T
    torch.testing.assert_close(bf16.double(), expected, atol=2**-8 * scale, rtol=0)


@needs_build
def test_the_int16_path_starts_at_int16_rows():
    stored = quantize_int4(torch.randn(48, 64, generator=torch.Generator().manual_seed(2)))
    panels = blockdot.pack(stored, int16_rows=4)
    w = stored.dequantize().double()
    for rows in (1, 3, 4, 6):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        exact = x.double() @ w.T
        error = (panels(x).double() - exact).abs().max().item() / exact.abs().max().item()
        assert (error > 1e-6) == (rows >= 4), (rows, error)
    assert blockdot.pack(stored).int16_rows == 0  # the default: float32 at every row count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, K", [(4, 48), (16, 37), (17, 48), (40, 33)])  # a panel's padding, one whole, odd K
# every tile width of x's rows up to 12 (AVX-512's) and the splits of a wider M into even tiles
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 12, 13, 25])
def test_dense_panels_equal_the_matmul(kernel, dtype, N, K, rows):
    # the fused decode's dense matmul, called alone (outside a parallel region its `omp for` runs
    # here), on each build: an AVX2 build's bf16 panels hold rows j and j + 8 in a word, the others in order
    _, kernel = kernel
    gen = torch.Generator().manual_seed(rows)
    w, x = torch.randn(N, K, generator=gen).to(dtype), torch.randn(rows, K, generator=gen)
    panels = blockdot.pack_dense(w, kernel)
    assert panels.data.shape == (-(-N // 16), K, 16) and panels.dtype == dtype
    y = torch.full((rows, N), float("nan"))
    kernel.lib.dense_tasks(x.data_ptr(), rows, K, N, panels.data.data_ptr(), int(dtype == torch.bfloat16), y.data_ptr())
    expected = x.double() @ w.double().T  # bf16 weights are widened exactly
    torch.testing.assert_close(y.double(), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 9, 32])
def test_dense_panels_against_float64(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(37, 48, generator=gen).to(dtype)  # 37: two panels and a padded one
    x = torch.randn(rows, 48, generator=gen)
    expected = x.double() @ w.double().T  # bf16 weights are widened exactly
    panels = blockdot.pack_dense(w)
    torch.testing.assert_close(panels(x).double(), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    # bf16 activations widen exactly and the result rounds to bf16, as `linear` returns x's dtype
    out = panels(x.bfloat16())
    assert out.dtype == torch.bfloat16
    expected = x.bfloat16().double() @ w.double().T
    torch.testing.assert_close(out.double(), expected, atol=2**-7 * expected.abs().max().item(), rtol=0)
    assert panels(x[:0]).shape == (0, 37)  # a step with no row to read (no sampled row) is empty, not an error
    # the regrouping is a permutation: the matrix comes back bit for bit, and the one given is untouched
    assert torch.equal(panels.dense(), w) and panels.nbytes == 48 * 48 * w.element_size()


@needs_build
def test_dense_panels_from_a_onednn_packed_matrix():
    from nanoserve.model.forms import can_pack, pack
    w = torch.randn(40, 64)
    if not can_pack(w.dtype):
        pytest.skip("no oneDNN here")
    assert torch.equal(blockdot.pack_dense(pack(w).weight).dense(), w)


@needs_build
def test_dense_panels_refuse_what_they_cannot_read():
    with pytest.raises(ValueError, match="float32 or bf16 matrix \\[N, K\\] on the CPU; got torch.float16 \\[4, 48\\]"):
        blockdot.pack_dense(torch.zeros(4, 48, dtype=torch.float16))
    with pytest.raises(ValueError, match="got torch.float32 \\[2, 4, 48\\]"):
        blockdot.pack_dense(torch.zeros(2, 4, 48))
    panels = blockdot.pack_dense(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="got torch.float16"):
        panels(torch.zeros(1, 48, dtype=torch.float16))
    with pytest.raises(ValueError, match="dense panels \\[4, 48\\] take x \\[M, 48\\], got \\[1, 40\\]"):
        panels(torch.zeros(1, 40))


@needs_build
def test_a_hand_built_block():
    # One row of Q4_1 with d = 0.5, m = -1, codes 0..15 then 15..0: w[k] = 0.5 q[k] - 1. A one-hot x
    # picks a single weight; a ones x sums them: 0.5 * (2 * 120) - 32 = 88.
    codes = torch.cat([torch.arange(16), torch.arange(15, -1, -1)]).to(torch.uint8).unsqueeze(0)
    stored = BlockQuantized("Q4_1", codes, torch.tensor([[0.5]]), torch.tensor([[-1.0]]))
    panels = blockdot.pack(stored)
    for k, q in ((0, 0), (5, 5), (17, 14), (31, 0)):
        x = torch.zeros(1, 32)
        x[0, k] = 1.0
        assert panels(x).item() == 0.5 * q - 1
    assert panels(torch.ones(1, 32)).item() == 88.0
    # Q8_0 code -77 at d = 0.5: w = -38.5, read from its int8 byte
    q8 = BlockQuantized("Q8_0", torch.full((1, 32), -77, dtype=torch.int8), torch.tensor([[0.5]]), None)
    x = torch.zeros(1, 32)
    x[0, 7] = 1.0
    assert blockdot.pack(q8)(x).item() == -38.5


@needs_build
def test_scales_fp16_does_not_hold_go_in_float_heads_and_other_kinds_are_refused_by_name():
    q4 = random_stored("Q4_1", 16, 32)
    q4.scales = q4.scales * 0 + (1 + 2**-15)  # not an fp16 value; its products with codes exact in float32, as a K-quant's
    assert blockdot.supports(q4, torch.float32)
    panels = blockdot.pack(q4)
    assert panels.planes == 1 | blockdot.F32_HEADS and torch.equal(panels.dequantize(), q4.dequantize())
    per_channel = random_stored("int8", 16, 32)  # nanoserve's own int8 (a scale a row) is torch's to run
    assert not blockdot.supports(per_channel, torch.float32)
    with pytest.raises(ValueError, match=r"blockdot runs \('Q4_0'.*matrices on the CPU; got ChannelInt8"):
        blockdot.pack(per_channel)
    fine = random_stored("Q4_1", 16, 32)
    fine.scales, fine.mins = fine.scales.half().float(), fine.mins.half().float()
    assert blockdot.supports(fine, torch.bfloat16) and not blockdot.supports(fine, torch.float16)
    assert not blockdot.supports(random_stored("int8", 16, 32), torch.float32)
    panels = blockdot.pack(fine)
    with pytest.raises(ValueError, match="activations in .*got torch.float16"):
        panels(torch.zeros(1, 32, dtype=torch.float16))


@needs_build
def test_nanoserves_own_int4_is_run_exactly():
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(4))
    stored = quantize_int4(w)
    assert blockdot.supports(stored, torch.float32)
    x = torch.randn(3, 64)
    expected = x.double() @ stored.dequantize().double().T
    torch.testing.assert_close(blockdot.pack(stored)(x).double(), expected, atol=1e-5 * expected.abs().max().item(),
                               rtol=0)


@needs_build
def test_quant_linear_takes_blockdot_when_asked_and_keeps_the_dense_copy_above():
    stored = random_stored("Q8_0", 32, 64)
    stored.scales = stored.scales.half().float()
    linear = quant_linear(stored, torch.bfloat16, 8, pack=False, kernels="blockdot")
    assert [type(p) for p in linear.passes] == [blockdot.Panels] and linear.nbytes_by_kind()["quantized"] == 2 * 2 * (64 + 512)
    torch_linear = quant_linear(stored, torch.bfloat16, 8, pack=False, kernels="torch")
    assert len(torch_linear.passes) == 2  # torch's: Q8_0 as two int4 passes
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    torch.testing.assert_close(linear(x).float(), torch_linear(x).float(), atol=0.05, rtol=0.02)
    wide = torch.randn(9, 64).bfloat16()  # past max_kernel_rows: the dense copy, as before
    assert torch.equal(linear(wide), torch_linear(wide))
    with pytest.raises(ValueError, match="kernels='cuda' is not one of"):
        quant_linear(stored, torch.bfloat16, 8, pack=False, kernels="cuda")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("N", [48, 40, 200])
def test_panels_dequantize_bit_for_bit_as_stored(kernel, kind, N):
    _, kernel = kernel
    stored = stored_of(kind, N)
    panels = blockdot.pack(stored, kernel)
    reference = stored.dequantize()  # gguf.quants.dequantize's arithmetic (test_gguf)
    assert torch.equal(panels.dequantize(), reference)
    assert torch.equal(panels.dequantize(torch.bfloat16), reference.bfloat16())
    with pytest.raises(ValueError, match="dequantizes to"):
        panels.dequantize(torch.float16)


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_a_dense_copy_wide_rows_multiply_by_the_panels_dequantized(dtype):
    stored = random_stored("Q4_1", 40, 64)
    stored.scales, stored.mins = stored.scales.half().float(), stored.mins.half().float()
    linear = quant_linear(stored, dtype, 4, pack=False, kernels="blockdot", int16_rows=1, dense_copy=False)
    copied = quant_linear(stored, dtype, 4, pack=False, kernels="blockdot", int16_rows=1)
    assert linear.dense is None and linear.nbytes_by_kind()["dense_copies"] == 0 and linear.dequantizes
    assert copied.nbytes_by_kind()["dense_copies"] == 40 * 64 * dtype.itemsize and not copied.dequantizes
    for rows in (5, 64):  # past max_kernel_rows: the same matmul as the dense copy's, exactly
        x = torch.randn(rows, 64).to(dtype)
        assert torch.equal(linear(x), torch.nn.functional.linear(x, stored.dequantize().to(dtype)))
        assert torch.equal(linear(x), copied(x))
    narrow = torch.randn(4, 64).to(dtype)
    assert torch.equal(linear(narrow), copied.passes[0](narrow))  # up to it: the kernel, int16 path
    # torch's kernels have no dequantizing of their own: they keep the copy whatever is asked
    assert quant_linear(stored, dtype, 4, pack=False, kernels="torch", dense_copy=False).dense is not None
    with pytest.raises(ValueError, match="needs a dense copy unless it runs on blockdot's panels alone"):
        QuantLinear(copied.passes * 2, None, 4, (40, 64), dtype)


@needs_build
def test_a_model_laid_out_on_blockdot_gives_the_torch_kernels_logits():
    from conftest import make_hf_llama, nanoserve_model_from_hf, prepared
    from test_quant import _logits

    model = nanoserve_model_from_hf(make_hf_llama(seed=3))
    tokens = [5, 17, 3, 60, 2]
    settings = dict(dtype="float32", quantization="int4", max_kernel_rows=8, pack_weights=False, fused_decode=False,
                    blockdot_int16_rows=None, dense_copies=True)
    ours = prepared(model, kernels="blockdot", **settings)
    theirs = prepared(model, kernels="torch", **settings)
    assert any(isinstance(p, blockdot.Panels) for p in ours.layers[0].qkv.passes)
    # float32 activations: torch's int4 kernel is exact too, so the two agree to float32's rounding
    torch.testing.assert_close(_logits(ours, tokens), _logits(theirs, tokens), atol=1e-4, rtol=1e-4)


def test_no_build_falls_back_to_torch_and_an_explicit_ask_is_refused(monkeypatch):
    monkeypatch.setattr(blockdot, "_library", None)
    monkeypatch.setattr(blockdot, "_failure", "OSError: cc not found (faked)")
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="kernels='blockdot' but the blockdot kernel could not be built: OSError"):
        precision.resolve("bfloat16", "int4", cpu, False, kernels="blockdot")
    figures = precision._probe("bfloat16", 4, 64, 64)
    assert figures.blockdot_ms is None and "not built (OSError: cc not found (faked))" in figures.blockdot_note


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_kv_cache_rounds_and_widens_as_torch_does_on_every_build(kernel, dtype):
    # fused_decode.c writes K and V into a float16 cache with F16C's vcvtps2ph where the build has it,
    # in blockdot.h's software elsewhere (the plain build): both to nearest even, bit for bit as
    # torch's .to(). Values at every scale: float16's subnormals and their ties, 65,504 and the
    # 65,520 that rounds to infinity, zeros, infinities and NaN.
    _, kernel = kernel
    kinds = {torch.float16: 2, torch.bfloat16: 1}  # fused_decode.c's KV_F16, KV_BF16
    gen = torch.Generator().manual_seed(5)
    scales = 2.0 ** torch.arange(-30, 20, dtype=torch.float32)
    x = (torch.randn(50, 200, generator=gen) * scales[:, None]).flatten()
    ties = torch.arange(0, 2048, dtype=torch.float32) * 2.0**-25  # every half-step of float16's subnormals
    edges = torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, -65520.0, 1e6, float("inf"), -float("inf"),
                          2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11])
    x = torch.cat([x, ties, -ties, edges, torch.tensor([float("nan")])])
    cache = torch.empty(x.numel(), dtype=dtype)
    kernel.lib.fused_kv_store(x.data_ptr(), cache.data_ptr(), x.numel(), kinds[dtype])
    expected = x.to(dtype)
    assert torch.equal(cache[:-1].view(torch.int16), expected[:-1].view(torch.int16))
    assert cache[-1].isnan()
    back = torch.empty(x.numel())
    kernel.lib.fused_kv_widen(cache.data_ptr(), back.data_ptr(), x.numel(), kinds[dtype])
    assert torch.equal(back[:-1], expected[:-1].float()) and back[-1].isnan()


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_the_kv_cache_blocks_are_gguf_pys_bytes_on_every_build(kernel, kind):
    # fused_decode.c's store quantizes K and V as llama.cpp's reference does (gguf-py's bytes, the
    # same as kv_quant.py's torch path writes), and its attention widens them to gguf-py's values,
    # with AVX-512's, AVX2's or plain C's instructions as the build has them.
    from test_kv_quant import awkward, gguf_bytes, gguf_values

    _, kernel = kernel
    code = {"q8_0": 3, "q4_0": 4}[kind]  # fused_decode.c's KV_Q8_0, KV_Q4_0
    x = awkward(64, 128, seed=2).flatten()
    cache = torch.zeros(gguf_bytes(x[None], kind).numel(), dtype=torch.uint8)
    kernel.lib.fused_kv_store(x.data_ptr(), cache.data_ptr(), x.numel(), code)
    assert torch.equal(cache, gguf_bytes(x[None], kind).flatten())
    back = torch.empty(x.numel())
    kernel.lib.fused_kv_widen(cache.data_ptr(), back.data_ptr(), x.numel(), code)
    assert torch.equal(back, gguf_values(x[None], kind).flatten())


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q2_K", "Q4_K+Q6_K"])
@pytest.mark.parametrize("int16_rows", [0, 1])
def test_a_rows_output_bits_do_not_change_with_the_rows_beside_it(kernel, kind, int16_rows):
    # Batch invariance at the kernel: each output is one fixed sequence of operations over its own
    # row of x (the tiles differ in how many rows and panels they hold, not in a row's arithmetic),
    # so a row alone, or at any place in a call of any width, gets the same bits.
    _, kernel = kernel
    stored = stored_of(kind, 200)
    panels = blockdot.pack(stored, kernel, int16_rows=int16_rows or None)
    x = torch.randn(37, stored.shape[1], generator=torch.Generator().manual_seed(9))
    full = panels(x)
    for width in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16):
        for start in (0, 5, 37 - width):
            assert torch.equal(panels(x[start:start + width]), full[start:start + width]), (width, start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_output_bits_do_not_change_with_the_rows_beside_it_on_dense_panels(kernel, dtype):
    # The dense panels' tiles hold 1 to 12 rows (3 on AVX2) as the call's width divides: each row is two
    # sums (even and odd k) in every tile, so its bits are the same in any; K odd reaches the tail.
    _, kernel = kernel
    for K in (96, 97):
        w = torch.randn(40, K, generator=torch.Generator().manual_seed(10)).to(dtype)
        panels = blockdot.pack_dense(w, kernel)
        x = torch.randn(37, K, generator=torch.Generator().manual_seed(11))
        full = panels(x)  # float32 activations, as the one call gives them
        for width in (1, 2, 3, 4, 5, 7, 8, 12, 13, 25):
            for start in (0, 5, 37 - width):
                assert torch.equal(panels(x[start:start + width]), full[start:start + width]), (K, width, start)
