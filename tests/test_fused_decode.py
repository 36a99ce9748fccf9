"""The fused decode (fused_decode.c) against transformers' forward on the same weights.

The reference: a tiny random transformers Llama whose linears are replaced by the engine's own
quantized matrices, dequantized by their stored forms' arithmetic (the dense copies a QuantLinear
keeps for wide steps are exactly that with pack_weights=False); for a dense engine, the weights it
was built from. The engine decodes with its glue in C (narrow steps on blockdot in one call, the
rest with torch's linears between per-layer calls), and every logits row it samples from is compared
with transformers' over the request's tokens. Tolerances from the precision: in float32 the fused step's sums are float32 in
another order, so 1e-4 as every float32 logits test; with a bfloat16 K/V cache (and the prompt's
forward in bfloat16) the error is bf16's, 2^-8 of the values, a few times over through the layers.
These engines keep blockdot's activations in float32 (blockdot_int16_rows=None); the int16 path has a
test of its own, against transformers whose linears do its rounding by hand.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import CharTokenizer, config_of, forms, make_hf_llama, make_hf_model, nanoserve_model_from_hf
from test_blockdot import block_mins, int16_rounded
from test_blockdot import build as build_kernel
from test_llama import assert_logits_match, run_and_capture
from test_precision import fake as fake_probe

from nanoserve import Engine
from nanoserve.model import blockdot, precision
from nanoserve.model.forms import DENSE_BF16, DENSE_F32, can_pack
from nanoserve.model.fused_decode import DENSE_ONE_CALL_ROWS, FusedDecode, why_not
from nanoserve.model.precision import DTYPES
from nanoserve.model.quant import QuantLinear, quantize_int4, quantize_int8

CPU = torch.device("cpu")

needs_build = pytest.mark.skipif(blockdot.library() is None, reason=f"blockdot not built here: {blockdot.failure()}")

# Lengths that cross block boundaries and differ enough that decode_group_min_rows=2 splits them.
PROMPTS = [[5, 9, 13, 22, 7, 41, 3, 8, 60, 33, 21], [17, 4], [30 + i % 50 for i in range(40)], [11, 12, 13, 14, 15]]


def fused_engine(hf, dtype: str = "float32", block_size: int = 4, **overrides) -> Engine:
    config = config_of(**({"dtype": dtype, "quantization": "int4", "kernels": "blockdot", "pack_weights": False,
                              "block_size": block_size, "num_kv_blocks": 256 // block_size + 8, "max_num_seqs": 4,
                              "decode_group_min_rows": 2, "blockdot_int16_rows": None, "dense_kernel": "torch",
                              "kv_cache_dtype": dtype, "fused_decode": True, "batch_invariant": False} | overrides))
    # the cache in the dtype unless a test asks; the plan that runs decode steps alone in C (the
    # batch-invariant one runs every step there: tests/test_batch_invariance.py)
    return Engine(nanoserve_model_from_hf(hf), CharTokenizer(hf.config.vocab_size), config)


def dense(w) -> torch.Tensor:
    """A quantized linear's dense matrix: its copy, or its panels dequantized (what wide steps read)."""
    return w.dequantize()


def load_engine_weights_into(hf, engine: Engine) -> None:
    """hf's linears become the engine's quantized matrices, dequantized."""
    config = engine.model.config
    H, Hkv, D, I = config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size
    with torch.no_grad():
        for ours, theirs in zip(engine.model.layers, hf.model.layers, strict=True):
            q, k, v = dense(ours.qkv).split([H * D, Hkv * D, Hkv * D])
            attn, mlp = theirs.self_attn, theirs.mlp
            if hasattr(attn, "qkv_proj"):  # Phi-3's fused projections, as its checkpoint holds them
                attn.qkv_proj.weight.copy_(dense(ours.qkv).float())
            else:
                for module, weight in ((attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v)):
                    module.weight.copy_(weight.float())
            attn.o_proj.weight.copy_(dense(ours.o).float())
            if ours.moe is not None:  # transformers' experts: [X, 2 Ie, E] and [X, E, Ie]
                load_moe_weights_into(mlp, ours.moe)
                continue
            if hasattr(mlp, "gate_up_proj"):
                pairs = ((mlp.gate_up_proj, dense(ours.gate_up)),)
            else:
                gate, up = dense(ours.gate_up).split([I, I])
                pairs = ((mlp.gate_proj, gate), (mlp.up_proj, up))
            for module, weight in pairs + ((mlp.down_proj, dense(ours.down)),):
                module.weight.copy_(weight.float())
        hf.lm_head.weight.copy_(dense(engine.model.lm_head_weight))


