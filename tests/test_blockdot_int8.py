"""blockdot's file-bit panels (blockdot.pack_int8): Q4_K, Q6_K and IQ4_XS, and the 32-weight kinds (Q4_0,
IQ4_NL, Q8_0, Q4_1, Q5_0, Q5_1), at their file's bits, x rounded to int8 per block of 32 and summed in integers.

References are independent of the kernel: gguf-py's dequantize for the weights, and x rounded by
hand here (numpy: q = round-half-even(127 x / amax) per block of 32, x ~ amax / 127 q), so the
kernel's output must equal that rounded x times the file's matrix up to float32 summation only.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from nanoserve.model import blockdot
from nanoserve.model.gguf import BlockQuantized, decode_blocks
from nanoserve.model.quant import cat_rows
from tests.test_blockdot import EMULATED, build
from tests.test_gguf_types import random_blocks

pytestmark = pytest.mark.skipif(blockdot.library() is None, reason=f"no blockdot build here: {blockdot.failure()}")
FILE_BITS = {"Q4_K": 4.75, "Q6_K": 6.625, "IQ4_XS": 4.375}  # the panels' bits a weight, from blockdot.c's layout comment
FILE = {"Q4_K": 144 * 8 / 256, "Q6_K": 210 * 8 / 256, "IQ4_XS": 136 * 8 / 256}  # the file's: ggml-common.h's block sizes
# the 32-weight kinds: ggml-common.h's block bytes (fp16 d, fp16 m, uint32 qh, the codes) over 32 weights
BLOCK_FILE = {"Q4_0": 18 * 8 / 32, "IQ4_NL": 18 * 8 / 32, "Q8_0": 34 * 8 / 32, "Q4_1": 20 * 8 / 32,
              "Q5_0": 22 * 8 / 32, "Q5_1": 24 * 8 / 32}


def rounded_x(x: torch.Tensor) -> np.ndarray:
    """x [M, K] rounded to int8 per block of 32 as the kernel is documented to, in float64."""
    blocks = x.double().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True).astype(np.float32)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(blocks.astype(np.float32) * inv)  # rint: half to even
    return (q * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)


def matrix(kind: str, rows: int, cols: int, seed: int) -> tuple[BlockQuantized, torch.Tensor]:
    raw = random_blocks(kind, rows, cols, seed=seed, finite=True)
    reference = torch.from_numpy(dequantize(raw, QT[kind]).reshape(rows, cols).copy())
    return decode_blocks(raw, kind), reference


@pytest.mark.parametrize("kind", list(FILE_BITS))
@pytest.mark.parametrize("build_name", ["native", "avx512", "avx2", "plain", *EMULATED])
def test_file_bit_panels_compute_the_file_matrix_times_x_rounded_to_int8(kind, build_name):
    kernel = build(build_name)
    w, reference = matrix(kind, rows=40, cols=768, seed=7)  # 40 rows: a panel and a half, its tail padded
    panels = blockdot.pack_int8(w, kernel)
    assert panels.form_name == "blockdot-int8"
    assert torch.equal(panels.dequantize(), reference)  # the codes and scales exactly as the file's
    assert torch.equal(panels.dequantize(torch.bfloat16), reference.to(torch.bfloat16))
    gen = torch.Generator().manual_seed(3)
    for rows in (1, 2, 3, 4, 5, 8, 9, 17):
        x = torch.randn(rows, 768, generator=gen)
        x[0, :32] = 0  # an all-zero block: scale 0
        expected = rounded_x(x) @ reference.double().numpy().T
        got = panels(x).double().numpy()
        # only float32 scaling and summation stand between the two: a few ulps of the largest term
        assert np.abs(got - expected).max() <= 2e-5 * np.abs(expected).max(), (rows, np.abs(got - expected).max())


@pytest.mark.parametrize("kind", list(BLOCK_FILE))
@pytest.mark.parametrize("build_name", ["native", "avx512", "avx2", "plain", *EMULATED])
def test_32_weight_kinds_compute_the_file_matrix_times_x_rounded_to_int8(kind, build_name):
    # K = 576: 18 blocks of 32, no whole super-block of 256 (the default model's hidden size)
    kernel = build(build_name)
    w, reference = matrix(kind, rows=40, cols=576, seed=7)  # 40 rows: a panel and a half, its tail padded
    panels = blockdot.pack_int8(w, kernel)
    assert panels.form_name == "blockdot-int8" and panels.planes >> 8 == blockdot.INT8_KINDS[kind]
    assert torch.equal(panels.dequantize(), reference)  # the codes and scales exactly as the file's
    assert torch.equal(panels.dequantize(torch.bfloat16), reference.to(torch.bfloat16))
    ids = torch.tensor([39, 0, 17])
    assert torch.equal(panels.lookup(ids), reference[ids])
    gen = torch.Generator().manual_seed(3)
    for rows in (1, 3, 16, 17, 64):
        x = torch.randn(rows, 576, generator=gen)
        x[0, :32] = 0  # an all-zero block: scale 0
        expected = rounded_x(x) @ reference.double().numpy().T
        got = panels(x).double().numpy()
        assert np.abs(got - expected).max() <= 2e-5 * np.abs(expected).max(), (rows, np.abs(got - expected).max())


@pytest.mark.parametrize("kind", list(BLOCK_FILE))
def test_32_weight_kinds_hold_exactly_the_files_bits(kind):
    w, _ = matrix(kind, rows=64, cols=576, seed=1)
    panels = blockdot.pack_int8(w)
    assert panels.nbytes * 8 / (64 * 576) == BLOCK_FILE[kind]
    assert blockdot.can_pack_int8(matrix(kind, rows=16, cols=32, seed=1)[0])  # one block is enough


@pytest.mark.parametrize("kind", [*FILE_BITS, *BLOCK_FILE])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(kind):
    w, _ = matrix(kind, rows=80, cols=512, seed=11)
    panels = blockdot.pack_int8(w)
    x = torch.randn(21, 512, generator=torch.Generator().manual_seed(5))
    together = panels(x)
    for width in (1, 2, 3, 5, 7, 13):
        apart = torch.cat([panels(x[i:i + width]) for i in range(0, 21, width)])
        assert torch.equal(apart, together), width
    assert torch.equal(panels(x.flip(0)), together.flip(0))  # nor on its place among them


@pytest.mark.parametrize("kind", list(FILE_BITS))
def test_the_panels_hold_the_files_bits(kind):
    w, _ = matrix(kind, rows=64, cols=2048, seed=1)
    panels = blockdot.pack_int8(w)
    bits = panels.nbytes * 8 / (64 * 2048)
    assert bits == FILE_BITS[kind] and bits <= 1.06 * FILE[kind]


def test_bf16_activations_are_widened_first():
    w, _ = matrix("Q4_K", rows=32, cols=256, seed=2)
    panels = blockdot.pack_int8(w)
    x = torch.randn(3, 256).to(torch.bfloat16)
    out = panels(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, panels(x.float()).to(torch.bfloat16))


def test_scales_that_are_no_factor_times_small_integers_are_refused():
    w, _ = matrix("Q4_K", rows=16, cols=256, seed=4)
    odd = w.scales.clone()
    odd[0, 0] = odd[0, 1] * (1 + 2 ** -20)  # two groups whose ratio no pair of 6-bit integers gives
    odd[0, 1] = odd[0, 1] * 63 / 62 * (1 + 2 ** -12)
    with pytest.raises(ValueError, match="not a factor times 6-bit integers"):
        blockdot.pack_int8(BlockQuantized("Q4_K", w.codes, odd, w.mins))
    with pytest.raises(ValueError, match="file-bit panels hold"):
        blockdot.pack_int8(decode_blocks(random_blocks("Q5_K", 16, 256, finite=True), "Q5_K"))



@pytest.mark.parametrize("build_name", ["native", "avx2", "plain"])
@pytest.mark.parametrize("kinds", [("Q4_K", "IQ4_XS"), ("IQ4_XS", "Q4_K")])
def test_rows_of_32_weight_kinds_stacked_keep_their_own_panels(build_name, kinds):
    # an IQ4_XS file's qkv may hold Q4_K rows beside IQ4_XS ones: groups of 32 on both sides, so each
    # run's scales are its own (no halves given to a 16-weight kind)
    kernel = build(build_name)
    (a, a_ref), (b, b_ref) = (matrix(kind, rows, 512, seed=rows) for kind, rows in zip(kinds, (48, 24), strict=True))
    stacked = cat_rows([a, b])
    assert stacked.group == 32 and stacked.row_kinds == ((kinds[0], 48), (kinds[1], 24))
    panels = blockdot.pack_int8(stacked, kernel)
    reference = torch.cat([a_ref, b_ref])
    assert torch.equal(panels.dequantize(), reference)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(2))
    expected = rounded_x(x) @ reference.double().numpy().T
    assert np.abs(panels(x).double().numpy() - expected).max() <= 2e-5 * np.abs(expected).max()


@pytest.mark.parametrize("build_name", ["native", "avx2", "plain"])
@pytest.mark.parametrize("kinds", [("Q5_0", "Q8_0"), ("IQ4_NL", "Q8_0"), ("Q4_0", "Q4_1", "Q5_1"), ("Q8_0", "Q4_K"),
                                   ("Q5_0", "Q6_K")])
def test_rows_of_32_weight_kinds_stacked_with_others_keep_their_own_panels(build_name, kinds):
    # llama.cpp's mixes: q and k in Q5_0 beside v in Q8_0 (a Q4_K_M file's 576-wide qkv), and 32-weight
    # kinds beside K-quants (beside Q6_K's groups of 16, their scales given to both halves, then read back)
    kernel = build(build_name)
    parts = [matrix(kind, rows, 512, seed=rows) for kind, rows in zip(kinds, (48, 32, 24), strict=False)]
    stacked = cat_rows([w for w, _ in parts])
    assert stacked.row_kinds == tuple((kind, w.shape[0]) for kind, (w, _) in zip(kinds, parts, strict=True))
    panels = blockdot.pack_int8(stacked, kernel)
    reference = torch.cat([ref for _, ref in parts])
    assert torch.equal(panels.dequantize(), reference)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(2))
    expected = rounded_x(x) @ reference.double().numpy().T
    assert np.abs(panels(x).double().numpy() - expected).max() <= 2e-5 * np.abs(expected).max()


def test_32_weight_kinds_refuse_what_no_file_holds():
    w, _ = matrix("IQ4_NL", rows=16, cols=64, seed=3)
    codes = w.codes.clone()
    codes[3, 7] = 0  # not one of the 16 values
    with pytest.raises(ValueError, match="IQ4_NL codes are the 16 values"):
        blockdot.pack_int8(BlockQuantized("IQ4_NL", codes, w.scales, None))
    w, _ = matrix("Q8_0", rows=16, cols=64, seed=3)
    with pytest.raises(ValueError, match="fp16 does not hold"):
        blockdot.pack_int8(BlockQuantized("Q8_0", w.codes, w.scales * (1 + 2 ** -20), None))


def test_iq4_xs_codes_off_its_table_are_refused():
    w, _ = matrix("IQ4_XS", rows=16, cols=256, seed=3)
    codes = w.codes.clone()
    codes[3, 7] = 0  # not one of the 16 values
    with pytest.raises(ValueError, match="IQ4_XS codes are the 16 values"):
        blockdot.pack_int8(BlockQuantized("IQ4_XS", codes, w.scales, None))


@pytest.mark.parametrize("build_name", ["native", "plain"])
def test_rows_of_both_kinds_stacked_keep_their_own_panels(build_name):
    # Q4_K_M's qkv: q and k in Q4_K beside v in Q6_K, stacked by cat_rows into int8 codes; each run of
    # rows back in its own kind's panels, behind a head naming the runs
    kernel = build(build_name)
    (q, q_ref), (k, k_ref), (v, v_ref) = (matrix(kind, rows, 512, seed=rows)
                                          for kind, rows in (("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 40)))
    stacked = cat_rows([q, k, v])
    assert stacked.kind == "Q4_K+Q6_K" and stacked.row_kinds == (("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 40))
    panels = blockdot.pack_int8(stacked, kernel)
    reference = torch.cat([q_ref, k_ref, v_ref])
    assert torch.equal(panels.dequantize(), reference)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(9))
    expected = rounded_x(x) @ reference.double().numpy().T
    assert np.abs(panels(x).double().numpy() - expected).max() <= 2e-5 * np.abs(expected).max()
    bits = panels.nbytes * 8 / (reference.numel() + 16 * 512)  # v's 40 rows fill 48 (a panel's padding)
    assert bits < (2 * FILE_BITS["Q4_K"] + FILE_BITS["Q6_K"]) / 3 + 0.1
    # a run of rows that ends inside a panel before another starts has no such form
    odd = cat_rows([matrix("Q4_K", 24, 512, seed=1)[0], v])
    assert not blockdot.can_pack_int8(odd)
    with pytest.raises(ValueError, match="known runs of their rows"):
        blockdot.pack_int8(odd, kernel)


def test_an_embedding_looks_its_rows_up_in_the_panels():
    w, reference = matrix("Q6_K", rows=50, cols=512, seed=12)  # 50 rows: the last panel's tail padded
    panels = blockdot.pack_int8(w)
    ids = torch.tensor([0, 49, 17, 17, 33])
    assert torch.equal(panels.lookup(ids), reference[ids])
    assert torch.equal(panels.lookup(ids, torch.bfloat16), reference[ids].to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 50\)"):
        panels.lookup(torch.tensor([3, 50]))


AMX_SKIP = "no AMX tiles here: a CPU with amx_int8 (Sapphire Rapids or later), Linux's permission and a native build " \
           "are needed, and no emulator runs them"


@pytest.mark.skipif(not blockdot.amx(), reason=AMX_SKIP)
@pytest.mark.parametrize("kind", [*FILE_BITS, "Q4_K+Q6_K", "IQ4_XS+Q6_K"])
def test_amx_tiles_give_the_vector_tiles_bits_at_every_width(kind):
    # the tiles are a way to run the same arithmetic, never another result: each row's outputs equal
    # the vector tiles' bit for bit, whole blocks of 16 rows and the zero-padded last one alike
    if "+" in kind:
        first, second = kind.split("+")
        w = cat_rows([matrix(first, 32, 768, seed=1)[0], matrix(second, 40, 768, seed=2)[0]])
        reference = w.dequantize()
    else:
        w, reference = matrix(kind, rows=40, cols=768, seed=7)
    vector = blockdot.pack_int8(w)
    tiles = blockdot.pack_int8(w, amx_rows=1)  # every block of rows on the tiles, a last short one padded
    from16 = blockdot.pack_int8(w, amx_rows=16)  # whole blocks of 16 on the tiles, the rest on the vector tiles
    gen = torch.Generator().manual_seed(8)
    for rows in (1, 5, 16, 17, 40):
        x = torch.randn(rows, 768, generator=gen)
        x[-1, 32:64] = 0  # an all-zero block: scale 0
        assert torch.equal(tiles(x), vector(x)), rows
        assert torch.equal(tiles(x.bfloat16()), vector(x.bfloat16())), rows
        assert torch.equal(from16(x), vector(x)), rows
    # and the sums are the file's matrix times x rounded, not merely the vector tiles' (independent of both)
    x = torch.randn(17, 768, generator=gen)
    expected = rounded_x(x) @ reference.double().numpy().T
    assert np.abs(tiles(x).double().numpy() - expected).max() <= 2e-5 * np.abs(expected).max()


def test_amx_availability_is_what_the_cpu_and_build_say():
    # the build has tiles only where the compiler targets them (-march=native on a CPU with amx_int8);
    # where it says it has them, the CPU lists amx_int8
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    if blockdot.amx():
        assert "amx_int8" in flags.split()
    assert not blockdot.amx(build("plain"))
    assert not blockdot.amx(build("avx2"))


def test_blockdot_amx_rows_takes_a_row_count_false_or_auto():
    from nanoserve.config import PlanOverrides

    for ok in ("auto", False, 1, 16):
        assert PlanOverrides(blockdot_amx_rows=ok).blockdot_amx_rows == ok
    for bad in (0, -3, True, "16", 2.5):
        with pytest.raises(ValueError, match="blockdot_amx_rows"):
            PlanOverrides(blockdot_amx_rows=bad)


@pytest.mark.parametrize("nthreads", [1, 2, 3])
def test_a_group_of_matrices_in_one_pass_gives_each_matrix_its_own_bits(nthreads):
    # blockdot_group (a mixture of experts' matmuls, each expert its own rows, dealt out to the team in
    # one pass): every matrix's output is what it gives alone, bit for bit, whichever thread ran which panels
    q4k = [matrix("Q4_K", 136, 512, seed=s)[0] for s in (1, 2)]
    mixed = cat_rows([matrix(kind, rows, 512, seed=rows)[0] for kind, rows in (("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 40))])
    q6k = matrix("Q6_K", 136, 512, seed=3)[0]
    panels = [blockdot.pack_int8(w) for w in (*q4k, mixed, q6k, q4k[0])]
    widths = [1, 3, 2, 9, 5]
    xs = [torch.randn(m, 512, generator=torch.Generator().manual_seed(20 + m)) for m in widths]
    ys = [torch.full((m, 136), float("nan")) for m in widths]

    def pointers(tensors):
        return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))

    lib = panels[0].kernel.lib
    done = lib.blockdot_grouped(pointers(xs), (ctypes.c_int64 * 5)(*widths), 512, 136, pointers([p.data for p in panels]),
                                (ctypes.c_int * 5)(*(p.planes for p in panels)), pointers(ys), 5, nthreads)
    assert done == 1
    for p, x, y in zip(panels, xs, ys, strict=True):
        assert torch.equal(y, p(x))
    # a matrix of another form (dense panels' planes are negative) sends the whole group back untouched
    ys = [torch.full((m, 136), float("nan")) for m in widths]
    done = lib.blockdot_grouped(pointers(xs), (ctypes.c_int64 * 5)(*widths), 512, 136, pointers([p.data for p in panels]),
                                (ctypes.c_int * 5)(*(p.planes for p in panels[:4]), -1), pointers(ys), 5, nthreads)
    assert done == 0 and all(y.isnan().all() for y in ys)
