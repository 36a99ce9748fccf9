"""Model families as switches of the one forward, each against transformers' own model class on a tiny
random config: logits at prefill and every decode within 1e-4 (float32), greedy tokens equal to
transformers' generate, at 1 and 4 slots, with a KV pool small enough to preempt and a token budget
small enough to chunk every long prompt; sliding windows with prompts longer than the window; each
switch shown to matter; LongRoPE's tables and tokens where transformers' choice of factors is nanoserve's; the windowed block tables and masks worked out by hand; the README's list."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from conftest import TINY, CharTokenizer, make_hf_model, nanoserve_model_from_hf
from test_llama import assert_logits_match, run_and_capture

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.inputs import build_inputs
from nanoserve.model.config import REFUSED_ARCHITECTURES, SUPPORTED_ARCHITECTURES, LlamaConfig
from nanoserve.model.llama import LlamaModel, embedding_scale
from nanoserve.request import Request
from nanoserve.scheduler import ScheduledRequest, SchedulerOutput

# name -> (transformers family, TINY overrides). Windows of 5 and 6 tokens against prompts of up to
# 40; Gemma 2's caps small enough to bind on weights initialised 10x wider than transformers' 0.02.
FAMILIES = {
    "llama-bias": ("llama", {"attention_bias": True}),  # q, k, v and o biases
    "mistral-window": ("mistral", {"sliding_window": 5}),
    "qwen2": ("qwen2", {}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "qwen3": ("qwen3", {"head_dim": 12}),  # hidden / heads would be 8
    "gemma": ("gemma", {"initializer_range": 0.2}),
    "gemma2": ("gemma2", {"sliding_window": 6, "query_pre_attn_scalar": 12, "attn_logit_softcapping": 2.0,
                          "final_logit_softcapping": 3.0, "initializer_range": 0.2}),
    # local (windowed) layer 0 on its own base of 100, global layer 1 on 10000 slowed 8x (linear)
    "gemma3": ("gemma3", {"sliding_window": 6, "sliding_window_pattern": 2, "query_pre_attn_scalar": 12,
                          "rope_theta": 10000.0, "rope_local_base_freq": 100.0, "initializer_range": 0.2,
                          "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    "phi3": ("phi3", {"partial_rotary_factor": 0.5, "sliding_window": 6, "pad_token_id": 0}),  # rope on 4 of D = 8
    "smollm3": ("smollm3", {"num_hidden_layers": 4, "no_rope_layer_interval": 2, "tie_word_embeddings": True,
                            "pad_token_id": 0, "initializer_range": 0.2}),  # layers 1 and 3 without rope
    # Mixtures of experts: 4-8 experts, top 2 or 3; weights 10x wider than transformers' init, so the
    # routers' choices are not near-ties. Qwen3-MoE's layer 1 and Qwen2-MoE's layer 0 are dense.
    # Widths multiples of 32, so test_plan quantizes every matrix to int4.
    "qwen3-moe": ("qwen3_moe", {"num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1],
                                "head_dim": 16, "initializer_range": 0.2}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                            "sliding_window": 5, "initializer_range": 0.2}),
    "qwen2-moe": ("qwen2_moe", {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 64, "decoder_sparse_step": 2,
                                "initializer_range": 0.2}),
    "olmoe": ("olmoe", {"num_experts": 8, "num_experts_per_tok": 3, "intermediate_size": 32, "eos_token_id": 2,
                        "pad_token_id": 0, "initializer_range": 0.2}),
}
PROMPTS = [[5, 9, 13, 22, 7, 41, 3, 8, 60, 33, 21], [17, 4], [30 + i % 50 for i in range(40)], [11, 12, 13, 14, 15]]
MAX_TOKENS = 12


def hf_and_model(name: str):
    family, overrides = FAMILIES[name]
    hf = make_hf_model(family, seed=1, **overrides)
    return hf, nanoserve_model_from_hf(hf)


def hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' own greedy generation, with its own KV cache (and its own window), running past
    EOS as the engine's ignore_eos does (min_new_tokens would mask EOS out of the argmax instead)."""
    hf.generation_config.eos_token_id = None
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_logits_and_greedy_tokens_equal_transformers(name, max_num_seqs):
    hf, model = hf_and_model(name)
    assert_serves_as_transformers(hf, model, PROMPTS, max_num_seqs)