def load_moe_weights_into(mlp, moe) -> None:
    """A transformers sparse MLP's weights become a MoeWeights', dequantized."""
    mlp.gate.weight.copy_(dense(moe.router).float())
    mlp.experts.gate_up_proj.copy_(torch.stack([dense(w).float() for w in moe.gate_up]))
    mlp.experts.down_proj.copy_(torch.stack([dense(w).float() for w in moe.down]))
    if moe.shared_gate_up is not None:
        gate, up = dense(moe.shared_gate_up).float().chunk(2)
        for module, weight in ((mlp.shared_expert.gate_proj, gate), (mlp.shared_expert.up_proj, up),
                               (mlp.shared_expert.down_proj, dense(moe.shared_down)),
                               (mlp.shared_expert_gate, dense(moe.shared_gate))):
            module.weight.copy_(weight.float())


def count_fused_steps(engine: Engine) -> list[int]:
    """Wraps the C drivers in the model's table; the list gets each step they run's row count."""
    rows = []

    def counted(run):
        def step(model, h, inputs, kv):
            rows.append(h.shape[0])
            return run(model, h, inputs, kv)
        return step

    drivers = engine.model.drivers
    for driver in [d for d in drivers if d.in_c]:
        drivers[driver] = counted(drivers[driver])
    return rows


@needs_build
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_fused_decode_logits_equal_transformers_on_the_same_weights(block_size):
    hf = make_hf_llama(seed=11)
    engine = fused_engine(hf, block_size=block_size)
    assert isinstance(engine.model.fused_layers, FusedDecode)
    load_engine_weights_into(hf, engine)
    fused_rows = count_fused_steps(engine)
    captured, outputs = run_and_capture(engine, PROMPTS, max_tokens=12)
    assert assert_logits_match(hf, captured, outputs) == len(PROMPTS) * 12
    assert sum(fused_rows) == len(PROMPTS) * 11 and max(fused_rows) == 4  # every decode token went through C
    engine.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_blocks


@needs_build
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("family, overrides", [("llama", {}), ("mistral", {"sliding_window": 5})], ids=["llama", "window"])
def test_contexts_split_over_the_threads_merge_to_transformers_logits(family, overrides, threads):
    # Under four rows a thread, each row's context is split into a part a thread and the parts merged;
    # from four rows a thread, or on one thread, each row's heads are one task. Nine requests: steps of
    # 9 rows down to 1 (at 2 threads: the rows as tasks from 8 rows, the split below). At 3 threads a
    # 2-key context (a 1-token prompt's first decode) leaves a part with no keys, which must weigh nothing.
    hf = make_hf_model(family, seed=21, **overrides)
    engine = fused_engine(hf, max_num_seqs=9)
    load_engine_weights_into(hf, engine)
    prompts = [[5], [7, 8], PROMPTS[2], [3] * 9, [4, 6, 9], PROMPTS[0], [1] * 17, [2, 3], [9]]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused_rows = count_fused_steps(engine)
        captured, outputs = run_and_capture(engine, prompts, max_tokens=[6, 9, 4, 8, 7, 5, 9, 3, 11])
    finally:
        torch.set_num_threads(before)
    assert assert_logits_match(hf, captured, outputs) == 6 + 9 + 4 + 8 + 7 + 5 + 9 + 3 + 11
    assert 9 in fused_rows and 1 in fused_rows
    engine.check_invariants()


