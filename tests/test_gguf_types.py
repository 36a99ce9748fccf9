"""Every GGUF block type nanoserve reads, held to gguf-py (an independent implementation of llama.cpp's
formats): its type id and block size, and its dequantized values bit for bit, from random blocks; the
kernels that run each kind against its dequantized matrix; the plan's choice for each kind; Llama 3.x's
rope_freqs.weight against transformers' Llama 3 rope; every unread type named in one error."""

from __future__ import annotations

import dataclasses
import warnings

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import config_of, make_hf_llama, nanoserve_model_from_hf
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES
from test_precision import fake

from nanoserve.model import blockdot
from nanoserve.model.config import LlamaConfig
from nanoserve.model.ggml_blocks import BLOCK_TYPES
from nanoserve.model.gguf import (
    BlockQuantized,
    FileBlocks,
    FileRows,
    config_from_gguf,
    decode_blocks,
    load_gguf,
    read_gguf_file,
)
from nanoserve.model.llama import MATMULS
from nanoserve.model.plan import check_laid_out, resolve_plan
from nanoserve.model.prepare import prepare_model
from nanoserve.model.quant import cat_rows, kernel_passes, torch_runs
from nanoserve.model.rope import inverse_frequencies

# The types llama.cpp's quantize writes for the families nanoserve runs (the issue's list).
READ = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")


FP16_AT = {"Q2_K": (80, 82), "Q3_K": (108,), "Q6_K": (208,)}  # the kinds whose fp16 d is not first


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0, finite: bool = False) -> np.ndarray:
    """rows of random stored bytes [rows, cols / weights * bytes]. finite: each block's fp16 scales
    (d, and the min or dmin where the kind has one, at the offsets ggml-common.h's block structs give)
    set to finite values between 2^-12 and 2^-6, so that products stay finite and exact."""
    weights, nbytes = GGML_QUANT_SIZES[QT[kind]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // weights, nbytes), dtype=np.uint8)
    if finite:
        offsets = FP16_AT.get(kind, (0, 2) if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else (0,))
        for at in offsets:
            values = (rng.uniform(1, 2, raw.shape[0]) * 2.0 ** rng.integers(-12, -6, raw.shape[0])).astype(np.float16)
            raw[:, at:at + 2] = values.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def test_the_types_read_are_the_issues_list_with_gguf_pys_ids_and_sizes():
    assert tuple(BLOCK_TYPES) == READ
    for name, t in BLOCK_TYPES.items():
        assert (t.type_id, (t.weights, t.nbytes)) == (QT[name].value, GGML_QUANT_SIZES[QT[name]]), name


@pytest.mark.parametrize("kind", READ)
def test_every_type_dequantizes_as_gguf_py_bit_for_bit(kind):
    raw = random_blocks(kind, rows=6, cols=512, seed=len(kind))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # random fp16 scales include inf and NaN, in both
        reference = gguf.quants.dequantize(raw, QT[kind])
        ours = decode_blocks(raw, kind).dequantize().numpy()
    np.testing.assert_array_equal(ours, reference)  # NaN where gguf-py's is NaN, every other value equal
    assert np.isfinite(reference).mean() > 0.5


@pytest.mark.parametrize("kind", [k for k in READ if BLOCK_TYPES[k].group == 32])
def test_torchs_kernel_passes_compute_the_dequantized_matmul(kind):
    w = decode_blocks(random_blocks(kind, rows=48, cols=512, seed=3, finite=True), kind)
    x = torch.randn(3, 512)
    expected = F.linear(x.double(), w.dequantize().double()).float()
    out = sum(p(x) for p in kernel_passes(w, torch.float32))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "Q6_K"])
def test_kinds_scaled_by_sixteen_are_refused_by_torchs_kernels_by_name(kind):
    w = decode_blocks(random_blocks(kind, rows=16, cols=256, finite=False), kind)
    assert not torch_runs(kind)
    with pytest.raises(ValueError, match=f"groups of 32 weights; {kind} scales groups of 16"):
        kernel_passes(w, torch.float32)