def assert_serves_as_transformers(hf, model, prompts, max_num_seqs: int) -> None:
    """Logits at prefill and every decode within 1e-4 of transformers' forward, greedy tokens equal to
    its generate: 16 blocks of 4 hold 64 tokens (a 40-token prompt alone reaches 52: four slots must
    preempt), a budget of 7 tokens a step splits every prompt longer than 7 into chunks."""
    config = EngineConfig(dtype="float32", quantization=None, block_size=4, num_kv_blocks=16,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=7)
    engine = Engine(model, CharTokenizer(hf.config.vocab_size), config)
    captured, outputs = run_and_capture(engine, prompts, MAX_TOKENS)
    assert assert_logits_match(hf, captured, outputs) == len(prompts) * MAX_TOKENS
    assert [out.token_ids for out in outputs] == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    if max_num_seqs > 1:
        assert sum(out.num_preemptions for out in outputs) > 0
    engine.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.parametrize("name, switch, off", [
    ("llama-bias", "o_bias", False),
    ("mistral-window", "sliding_window", None),
    ("qwen2", "qkv_bias", False),
    ("qwen2-window", "sliding_window", None),
    ("qwen3", "qk_norm", False),
    ("gemma", "embed_scale", False),
    ("gemma", "hidden_act", "silu"),
    ("gemma", "norm_offset", False),
    ("gemma2", "sandwich_norms", False),
    ("gemma2", "query_pre_attn_scalar", None),
    ("gemma2", "attn_logit_softcap", None),
    ("gemma2", "final_logit_softcap", None),
    ("gemma2", "sliding_window", None),
    ("gemma3", "rope_local_theta", None),
    ("gemma3", "qk_norm", False),
    ("gemma3", "sandwich_norms", False),
    ("gemma3", "query_pre_attn_scalar", None),
    ("gemma3", "sliding_window", None),
    ("phi3", "partial_rotary_factor", 1.0),
    ("phi3", "sliding_window", None),
    ("smollm3", "no_rope_layers", ()),
    ("qwen3-moe", "norm_topk_prob", False),
    ("qwen3-moe", "num_experts_per_tok", 1),
    ("mixtral", "norm_topk_prob", False),
    ("mixtral", "sliding_window", None),
    ("qwen2-moe", "shared_expert_intermediate_size", None),
    ("qwen2-moe", "qkv_bias", False),
    ("olmoe", "qk_norm_whole", False),
])
def test_each_switch_matters(name, switch, off):
    # The same weights with one switch off no longer give transformers' logits: the tiny configs
    # and prompts reach every switch (the windows included: the long prompt runs past them).
    hf, model = hf_and_model(name)
    changes = {switch: off} | ({"sliding_layers": ()} if switch == "sliding_window" else {})
    config = dataclasses.replace(model.config, **changes)
    broken = LlamaModel.from_state_dict(config, dict(hf.state_dict()), torch.float32, "cpu")
    engine = Engine(broken, None, EngineConfig(dtype="float32", quantization=None, block_size=4, num_kv_blocks=80))
    captured, outputs = run_and_capture(engine, [PROMPTS[2]], 2)
    with pytest.raises(AssertionError):
        assert_logits_match(hf, captured, outputs, atol=1e-3)


def test_gemma_norms_scale_by_one_plus_w():
    hf, model = hf_and_model("gemma")
    w = hf.state_dict()["model.layers.0.input_layernorm.weight"]
    assert torch.equal(model.layers[0].input_norm, 1.0 + w) and torch.equal(model.norm, 1.0 + hf.state_dict()["model.norm.weight"])