@needs_build
@pytest.mark.parametrize("head_dim", [8, 64])
@pytest.mark.parametrize("invariant", [False, True], ids=["decodes", "prompts-too"])
def test_long_contexts_cut_into_longer_parts_merge_to_transformers_logits(head_dim, invariant):
    # parts grow with the context (fused_decode.c's parts_of): 1100 keys in 16 parts of 68-69, 8300 in
    # 17 of at most 512; a step's scratch laid out for the longest row holds the shorter row's parts.
    # Heads of 64: AVX-512's four-head loops; of 8: the plain ones. The invariant plan runs the prompts'
    # chunks in C too (a row a task, its parts in turn).
    hf = make_hf_model("llama", seed=5, head_dim=head_dim, max_position_embeddings=8448)
    engine = fused_engine(hf, num_kv_blocks=2 * 8448 // 4 + 8, max_model_len=8448, batch_invariant=invariant,
                          dense_kernel="blockdot" if invariant else "torch")
    load_engine_weights_into(hf, engine)
    fused_rows = count_fused_steps(engine)
    prompts = [[3 + (7 * i) % 90 for i in range(8300)], [5 + (3 * i) % 80 for i in range(1100)]]
    captured, outputs = run_and_capture(engine, prompts, max_tokens=[3, 3])
    assert assert_logits_match(hf, captured, outputs) == 6
    assert 2 in fused_rows  # the two rows' decodes in one C step
    engine.check_invariants()


def do_int16_paths_arithmetic(hf, rounding: bool = True) -> None:
    """Each of hf's decoder linears becomes nanoserve's int4 of its weight (what the engine built
    from the same model holds), computing blockdot's int16 path in float64: x rounded to int16 per
    block of 32 (by hand, test_blockdot.int16_rounded) for the d q part, x itself for the m part.
    rounding=False: the float path's arithmetic, x as it is, in float64."""
    for layer in hf.model.layers:
        for module in (*(getattr(layer.self_attn, f"{n}_proj") for n in "qkvo"), layer.mlp.gate_proj,
                       layer.mlp.up_proj, layer.mlp.down_proj):
            stored = quantize_int4(module.weight.detach())
            w, mins = stored.dequantize().double(), block_mins(stored)

            def forward(x, w=w, mins=mins):
                flat = x.reshape(-1, x.shape[-1])
                rounded = int16_rounded(flat) if rounding else flat.double()
                sums = lambda t: t.double().view(t.shape[0], -1, 32).sum(-1)  # noqa: E731
                y = rounded @ w.T + (sums(flat) - sums(rounded)) @ mins.T
                return y.to(x.dtype).view(*x.shape[:-1], -1)

            module.forward = forward
    with torch.no_grad():  # the head: int8 per channel on torch's kernel, exact in float32
        hf.lm_head.weight.copy_(quantize_int8(hf.lm_head.weight).dequantize())


def logits_error(hf, captured, outputs) -> float:
    """The largest difference of a captured logits row from hf's forward over the request's tokens."""
    error = 0.0
    for out in outputs:
        with torch.no_grad():
            ref = hf(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0]
        error = max(error, *((row - ref[n - 1]).abs().max().item() for n, row in captured[out.request_id]))
    return error


@needs_build
def test_the_int16_path_equals_transformers_doing_its_rounding():
    hf = make_hf_llama(seed=19)
    # No dense copies: every step's linears, prefill's too, on blockdot's int16 path (decode in one call).
    engine = fused_engine(hf, blockdot_int16_rows=1, max_kernel_rows=None)
    assert engine.model.fused_layers.shape.int16_rows == 1 and engine.model.layers[0].qkv.passes[0].int16_rows == 1
    one_call_rows = count_one_call_steps(engine)
    do_int16_paths_arithmetic(hf)
    captured, outputs = run_and_capture(engine, PROMPTS, max_tokens=8)
    # float32 as every float32 logits test: where the engine's x and the reference's, a float32
    # rounding apart, straddle a rounding boundary, a code moves by one step, amax / 32767 of its block.
    assert assert_logits_match(hf, captured, outputs) == len(PROMPTS) * 8
    assert sum(one_call_rows) == len(PROMPTS) * 7
    # ... and the rounding is there to see: the int16 path's logits differ from the float path's by
    # ten times the float path's own error (its logits against the same arithmetic in float64).
    # Measured: 6e-6 to 2e-5 apart, the float path 9e-8 to 2e-7 from its reference (AVX2 and AVX-512).
    float_engine, float_hf = fused_engine(make_hf_llama(seed=19), max_kernel_rows=None), make_hf_llama(seed=19)
    do_int16_paths_arithmetic(float_hf, rounding=False)
    float_captured, float_outputs = run_and_capture(float_engine, PROMPTS, max_tokens=8)
    float_error = logits_error(float_hf, float_captured, float_outputs)
    apart = max((a[1] - b[1]).abs().max().item() for out, float_out in zip(outputs, float_outputs, strict=True)
                for a, b in zip(captured[out.request_id], float_captured[float_out.request_id], strict=True))
    assert apart > 10 * float_error, (apart, float_error)
    engine.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_blocks