@pytest.mark.skipif(blockdot.library() is None, reason="no C compiler builds blockdot here")
@pytest.mark.parametrize("kind, planes", [("Q5_0", 2), ("Q5_1", 2), ("IQ4_NL", 2), ("Q4_K", 1 | blockdot.F32_HEADS),
                                          ("Q5_K", 2 | blockdot.F32_HEADS), ("IQ4_XS", 2 | blockdot.F32_HEADS),
                                          ("Q6_K", 2 | blockdot.F32_HEADS | blockdot.G16),
                                          ("Q3_K", 2 | blockdot.F32_HEADS | blockdot.G16)])
@pytest.mark.parametrize("int16_rows", [None, 1])
def test_blockdot_runs_each_kind_on_its_panels_exactly(kind, planes, int16_rows):
    w = decode_blocks(random_blocks(kind, rows=40, cols=512, seed=5, finite=True), kind)
    panels = blockdot.pack(w, int16_rows=int16_rows)
    assert panels.planes == planes and torch.equal(panels.dequantize(), w.dequantize())  # codes and scales as stored
    for rows in (1, 2, 5, 9):
        x = torch.randn(rows, 512)
        expected = F.linear(x.double(), w.dequantize().double()).float()
        tolerance = 1e-4 if int16_rows is None else 1e-3  # the int16 path rounds x per block
        torch.testing.assert_close(panels(x), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def _model_with(kinds: dict[str, str]):
    """A tiny Llama (hidden 256) whose layer matrices are stored as the GGUF kinds given by name."""
    model = nanoserve_model_from_hf(make_hf_llama(seed=31, hidden_size=256, intermediate_size=512,
                                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64))
    for layer in model.layers:
        for name, kind in kinds.items():
            N, K = getattr(layer, name).shape
            setattr(layer, name, decode_blocks(random_blocks(kind, N, K, finite=True), kind))
    return model


def test_the_plan_runs_each_kind_on_a_kernel_or_says_it_dequantized_it():
    model = _model_with({"qkv": "Q5_0", "o": "Q6_K", "gate_up": "Q4_K", "down": "Q2_K"})
    # figures under which the checkpoint's blocks are kept, on either kernel
    probe = fake(0.2, 14.0, int4_ms=0.05, blockdot_ms=0.01, dense_ms=1.0)

    def figures(kernel_dtype=None):
        return dataclasses.replace(probe(kernel_dtype), int4_stream_ms=0.05, blockdot_stream_ms=0.01)

    dense = ("torch", "onednn", "dense-panels")
    on_torch = resolve_plan(config_of(kernels="torch"), model, probe=figures)
    assert on_torch.quantization == "keep"
    assert [on_torch.form_of(0, n).name for n in ("qkv", "gate_up")] == ["torch-int4"] * 2
    assert on_torch.form_of(0, "o").name in dense and on_torch.form_of(0, "down").name in dense
    assert "Q2_K, Q6_K dequantized at load to float32: no torch kernel here runs them" in on_torch.reasons
    if blockdot.library() is not None:  # blockdot runs every kind
        plan = resolve_plan(config_of(kernels="blockdot"), model, probe=figures)
        # Q5_0, Q6_K and Q4_K at their file's bits on int8 activations, Q2_K on blockdot's panels
        file_bits = {"qkv": "blockdot-int8", "o": "blockdot-int8", "gate_up": "blockdot-int8", "down": "blockdot"}
        assert {n: plan.form_of(0, n).name for n in MATMULS} == file_bits
        assert not any("dequantized at load" in reason for reason in plan.reasons), plan.reasons
        laid = prepare_model(model, plan)
        assert check_laid_out(laid, plan) == []


# --- the file -------------------------------------------------------------------------------------

def _write(path, tensors: dict[str, tuple[np.ndarray, QT]], head_dim: int = 16, extra=None) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in [(writer.add_block_count, 1), (writer.add_context_length, 64), (writer.add_embedding_length, 256),
                       (writer.add_feed_forward_length, 256), (writer.add_head_count, 256 // head_dim),
                       (writer.add_head_count_kv, 256 // head_dim), (writer.add_layer_norm_rms_eps, 1e-5),
                       (writer.add_rope_freq_base, 500000.0), (writer.add_token_list, [f"t{i}" for i in range(32)])]:
        add(value)
    for name, (raw, qtype) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_every_unread_type_is_named_in_one_error_before_anything_loads(tmp_path):
    def raw(qtype, rows=8, cols=256):
        weights, nbytes = GGML_QUANT_SIZES[qtype]
        return np.zeros((rows, cols // weights * nbytes), dtype=np.uint8), qtype

    _write(tmp_path / "m.gguf", {"token_embd.weight": raw(QT.Q4_K, 32), "blk.0.ffn_up.weight": raw(QT.IQ2_XXS),
                                 "blk.0.ffn_down.weight": raw(QT.IQ2_XXS), "blk.0.attn_q.weight": raw(QT.TQ1_0),
                                 "blk.0.attn_k.weight": raw(QT.Q6_K)})
    with pytest.raises(ValueError) as info:
        load_gguf(tmp_path / "m.gguf")
    message = str(info.value)
    assert "IQ2_XXS (2 tensors, 'blk.0.ffn_up.weight' first); TQ1_0 (1 tensor, 'blk.0.attn_q.weight' first)" in message
    assert "Q6_K (" not in message and "Q4_K (" not in message  # read, so not named as unread
    assert all(t in message for t in READ)


def test_llama3_rope_freqs_tensor_gives_transformers_llama3_rope(tmp_path):
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    D = 64
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    hf_config = HFLlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=D, rope_parameters=scaling,
                              max_position_embeddings=1024)
    llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    # What a Llama 3.x file stores: each frequency's divisor, in float32 (test_llamacpp_files checks
    # the converter's own); here from transformers' scaled frequencies.
    factors = (plain / llama3.double()).float().numpy()
    assert (factors > 1).any() and (factors == 1).any()
    _write(tmp_path / "m.gguf", {"rope_freqs.weight": (factors, None)}, head_dim=D)
    parsed = read_gguf_file(tmp_path / "m.gguf")
    config = config_from_gguf(parsed)
    assert config.rope_freq_factors == tuple(float(f) for f in factors)
    torch.testing.assert_close(inverse_frequencies(config).float(), llama3.float(), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="rope_freq_factors has 3 entries; head_dim=64 rotates 32 frequencies"):
        LlamaConfig(vocab_size=8, hidden_size=256, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=4,
                    head_dim=64, rope_freq_factors=(1.0, 2.0, 3.0))


def test_a_block_type_of_groups_of_sixteen_keeps_its_shape():
    w = decode_blocks(random_blocks("Q6_K", rows=3, cols=512, finite=False), "Q6_K")
    assert w.group == 16 and w.scales.shape == (3, 32) and w.codes.dtype == torch.int8 and w.mins is None
    assert isinstance(w.rows(torch.tensor([2, 0])), BlockQuantized)
    with pytest.raises(ValueError, match=r"Q6_K codes \[3, 40\] need K a multiple of 16"):
        BlockQuantized("Q6_K", torch.zeros(3, 40, dtype=torch.int8), torch.zeros(3, 2), None)


def test_rows_still_in_the_file_answer_as_the_matrix_they_decode_to():
    # what the plan reads of a loaded matrix without decoding it (kind, row_kinds, shape) is what its
    # decode has; the decode is each piece's rows unpacked and stacked, as decoded matrices stack
    raws = {kind: random_blocks(kind, rows, 256, seed=rows, finite=True)
            for kind, rows in (("Q4_K", 32), ("Q6_K", 16), ("Q8_0", 48))}
    pieces = {kind: FileBlocks((FileRows(kind, raw, None),)) for kind, raw in raws.items()}
    decoded = {kind: decode_blocks(raw, kind) for kind, raw in raws.items()}
    for kinds in (["Q4_K"], ["Q4_K", "Q4_K"], ["Q4_K", "Q6_K"], ["Q8_0", "Q4_K", "Q6_K"]):
        stacked = cat_rows([pieces[k] for k in kinds])
        assert isinstance(stacked, FileBlocks)
        expected = cat_rows([decoded[k] for k in kinds])
        got = stacked.decode()
        assert (stacked.kind, stacked.row_kinds, stacked.shape) == (expected.kind, expected.row_kinds, expected.shape)
        assert (got.kind, got.row_kinds) == (expected.kind, expected.row_kinds)
        assert all(torch.equal(a, b) for a, b in zip((got.codes, got.scales), (expected.codes, expected.scales),
                                                         strict=True))
        assert torch.equal(stacked.dequantize(), expected.dequantize()), kinds
        assert stacked.form == expected.form and blockdot.can_pack_int8(stacked) == blockdot.can_pack_int8(expected)
    q8 = pieces["Q8_0"]
    index = torch.tensor([5, 0, 47, 5])
    assert torch.equal(q8.rows(index).dequantize(), decoded["Q8_0"].dequantize()[index])
    assert torch.equal(q8.rows(index).rows(torch.tensor([1, 3])).dequantize(), decoded["Q8_0"].dequantize()[[0, 5]])
    assert torch.equal(q8.row_range(16, 32).dequantize(), decoded["Q8_0"].dequantize()[16:32])
    assert torch.equal(q8.rows(index).in_memory().dequantize(), decoded["Q8_0"].dequantize()[index])
    assert q8.rows(index).nbytes_by_kind() == {"stored": 4 * raws["Q8_0"].shape[1]}


def test_rows_of_several_kinds_stack_into_one_matrix_exactly():
    # a llama.cpp mix: q and k in one type, v in another
    q, k, v = (decode_blocks(random_blocks(kind, rows, 256, seed=rows, finite=True), kind)
               for kind, rows in (("Q5_0", 32), ("Q4_0", 16), ("Q8_0", 16)))
    qkv = cat_rows([q, k, v])
    assert qkv.kind == "Q4_0+Q5_0+Q8_0" and qkv.codes.dtype == torch.int8 and qkv.mins is None
    assert torch.equal(qkv.dequantize(), torch.cat([q.dequantize(), k.dequantize(), v.dequantize()]))
    with_mins = cat_rows([decode_blocks(random_blocks("Q4_K", 16, 256, finite=True), "Q4_K"), q])
    assert with_mins.kind == "Q4_K+Q5_0" and with_mins.mins is not None
    # groups of 16 beside groups of 32: groups of 16, a 32-weight group's scale (and min) for both halves
    q6 = decode_blocks(random_blocks("Q6_K", 16, 256, finite=True), "Q6_K")
    q4k = decode_blocks(random_blocks("Q4_K", 32, 256, seed=3, finite=True), "Q4_K")
    sixteens = cat_rows([q, q6])
    assert (sixteens.kind, sixteens.group, sixteens.mins) == ("Q5_0+Q6_K", 16, None)
    assert torch.equal(sixteens.dequantize(), torch.cat([q.dequantize(), q6.dequantize()]))
    sixteens_with_mins = cat_rows([q4k, q6])  # a Q4_K_M file's q and k beside its Q6_K v
    assert (sixteens_with_mins.kind, sixteens_with_mins.group) == ("Q4_K+Q6_K", 16)
    assert torch.equal(sixteens_with_mins.dequantize(), torch.cat([q4k.dequantize(), q6.dequantize()]))
    if blockdot.library() is not None:
        for stacked in (qkv, with_mins, sixteens, sixteens_with_mins):
            panels = blockdot.pack(stacked)
            assert torch.equal(panels.dequantize(), stacked.dequantize())
            x = torch.randn(3, 256)
            expected = F.linear(x.double(), stacked.dequantize().double()).float()
            torch.testing.assert_close(panels(x), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())