def test_gemma2_sandwich_norms_are_read_by_name():
    hf, model = hf_and_model("gemma2")
    sd, layer = hf.state_dict(), model.layers[1]
    p = "model.layers.1."
    assert torch.equal(layer.attn_out_norm, 1.0 + sd[p + "post_attention_layernorm.weight"])
    assert torch.equal(layer.post_norm, 1.0 + sd[p + "pre_feedforward_layernorm.weight"])
    assert torch.equal(layer.mlp_out_norm, 1.0 + sd[p + "post_feedforward_layernorm.weight"])
    assert model.config.sliding_layers == (0,) and model.config.sliding_window == 6  # local, global


def test_gemma3_reads_its_two_rope_tables_and_qk_norms():
    hf, model = hf_and_model("gemma3")
    config, sd = model.config, hf.state_dict()
    assert (config.sliding_layers, config.rope_local_theta, config.rope_theta) == ((0,), 100.0, 10000.0)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert (config.attn_logit_softcap, config.final_logit_softcap, config.query_pre_attn_scalar) == (None, None, 12)
    assert torch.equal(model.layers[1].q_norm, 1.0 + sd["model.layers.1.self_attn.q_norm.weight"])
    # transformers' own tables: position p's angle p / base ** (2 i / D), the global one slowed 8x
    positions = torch.arange(20)[None]
    for layer_type, (cos, sin) in (("sliding_attention", model.local_rope), ("full_attention", (model.cos, model.sin))):
        want_cos, want_sin = hf.model.rotary_emb(torch.zeros(1), positions, layer_type)
        torch.testing.assert_close(cos[:20], want_cos[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(sin[:20], want_sin[0], atol=1e-6, rtol=0)


def test_phi3_fused_projections_are_used_as_they_are():
    hf, model = hf_and_model("phi3")
    sd = hf.state_dict()
    assert torch.equal(model.layers[1].qkv.weight, sd["model.layers.1.self_attn.qkv_proj.weight"])
    assert torch.equal(model.layers[1].gate_up.weight, sd["model.layers.1.mlp.gate_up_proj.weight"])
    assert model.config.rotary_dim == 4 and model.cos.shape[1] == 4 and model.config.sliding_layers == (0, 1)


@pytest.mark.parametrize("layout", ["saved", "model.language_model"])
def test_gemma3_multimodal_checkpoint_is_served_as_its_language_model(tmp_path, layout):
    # A tiny Gemma3ForConditionalGeneration, saved by transformers (language_model.model.*, its vision
    # tower beside it) or renamed to transformers 5's in-memory layout: nanoserve reads the text model
    # and leaves the vision tower unread; its tokens are transformers' own model's on text alone.
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from nanoserve.model.weights import load_model

    _, text = FAMILIES["gemma3"]
    torch.manual_seed(3)
    hf = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=TINY | text | {"pad_token_id": 0}, mm_tokens_per_image=4, image_token_index=90,
        boi_token_index=91, eoi_token_index=92,
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 28, "patch_size": 14})).eval()
    hf.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert any(name.startswith("vision_tower.") for name in stored)
    if layout != "saved":
        save_file({name.replace("language_model.model.", "model.language_model."): t for name, t in stored.items()},
                  tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(tmp_path, torch.float32, "cpu")
    assert (model.config.architecture, model.config.language_model_of) == ("Gemma3ForCausalLM",
                                                                           "Gemma3ForConditionalGeneration")
    assert model.config.sliding_layers == (0,) and model.config.rope_local_theta == 100.0
    engine = Engine(model, None, EngineConfig(dtype="float32", quantization=None, block_size=4, num_kv_blocks=40))
    outputs = engine.generate(PROMPTS[:3], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert [out.token_ids for out in outputs] == [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS[:3]]


# ---- LongRoPE (rope.py's docstring: which factors nanoserve takes, and where transformers agrees) ---------

# A tiny original context of 4 (past which transformers takes the long factors) in a model of 256
# positions: the attention factor sqrt(1 + ln(256 / 4) / ln 4) = 2. D = 8, full rotary: 4 frequencies.
LONGROPE = {"pad_token_id": 0, "max_position_embeddings": 256, "original_max_position_embeddings": 4,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0],
                             "long_factor": [1.5, 3.0, 7.0, 20.0]}}