@needs_build
def test_fused_decode_with_a_bfloat16_cache_stays_within_bf16_precision():
    hf = make_hf_llama(seed=12)
    engine = fused_engine(hf, dtype="bfloat16")
    assert engine.kv.k.dtype == torch.bfloat16 and isinstance(engine.model.fused_layers, FusedDecode)
    load_engine_weights_into(hf, engine)
    fused_rows = count_fused_steps(engine)
    captured, outputs = run_and_capture(engine, PROMPTS, max_tokens=8)
    assert assert_logits_match(hf, captured, outputs, atol=0.03) == len(PROMPTS) * 8
    assert sum(fused_rows) == len(PROMPTS) * 7


@needs_build
@pytest.mark.parametrize("quantization", ["int4", None], ids=["panels", "dense"])
@pytest.mark.parametrize("head_dim", [8, 64])
def test_a_float16_cache_is_read_alike_by_the_fused_decode_and_llama_py(quantization, head_dim):
    # Both round K/V to float16 on the way in (to nearest even: C's _Float16, torch's .to) and widen
    # them on the way out, so the fused decode and llama.py's decoder_layer agree to float32's 1e-4;
    # against transformers' float32, whose K/V are not rounded, both are within float16's rounding
    # (2^-11 of a value) of logits of ~0.5: 5e-4, where they measured 3e-5 (a float32 cache: 1e-7, so
    # the rounding is there to see). The 40-token prompt is prefilled in chunks of 16, so llama.py also
    # reads its earlier chunks back from the cache. Heads of 64: AVX-512's four-head loops read the
    # float16 blocks in place (the contexts' lengths not multiples of their four keys at a time).
    hf = make_hf_llama(seed=12, head_dim=head_dim)
    runs = []
    for fused in (True, False):
        engine = fused_engine(hf, kv_cache_dtype="float16", quantization=quantization, fused_decode=fused,
                              max_num_batched_tokens=16)
        assert engine.kv.k.dtype == torch.float16 and engine.model.dtype == torch.float32
        assert isinstance(engine.model.fused_layers, FusedDecode) == fused
        if quantization:
            load_engine_weights_into(hf, engine)
        fused_rows = count_fused_steps(engine) if fused else []
        runs.append(run_and_capture(engine, PROMPTS, max_tokens=8))
        assert (max(fused_rows, default=0) == 4) == fused  # decode-only steps in C; those beside a chunk in llama.py
        engine.check_invariants()
    (ours, outputs), (theirs, their_outputs) = runs
    assert [o.token_ids for o in outputs] == [o.token_ids for o in their_outputs]
    for out, their_out in zip(outputs, their_outputs, strict=True):
        for (n, row), (m, their_row) in zip(ours[out.request_id], theirs[their_out.request_id], strict=True):
            assert n == m
            torch.testing.assert_close(row, their_row, atol=1e-4, rtol=1e-4)
    assert assert_logits_match(hf, *runs[0], atol=5e-4) == len(PROMPTS) * 8
    assert assert_logits_match(hf, *runs[1], atol=5e-4) == len(PROMPTS) * 8
    assert logits_error(hf, *runs[0]) > 1e-6


def count_one_call_steps(engine: Engine) -> list[int]:
    """Counts the steps fused_decode.c's one-call entry runs (their row counts)."""
    fused, rows = engine.model.fused_layers, []
    lib = fused.kernel.lib

    class Spy:
        def __getattr__(self, name):
            return getattr(lib, name)

        def fused_decode(self, shape, table, num_layers, h, T, *rest):
            rows.append(T)
            return lib.fused_decode(shape, table, num_layers, h, T, *rest)

    fused.kernel = blockdot.Library(Spy(), fused.kernel.simd, fused.kernel.path)
    return rows


@needs_build
def test_steps_wider_than_the_kernel_rows_take_torchs_linears_between_per_layer_calls():
    hf = make_hf_llama(seed=13)
    engine = fused_engine(hf, max_kernel_rows=2)  # four decoding requests: a step for the dense copies
    load_engine_weights_into(hf, engine)
    one_call_rows = count_one_call_steps(engine)
    fused_rows = count_fused_steps(engine)
    captured, outputs = run_and_capture(engine, PROMPTS, max_tokens=6)
    assert assert_logits_match(hf, captured, outputs) == len(PROMPTS) * 6
    assert fused_rows == [4] * 5 and one_call_rows == []
    captured, outputs = run_and_capture(engine, PROMPTS[:2], max_tokens=6)
    assert assert_logits_match(hf, captured, outputs) == 2 * 6
    assert one_call_rows == [2] * 5


@needs_build
@pytest.mark.parametrize("pack_weights", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("dense_kernel", ["torch", "blockdot"])
@pytest.mark.parametrize("dtype, atol", [("float32", 1e-4), ("bfloat16", 0.03)])
def test_a_dense_model_runs_decode_steps_in_one_call_up_to_its_dtypes_rows(dtype, atol, pack_weights, dense_kernel):
    hf = make_hf_llama(seed=15)
    engine = fused_engine(hf, dtype=dtype, quantization=None, pack_weights=pack_weights, dense_kernel=dense_kernel)
    fused = engine.model.fused_layers
    limit = engine.plan.one_call_rows
    layer = engine.model.layers[0]
    assert isinstance(layer.qkv, blockdot.DensePanels) == (dense_kernel == "blockdot")
    # on the dense panels every width runs in one call; on torch's, up to its dtype's rows
    if dense_kernel == "blockdot" or dtype == "float32":
        assert limit == 2**31
    assert engine.plan.decode == "c-one-call"
    assert {planes for forms in fused.forms for _, planes in forms} == {DENSE_BF16 if dtype == "bfloat16" else DENSE_F32}
    # torch's matrices (plain or packed) are read through copies in dense panels, counted in memory(); the
    # model's own panels are read as they are
    assert (fused.copy_bytes > 0) == (dense_kernel == "torch") and engine.memory()["fused_copies"] == fused.copy_bytes
    if dense_kernel == "torch":
        assert forms(engine.model) == {"onednn" if pack_weights and can_pack(DTYPES[dtype]) else "torch"}
        plain = layer.qkv.dequantize(DTYPES[dtype])
        torch.testing.assert_close(fused.forms[0][0][0], blockdot.pack_dense(plain).data, atol=0, rtol=0)
    else:
        assert fused.forms[0][0][0] is layer.qkv.data
    one_call_rows = count_one_call_steps(engine)
    fused_rows = count_fused_steps(engine)
    captured, outputs = run_and_capture(engine, PROMPTS, max_tokens=8)  # four rows a step: per layer in bf16
    assert assert_logits_match(hf, captured, outputs, atol=atol) == len(PROMPTS) * 8
    assert sum(fused_rows) == len(PROMPTS) * 7 and one_call_rows == ([4] * 7 if limit >= 4 else [])
    one_call_rows.clear()
    captured, outputs = run_and_capture(engine, PROMPTS[:2], max_tokens=8)  # two rows: one call
    assert assert_logits_match(hf, captured, outputs, atol=atol) == 2 * 8
    assert one_call_rows == [2] * 7
    engine.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_blocks


@needs_build
@pytest.mark.parametrize("bf16_faster", [True, False], ids=["bf16-native", "bf16-emulated"])
def test_a_bf16_model_takes_the_one_call_at_every_width_where_the_probe_times_bf16_slower(monkeypatch, bf16_faster):
    # The probe faked both ways, so each side runs on every CPU: an AVX2-only one times bf16 slower,
    # and torch's bf16 matmul slower than the dense panels (which widen bf16 to float32 in registers).
    monkeypatch.setattr(precision, "probe_cpu", fake_probe(0.2, 0.05 if bf16_faster else 14.0,
                                                           dense_kernels_ms=(0.5, 1.0) if bf16_faster else (14.0, 0.3)))
    hf = make_hf_llama(seed=15)
    engine = fused_engine(hf, dtype="bfloat16", quantization=None, dense_kernel="auto")
    assert engine.plan.one_call_rows == (DENSE_ONE_CALL_ROWS[torch.bfloat16] if bf16_faster else 2**31)
    # where bf16 is emulated every dense matrix, the head's too, is read from dense panels, not torch's bf16 matmul
    head = engine.model.lm_head_weight
    assert isinstance(head, blockdot.DensePanels) != bf16_faster
    assert isinstance(engine.model.layers[0].down, blockdot.DensePanels) != bf16_faster
    def storage(w):  # the tensor a weight holds its matrix in (dense panels' data, a Dense's weight), or a norm
        return w.data if isinstance(w, blockdot.DensePanels) else getattr(w, "weight", w)

    tensors = [engine.model.embed, storage(head), engine.model.norm] + [
        storage(w) for layer in engine.model.layers
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down, layer.input_norm, layer.post_norm)]
    assert engine.memory()["dense"] == sum({id(t): t.nbytes for t in tensors}.values())  # a tied head's copy counted
    one_call_rows = count_one_call_steps(engine)
    captured, outputs = run_and_capture(engine, PROMPTS, max_tokens=6)  # four rows a step
    assert assert_logits_match(hf, captured, outputs, atol=0.03) == len(PROMPTS) * 6
    assert one_call_rows == ([] if bf16_faster else [4] * 5)