LONG_PROMPTS = [PROMPTS[0], [17, 4, 9, 30, 2, 8], PROMPTS[2], PROMPTS[3]]  # each past the original 4 tokens


def test_longrope_tables_equal_transformers_short_within_the_original_context_and_long_past_it():
    hf = make_hf_model("phi3", seed=1, **LONGROPE)
    config = LlamaConfig.from_hf_dict(hf.config.to_dict())
    assert config.rope_scaling["attention_factor"] == pytest.approx(2.0)
    for served in (4, 64):  # served within the original context: the short factors; past it: the long ones
        model = nanoserve_model_from_hf(hf, max_positions=served)
        # transformers picks its factors by the positions of the call: 0 .. served - 1
        want_cos, want_sin = hf.model.rotary_emb(torch.zeros(1), torch.arange(served)[None])
        torch.testing.assert_close(model.cos, want_cos[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(model.sin, want_sin[0], atol=1e-5, rtol=0)
    short = nanoserve_model_from_hf(hf, max_positions=4).cos
    assert not torch.allclose(short, nanoserve_model_from_hf(hf, max_positions=64).cos[:4], atol=1e-3)


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_longrope_past_the_original_context_equals_transformers(max_num_seqs):
    # Every prompt is past the original context, so transformers runs each sequence on the long
    # factors from its prefill on, as nanoserve does on a model served past it.
    hf = make_hf_model("phi3", seed=1, **LONGROPE)
    model = nanoserve_model_from_hf(hf)
    assert_serves_as_transformers(hf, model, LONG_PROMPTS, max_num_seqs)
    # the long factors and the attention factor each matter
    for scaling in ({"long_factor": LONGROPE["rope_scaling"]["short_factor"]}, {"attention_factor": 1.0}):
        changed = dataclasses.replace(model.config, rope_scaling=model.config.rope_scaling | scaling)
        broken = LlamaModel.from_state_dict(changed, dict(hf.state_dict()), torch.float32, "cpu")
        engine = Engine(broken, None, EngineConfig(dtype="float32", quantization=None, block_size=4, num_kv_blocks=80))
        captured, outputs = run_and_capture(engine, [PROMPTS[2]], 2)
        with pytest.raises(AssertionError):
            assert_logits_match(hf, captured, outputs, atol=1e-3)


def test_the_embedding_scale_is_rounded_to_the_dtype_as_gemma_was_trained():
    config = LlamaConfig(vocab_size=8, hidden_size=3072, intermediate_size=8, num_layers=1, num_heads=1,
                         num_kv_heads=1, head_dim=8, architecture="GemmaForCausalLM", embed_scale=True)
    assert embedding_scale(config, torch.bfloat16) == 55.5  # sqrt(3072) = 55.4256...
    assert embedding_scale(config, torch.float32) == pytest.approx(55.4256258, abs=1e-6)
    assert embedding_scale(dataclasses.replace(config, embed_scale=False), torch.float32) is None


@pytest.mark.parametrize("name", ["mistral-window", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3"])
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_bfloat16_layouts_of_every_family_stay_near_transformers(name, quantization):
    # bf16 matmuls (and int8 weights) against transformers in float32: measured worst relative
    # error 0.016 (bf16) and 0.037 (int8, Gemma 2), cosine >= 0.9994; bounds 0.08 and 0.999.
    hf, model = hf_and_model(name)
    engine = Engine(model, None, EngineConfig(dtype="bfloat16", quantization=quantization, block_size=4, num_kv_blocks=80))
    assert engine.model.dtype == torch.bfloat16
    captured, outputs = run_and_capture(engine, [PROMPTS[0], PROMPTS[2]], 6)
    for out in outputs:
        with torch.no_grad():
            ref = hf(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0]  # [N, V]
        for num_tokens, row in captured[out.request_id]:
            expected = ref[num_tokens - 1]
            assert (row - expected).abs().max() / expected.abs().max() < 0.08
            assert torch.cosine_similarity(row, expected, dim=0) > 0.999


def test_inputs_built_without_the_window_are_refused():
    _, model = hf_and_model("mistral-window")
    engine = Engine(model, None, EngineConfig(dtype="float32", quantization=None, block_size=4, num_kv_blocks=16))
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=1))
    sched = engine.scheduler.schedule()
    inputs = build_inputs(sched, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"layers \[0, 1\] attend within a sliding window of 5 tokens, but the "
                                         r"inputs were built with sliding_window=None"):
        model(inputs, engine.kv)


# ---- the windowed metadata, by hand -------------------------------------------------------------------

def request(token_ids: list[int], num_computed: int, blocks: list[int]) -> Request:
    r = Request(f"r{len(token_ids)}", token_ids, SamplingParams(), frozenset(), arrival_time=0.0)
    r.num_computed_tokens, r.block_ids = num_computed, blocks
    return r


def test_windowed_tables_start_at_the_window_and_masks_cut_before_it():
    # Blocks of 4, window 5: a query at p sees keys p - 4 .. p.
    a = request(list(range(14)), 13, [7, 3, 9, 2])  # decode at 13: keys 9..13, blocks 2..3 ([9, 2]) from index 1
    b = request(list(range(3)), 2, [5])  # decode at 2: keys 0..2, inside the window
    c = request(list(range(11)), 8, [1, 4, 6])  # chunk 8..10 after 8 cached: keys from 4, blocks 1..2 ([4, 6])
    d = request(list(range(7)), 0, [8, 10])  # a 7-token prompt, nothing cached: 7 > 5, so it needs a mask
    sched = SchedulerOutput([ScheduledRequest(a, 1, True), ScheduledRequest(b, 1, True), ScheduledRequest(c, 3, True),
                             ScheduledRequest(d, 7, True)], [], 12)
    attn = build_inputs(sched, 4, torch.device("cpu"), sliding_window=5).attn
    windowed = attn.windowed
    assert attn.sliding_window == windowed.sliding_window == 5
    assert windowed.slot_mapping is attn.slot_mapping
    [group] = windowed.decode_groups
    assert group.rows.tolist() == [0, 1] and group.block_table.tolist() == [[9, 2], [5, 0]]
    assert group.mask[:, 0, 0].int().tolist() == [[0, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    run_c, run_d = windowed.prefill_runs
    assert (run_c.first_row, run_c.num_rows, run_c.block_table.tolist()) == (2, 3, [[4, 6]])
    # Keys 4..11; query 8 sees 4..8, query 9 sees 5..9, query 10 sees 6..10.
    assert run_c.mask[0, 0].int().tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 0]]
    assert (run_d.first_row, run_d.num_rows, run_d.block_table) == (5, 7, None)
    assert run_d.mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1]]
    # The full metadata is what it is without a window: tables from block 0, causal masks.
    [full_group] = attn.decode_groups
    assert full_group.block_table.tolist() == [[7, 3, 9, 2], [5, 0, 0, 0]]
    assert [run.block_table for run in attn.prefill_runs][1] is None and attn.prefill_runs[1].mask is None


def test_no_windowed_metadata_while_every_context_fits_the_window():
    a = request(list(range(5)), 4, [7, 3])
    sched = SchedulerOutput([ScheduledRequest(a, 1, True)], [], 1)
    attn = build_inputs(sched, 4, torch.device("cpu"), sliding_window=5).attn
    assert attn.sliding_window == 5 and attn.windowed is None
    assert build_inputs(sched, 4, torch.device("cpu"), sliding_window=4).attn.windowed is not None


# ---- the README ---------------------------------------------------------------------------------------

def test_readme_lists_the_supported_and_refused_architectures():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = re.search(r"<!-- architectures -->(.*?)<!-- /architectures -->", readme, re.S).group(1)
    supported = re.findall(r"^\| `(\w+)` \| supported \|", section, re.M)  # the table's rows, in order
    refused = re.findall(r"^\| `(\w+)` \| refused \|", section, re.M)
    assert tuple(supported) == SUPPORTED_ARCHITECTURES
    assert tuple(refused) == tuple(REFUSED_ARCHITECTURES)