# Each family switch the fused decode runs, at tiny shapes whose matmuls quantize to int4 (K a multiple of 32).
FAMILIES = {
    "qwen2-bias": ("qwen2", {}),
    "qwen2-window-on-layer-0": ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 16}),
    "mistral-window": ("mistral", {"sliding_window": 5}),
    # Phi-3: q/k/v and gate/up fused in the checkpoint; LongRoPE's factors and attention factor (2) in
    # the table the C decode reads. Its short and long factors are the same here, so transformers'
    # switch between them by length changes nothing (rope.py).
    "phi3-longrope": ("phi3", {"pad_token_id": 0, "max_position_embeddings": 256, "original_max_position_embeddings": 4,
                               "rope_scaling": {"type": "longrope", "short_factor": [1.0, 2.0, 5.0, 30.0],
                                                "long_factor": [1.0, 2.0, 5.0, 30.0]}}),
    # Phi-4-mini's rope: on the first 0.75 of each head (12 of 16 dimensions, hidden 64 over 4 heads; 4
    # keep their values), with LongRoPE's factors, one a pair of those 12
    "phi3-partial-longrope": ("phi3", {"pad_token_id": 0, "hidden_size": 64, "head_dim": 16, "partial_rotary_factor": 0.75,
                                       "max_position_embeddings": 256, "original_max_position_embeddings": 4,
                                       "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 5.0, 9.0, 30.0],
                                                        "long_factor": [1.0, 1.5, 2.0, 5.0, 9.0, 30.0]}}),
    # Gemma: the embedding scaled, norms by (1 + w), GELU's tanh form
    "gemma-gelu": ("gemma", {}),
    # Gemma 3 (1B's heads: four query heads of 256 on one K/V head): sandwich norms, per-head q/k norms,
    # a query scale of its own; windowed layer 0 on its own rope base of 100, global layer 1 on 10000
    # slowed 8x (linear)
    "gemma3-sandwich-local-rope": ("gemma3", {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                                              "sliding_window": 6, "sliding_window_pattern": 2,
                                              "query_pre_attn_scalar": 12, "rope_local_base_freq": 100.0,
                                              "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
}


# (EngineConfig overrides, whether its four-row decode steps run in one call)
LAYOUTS = {"one-call": ({"quantization": "int4"}, True), "dense-one-call": ({"quantization": None}, True),
           "per-layer": ({"quantization": "int4", "max_kernel_rows": 2}, False)}


@needs_build
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_switches_equal_transformers(name, layout):
    family, overrides = FAMILIES[name]
    config, in_one_call = LAYOUTS[layout]
    hf = make_hf_model(family, seed=16, **overrides)
    engine = fused_engine(hf, **config)
    assert engine.plan.decode == "c-one-call"
    if config["quantization"]:
        load_engine_weights_into(hf, engine)
    one_call_rows = count_one_call_steps(engine)
    fused_rows = count_fused_steps(engine)
    captured, outputs = run_and_capture(engine, PROMPTS, max_tokens=8)  # 40 tokens: past every window
    assert assert_logits_match(hf, captured, outputs) == len(PROMPTS) * 8
    assert sum(fused_rows) == len(PROMPTS) * 7 and one_call_rows == ([4] * 7 if in_one_call else [])
    engine.check_invariants()


@needs_build
@pytest.mark.parametrize("family, overrides, switches", [
    ("smollm3", {"pad_token_id": 0, "num_hidden_layers": 4}, "['no_rope_layers']"),
])
def test_rope_switches_it_lacks_keep_decoder_layer_and_are_named(family, overrides, switches):
    engine = fused_engine(make_hf_model(family, seed=14, **overrides))
    why = f"the family's {switches} are not in fused_decode.c"
    assert why_not(engine.model.config, CPU) == why and f"no C decode: {why}" in engine.plan.reasons
    assert engine.model.fused_layers is None and engine.plan.decode == "torch"


@needs_build
def test_families_and_layouts_it_cannot_run_are_named():
    gemma = fused_engine(make_hf_model("gemma2", seed=14, sliding_window=6, query_pre_attn_scalar=12,
                                       attn_logit_softcapping=2.0, final_logit_softcapping=3.0, head_dim=16))
    assert gemma.model.fused_layers is None
    why = "the family's ['attn_logit_softcap'] are not in fused_decode.c"
    assert why_not(gemma.model.config, CPU) == why and f"no C decode: {why}" in gemma.plan.reasons
    torch_kernels = fused_engine(make_hf_llama(seed=14), kernels="torch")
    assert torch_kernels.model.fused_layers.forms == [] and torch_kernels.plan.decode == "c-per-layer"
    assert torch_kernels.plan.form_of(0, "qkv").name == "torch-int4"
    off = fused_engine(make_hf_llama(seed=14), fused_decode=False)
    assert off.model.fused_layers is None and isinstance(off.model.layers[0].qkv, QuantLinear)
    half = fused_engine(make_hf_llama(seed=14), dtype="float16", quantization=None)
    assert half.model.fused_layers is None and "no C decode: the model computes in float16" in half.plan.reasons
    with pytest.raises(ValueError, match="fused_decode='yes' must be True, False or 'auto'"):
        config_of(fused_decode="yes")


def test_without_a_build_steps_run_decoder_layer(monkeypatch):
    monkeypatch.setattr(blockdot, "_library", None)
    monkeypatch.setattr(blockdot, "_failure", "OSError: cc not found (faked)")
    hf = make_hf_llama(seed=17)
    engine = fused_engine(hf, quantization=None, kernels="auto")
    assert engine.model.fused_layers is None
    assert why_not(engine.model.config, CPU) == "fused_decode.c could not be built: OSError: cc not found (faked)"
    captured, outputs = run_and_capture(engine, PROMPTS, max_tokens=4)
    assert assert_logits_match(hf, captured, outputs) == len(PROMPTS) * 4


@needs_build
def test_an_engine_over_another_engines_model_builds_its_own_fused_decode_or_none():
    first = fused_engine(make_hf_llama(seed=18), quantization=None)
    assert first.model.fused_layers is not None
    off = Engine(first.model, None, config_of(dtype="float32", quantization=None, fused_decode=False, pack_weights=False,
                                           num_kv_blocks=16))
    assert off.model.fused_layers is None and first.model.fused_layers is not None
    on = Engine(first.model, None, config_of(dtype="float32", quantization=None, pack_weights=False, num_kv_blocks=16,
                                                dense_kernel="torch"))
    assert on.model.fused_layers is not first.model.fused_layers and on.model.layers is first.model.layers


@needs_build
@pytest.mark.parametrize("quantization", ["int4", None], ids=["panels", "dense"])
@pytest.mark.parametrize("kv_cache_dtype, atol", [("auto", 1e-4), ("float16", 5e-4)])
@pytest.mark.parametrize("build", ["avx512", "avx2", "plain", "avx512-simde", "avx512vnni-simde"])
def test_the_other_builds_fused_decode_equals_transformers(build, quantization, kv_cache_dtype, atol):
    # What another CPU (or a compiler without -march=native) would run: the same C built with
    # test_blockdot's flags, both the one-call and the per-layer entries; AVX-512 also under SIMDe.
    kernel = build_kernel(build)
    hf = make_hf_llama(seed=19)
    engine = fused_engine(hf, max_kernel_rows=2, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    if quantization:
        load_engine_weights_into(hf, engine)
    engine.model.fused_layers.kernel = kernel
    captured, outputs = run_and_capture(engine, PROMPTS, max_tokens=6)  # four rows: per layer; then fewer
    assert assert_logits_match(hf, captured, outputs, atol) == len(PROMPTS) * 6
    captured, outputs = run_and_capture(engine, PROMPTS[:2], max_tokens=6)  # two rows: one call
    assert assert_logits_match(hf, captured, outputs, atol) == 2 * 6


@needs_build
def test_an_engine_over_a_quantized_engines_model_keeps_its_head_and_layers_as_they_are():
    # An engine built over another's laid-out model (abbench, peerbench do this) runs its matrices as
    # they are: a dense_kernel of blockdot lays out no dense copy of the int8 head or the int4 layers.
    first = fused_engine(make_hf_llama(seed=19))
    head, qkv = first.model.lm_head_weight, first.model.layers[0].qkv
    assert isinstance(head, QuantLinear) and isinstance(qkv, QuantLinear)
    second = Engine(first.model, None, config_of(dtype="float32", quantization=None, num_kv_blocks=16,
                                                    dense_kernel="blockdot"))
    assert second.model.lm_head_weight is head and second.model.layers[0].qkv is qkv
    assert second.memory()["dense"] == first.memory()["dense"]


# Mixtures of experts fused_decode.c runs: Qwen3-MoE with a dense layer among its sparse ones,
# Mixtral, Qwen2-MoE's shared expert and its gate; 4 experts, top 2, so nine rows share experts.
MOE_FAMILIES = {
    "qwen3-moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "norm_topk_prob": True, "mlp_only_layers": [1], "head_dim": 16}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2-moe": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 64, "norm_topk_prob": False}),
}


@needs_build
@pytest.mark.parametrize("route", ["one-call", "per-layer"])
@pytest.mark.parametrize("name", sorted(MOE_FAMILIES))
def test_a_sparse_layer_in_c_gives_transformers_logits(name, route):
    # Routing, the experts grouped over the step's rows and each row's weighted sum, in the one call
    # and in fused_moe between the per-layer calls (the experts on blockdot's panels at every width).
    from nanoserve.model.driver import Driver
    from nanoserve.model.fused_decode import run_per_layer

    family, overrides = MOE_FAMILIES[name]
    hf = make_hf_model(family, seed=31, initializer_range=0.2, **overrides)
    engine = fused_engine(hf, max_num_seqs=9, max_kernel_rows=None)
    assert engine.plan.drivers == {Driver.C_ONE_CALL, Driver.TORCH}  # decode steps in C, prompts on torch
    fused = engine.model.fused_layers
    assert [table is not None and table.per_layer for table in fused.moe] == [
        layer.moe is not None for layer in engine.model.layers]
    lib, moe_rows = fused.kernel.lib, []

    class Spy:
        def __getattr__(self, name):
            return getattr(lib, name)

        def fused_moe(self, shape, moe, x, out, io_bf16, T, threads):
            moe_rows.append(T)
            return lib.fused_moe(shape, moe, x, out, io_bf16, T, threads)

    fused.kernel = dataclasses.replace(fused.kernel, lib=Spy())
    if route == "per-layer":
        engine.model.drivers[Driver.C_ONE_CALL] = run_per_layer
    load_engine_weights_into(hf, engine)
    fused_rows = count_fused_steps(engine)
    prompts = [[5], [7, 8], PROMPTS[2], [3] * 9, [4, 6, 9], PROMPTS[0], [1] * 17, [2, 3], [9]]
    max_tokens = [6, 9, 4, 8, 7, 5, 9, 3, 11]
    captured, outputs = run_and_capture(engine, prompts, max_tokens=max_tokens)
    assert assert_logits_match(hf, captured, outputs) == sum(max_tokens)
    assert 9 in fused_rows and sum(fused_rows) == sum(max_tokens) - len(prompts)
    sparse = sum(layer.moe is not None for layer in engine.model.layers)
    assert moe_rows == ([rows for rows in fused_rows for _ in range(sparse)] if route == "per-layer" else [])
    engine.check_invariants()
