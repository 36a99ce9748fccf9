"""model/config.py: LlamaConfig read from transformers' own config dicts (4.x and 5.x spellings),
each family's switches as transformers' configs set them, its parameter count against transformers'
model, and the refusals, each naming the value (and a near architecture's missing feature)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import LLAMA3_ROPE, make_hf_llama, make_hf_model
from transformers import LlamaConfig as HFLlamaConfig
from transformers import MistralConfig as HFMistralConfig

from nanoserve.model.config import LlamaConfig

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}


def test_fields_equal_the_transformers_config_they_were_read_from():
    hf = HFLlamaConfig(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=16, rms_norm_eps=3e-6,
                       max_position_embeddings=300, tie_word_embeddings=True, bos_token_id=7, eos_token_id=[8, 9],
                       rope_theta=321.0, architectures=["LlamaForCausalLM"])
    config = LlamaConfig.from_hf_dict(hf.to_dict())
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert (config.rms_norm_eps, config.max_position_embeddings, config.tie_word_embeddings) == (3e-6, 300, True)
    assert (config.rope_theta, config.rope_scaling) == (321.0, None)
    assert (config.bos_token_id, config.eos_token_ids) == (7, (8, 9))


def test_config_reads_transformers_spellings():
    hf = make_hf_llama(rope_scaling=LLAMA3_ROPE, head_dim=16, rope_theta=500000.0)
    config = LlamaConfig.from_hf_dict(hf.config.to_dict())
    assert config.rope_scaling["rope_type"] == "llama3"
    assert config.rope_scaling["factor"] == 8.0
    assert config.rope_theta == 500000.0
    legacy = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 1234.0,
              "rope_scaling": {"type": "linear", "factor": 2.0}}
    config = LlamaConfig.from_hf_dict(legacy)
    assert (config.rope_theta, config.rope_scaling["rope_type"], config.num_kv_heads, config.head_dim) == (
        1234.0, "linear", 2, 4)


def test_rope_parameters_of_type_default_mean_no_scaling():
    config = LlamaConfig.from_hf_dict(BASE | {"rope_parameters": {"rope_type": "default", "rope_theta": 77.0}})
    assert (config.rope_theta, config.rope_scaling) == (77.0, None)
    config = LlamaConfig.from_hf_dict(BASE | {"rope_scaling": {"rope_type": "default"}})
    assert config.rope_scaling is None


@pytest.mark.parametrize("eos, expected", [(5, (5,)), ([5, 6], (5, 6)), (None, ())])
def test_eos_ids_become_a_tuple(eos, expected):
    assert LlamaConfig.from_hf_dict(BASE | {"eos_token_id": eos}).eos_token_ids == expected


def test_defaults_when_keys_are_absent():
    config = LlamaConfig.from_hf_dict(BASE)
    # num_key_value_heads absent: multi-head attention; head_dim absent: hidden_size / heads = 8 / 2.
    assert (config.num_kv_heads, config.head_dim) == (2, 4)
    assert (config.rms_norm_eps, config.rope_theta, config.tie_word_embeddings, config.bos_token_id) == (
        1e-6, 10000.0, False, None)


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}, {"num_key_value_heads": 4},
                                       {"num_attention_heads": 8, "head_dim": 4}])
def test_num_params_equals_transformers_parameter_count(overrides):
    hf = make_hf_llama(**overrides)
    config = LlamaConfig.from_hf_dict(hf.config.to_dict())
    assert config.num_params == sum(p.numel() for p in hf.parameters())  # a tied head is counted once


def test_mistral_without_sliding_window_is_read_as_llama():
    hf = HFMistralConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, sliding_window=None,
                         architectures=["MistralForCausalLM"])
    config = LlamaConfig.from_hf_dict(hf.to_dict())
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (2, 1, 4)
    assert (config.sliding_window, config.sliding_layers) == (None, ())
    # Llama's modelling code reads no window, so neither does nanoserve for a Llama.
    assert LlamaConfig.from_hf_dict(BASE | {"sliding_window": 16}).sliding_window is None


def test_model_type_alone_stands_for_the_architecture():
    assert LlamaConfig.from_hf_dict(BASE | {"architectures": None, "model_type": "llama"}).num_layers == 1
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        LlamaConfig.from_hf_dict(BASE | {"architectures": None, "model_type": "gpt2"})


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
])
def test_unsupported_configs_are_refused_by_name(change, message):
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_dict(base | change)


@pytest.mark.parametrize("change, message", [
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, r"Gemma3ForConditionalGeneration's config has no "
                                                             r"text_config object \(got NoneType\)"),
    ({"architectures": None, "model_type": "gemma3", "text_config": {"vocab_size": 10, "hidden_size": 8}},
     r"config has no 'intermediate_size'"),
    ({"architectures": ["DeepseekV3ForCausalLM"]}, "'DeepseekV3ForCausalLM' is not supported: it needs multi-head "
                                                    "latent attention"),
    ({"architectures": ["GemmaForCausalLM"], "use_bidirectional_attention": True},
     "use_bidirectional_attention=True is not supported"),
    ({"hidden_act": "relu"}, r"hidden_act='relu' is not supported \(supported: \('silu', 'gelu_pytorch_tanh'\)\)"),
    ({"architectures": ["Gemma2ForCausalLM"], "sliding_window": 4, "layer_types": ["full_attention"] * 2},
     "layer_types has 2 entries for 1 layers"),
    ({"architectures": ["Gemma2ForCausalLM"], "sliding_window": 4, "layer_types": ["chunked_attention"]},
     r"layer_types \['chunked_attention'\] are not supported"),
    ({"architectures": ["LlamaForCausalLM", "BertModel"]}, r"\['LlamaForCausalLM', 'BertModel'\] is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     r"rope_scaling type 'dynamic' is not supported \(supported: \('default', 'linear', 'llama3', 'longrope'\)\)"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3},
     "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    # Phi-3: partial rotary and LongRoPE (head_dim 4: two frequencies at full rotary, one at half)
    ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 1.5},
     r"partial_rotary_factor=1.5 must be a number > 0 and <= 1"),
    ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.25},
     r"partial_rotary_factor=0.25 of head_dim=4 rotates 1 dimensions: rope needs an even number, at least 2"),
    ({"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"type": "longrope", "short_factor": [1.0],
                                                             "long_factor": [1.0, 2.0]}},
     r"rope_scaling\['short_factor'\] must be a list of 2 numbers \(one per rotated frequency of rotary_dim=4\)"),
    ({"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"type": "su", "short_factor": [1.0, -2.0],
                                                             "long_factor": [1.0, 2.0]}},
     r"rope_scaling\['short_factor'\]\[1\]=-2.0 must be a finite number > 0"),
    ({"architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 0,
      "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.0], "long_factor": [1.0, 2.0]}},
     r"original_max_position_embeddings=0 must be an integer from 1 to 16777216"),
    ({"architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 1,
      "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.0], "long_factor": [1.0, 2.0]}},
     r"original_max_position_embeddings=1 with factor 64.0: the attention factor divides by ln\(original\)"),
    ({"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.0],
                                                             "long_factor": [1.0, 2.0], "attention_factor": 0}},
     r"rope_scaling\['attention_factor'\]=0 must be a finite number > 0"),
    # Gemma 3: the local layers' base and pattern
    ({"architectures": ["Gemma3ForCausalLM"], "rope_local_base_freq": -1.0}, r"rope_local_base_freq=-1.0 must be a "
                                                                            r"finite number > 0"),
    ({"architectures": ["Gemma3ForCausalLM"], "sliding_window": 4, "sliding_window_pattern": 0},
     r"sliding_window_pattern=0 must be an integer from 1 to 4096"),
    ({"architectures": ["Gemma3ForCausalLM"], "rope_parameters": {
        "sliding_attention": {"rope_type": "linear", "factor": 2.0}, "full_attention": {"rope_type": "default"}}},
     r"Gemma 3's sliding_attention rope_type 'linear' is not supported"),
    # SmolLM3: the NoPE layers
    ({"architectures": ["SmolLM3ForCausalLM"], "no_rope_layers": [1, 1]},
     r"no_rope_layers=\[1, 1\] must be a list of 1 entries, each 0 or 1"),
    ({"architectures": ["SmolLM3ForCausalLM"], "no_rope_layer_interval": 0},
     r"no_rope_layer_interval=0 must be an integer from 1 to 4096"),
])
def test_more_unsupported_configs_are_refused_with_the_value_and_the_limit(change, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_dict(BASE | change)


# ---- the families' switches, read from transformers' own configs ----------------------------------------

def hf_config(family: str, **overrides) -> dict:
    import transformers

    name = {"mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "gemma": "GemmaConfig",
            "gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig", "phi3": "Phi3Config",
            "smollm3": "SmolLM3Config"}[family]
    small = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return getattr(transformers, name)(**(small | overrides)).to_dict()


def switches(config: LlamaConfig) -> dict:
    return {f: getattr(config, f) for f in ("qkv_bias", "o_bias", "qk_norm", "hidden_act", "embed_scale", "norm_offset",
                                            "sandwich_norms", "query_pre_attn_scalar", "attn_logit_softcap",
                                            "final_logit_softcap", "sliding_window", "sliding_layers",
                                            "partial_rotary_factor", "rope_local_theta", "no_rope_layers")}


OFF = {"qkv_bias": False, "o_bias": False, "qk_norm": False, "hidden_act": "silu", "embed_scale": False,
       "norm_offset": False, "sandwich_norms": False, "query_pre_attn_scalar": None, "attn_logit_softcap": None,
       "final_logit_softcap": None, "sliding_window": None, "sliding_layers": (), "partial_rotary_factor": 1.0,
       "rope_local_theta": None, "no_rope_layers": ()}
GEMMA3 = {"hidden_act": "gelu_pytorch_tanh", "embed_scale": True, "norm_offset": True, "sandwich_norms": True,
          "qk_norm": True, "query_pre_attn_scalar": 256, "rope_local_theta": 10000.0}


@pytest.mark.parametrize("family, overrides, on", [
    ("mistral", {"sliding_window": 3}, {"sliding_window": 3, "sliding_layers": (0, 1, 2, 3)}),
    ("mistral", {"sliding_window": None}, {}),
    # Qwen2's window is off unless use_sliding_window; its q/k/v bias is in the modelling code.
    ("qwen2", {"sliding_window": 3}, {"qkv_bias": True}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 2},
     {"qkv_bias": True, "sliding_window": 3, "sliding_layers": (2, 3)}),
    ("qwen3", {}, {"qk_norm": True}),
    ("qwen3", {"attention_bias": True}, {"qk_norm": True, "qkv_bias": True, "o_bias": True}),
    ("gemma", {}, {"hidden_act": "gelu_pytorch_tanh", "embed_scale": True, "norm_offset": True}),
    ("gemma2", {"sliding_window": 3, "query_pre_attn_scalar": 5},
     {"hidden_act": "gelu_pytorch_tanh", "embed_scale": True, "norm_offset": True, "sandwich_norms": True,
      "query_pre_attn_scalar": 5, "attn_logit_softcap": 50.0, "final_logit_softcap": 30.0, "sliding_window": 3,
      "sliding_layers": (0, 2)}),
    ("gemma2", {"sliding_window": 3, "layer_types": ["full_attention"] * 3 + ["sliding_attention"]},
     {"hidden_act": "gelu_pytorch_tanh", "embed_scale": True, "norm_offset": True, "sandwich_norms": True,
      "query_pre_attn_scalar": 256, "attn_logit_softcap": 50.0, "final_logit_softcap": 30.0, "sliding_window": 3,
      "sliding_layers": (3,)}),
    # Gemma 3: every sixth layer global unless layer_types or the pattern say otherwise; no soft-caps
    # unless set; its local layers' own base
    ("gemma3", {"num_hidden_layers": 7, "sliding_window": 3},
     GEMMA3 | {"sliding_window": 3, "sliding_layers": (0, 1, 2, 3, 4, 6)}),
    ("gemma3", {"sliding_window": 3, "sliding_window_pattern": 2, "rope_local_base_freq": 77.0,
                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 7.0},
     GEMMA3 | {"sliding_window": 3, "sliding_layers": (0, 2), "rope_local_theta": 77.0, "attn_logit_softcap": 5.0,
               "final_logit_softcap": 7.0}),
    ("gemma3", {"sliding_window": 3, "layer_types": ["full_attention"] * 3 + ["sliding_attention"]},
     GEMMA3 | {"sliding_window": 3, "sliding_layers": (3,)}),
    # Phi-3: every layer windowed when sliding_window is set; rope on a fraction of each head
    ("phi3", {"sliding_window": 3, "partial_rotary_factor": 0.5},
     {"sliding_window": 3, "sliding_layers": (0, 1, 2, 3), "partial_rotary_factor": 0.5}),
    ("phi3", {"sliding_window": None}, {}),
    # SmolLM3: every fourth layer without rope unless no_rope_layers says which
    ("smollm3", {}, {"no_rope_layers": (3,)}),
    ("smollm3", {"no_rope_layers": [0, 1, 0, 1]}, {"no_rope_layers": (0, 2)}),
    ("smollm3", {"use_sliding_window": True, "sliding_window": 3},
     {"no_rope_layers": (3,), "sliding_window": 3, "sliding_layers": (3,)}),
])
def test_family_switches_are_read_as_transformers_reads_the_config(family, overrides, on):
    config = LlamaConfig.from_hf_dict(hf_config(family, **overrides))
    assert switches(config) == OFF | on


def test_a_config_json_without_architectures_or_keys_gets_the_familys_defaults():
    qwen3 = LlamaConfig.from_hf_dict(BASE | {"architectures": None, "model_type": "qwen3"})
    assert (qwen3.architecture, qwen3.head_dim, qwen3.tie_word_embeddings) == ("Qwen3ForCausalLM", 128, False)
    gemma = LlamaConfig.from_hf_dict(BASE | {"architectures": ["GemmaForCausalLM"], "hidden_act": "gelu"})
    # Gemma's first releases wrote "gelu" and meant the tanh form (as transformers reads it).
    assert (gemma.hidden_act, gemma.head_dim, gemma.tie_word_embeddings) == ("gelu_pytorch_tanh", 256, True)


@pytest.mark.parametrize("family, overrides", [
    ("mistral", {}), ("qwen2", {}), ("qwen2", {"tie_word_embeddings": True}), ("qwen3", {"head_dim": 12}),
    ("qwen3", {"attention_bias": True}), ("gemma", {}), ("gemma2", {}), ("llama", {"attention_bias": True}),
    ("gemma3", {}), ("phi3", {"pad_token_id": 0}), ("smollm3", {"pad_token_id": 0}),
])
def test_num_params_equals_transformers_parameter_count_for_every_family(family, overrides):
    hf = make_hf_model(family, **overrides)
    assert LlamaConfig.from_hf_dict(hf.config.to_dict()).num_params == sum(p.numel() for p in hf.parameters())


def test_longrope_is_read_with_what_transformers_derives():
    # Phi-3-mini-128k's spelling: rope_scaling "longrope" (or "su"), the original context at the top
    # level; the attention factor sqrt(1 + ln(131072 / 4096) / ln 4096), as transformers computes it
    import math

    factors = {"short_factor": [1.0, 1.1], "long_factor": [2.0, 3.0]}
    for kind in ("longrope", "su"):
        config = LlamaConfig.from_hf_dict(BASE | {"architectures": ["Phi3ForCausalLM"], "max_position_embeddings": 131072,
                                                  "original_max_position_embeddings": 4096,
                                                  "rope_scaling": {"type": kind} | factors})
        assert config.rope_scaling == {"rope_type": "longrope", **factors, "original_max_position_embeddings": 4096,
                                       "attention_factor": math.sqrt(1 + math.log(32) / math.log(4096))}
    given = LlamaConfig.from_hf_dict(BASE | {"architectures": ["Phi3ForCausalLM"], "rope_scaling": {
        "rope_type": "longrope", "attention_factor": 1.5, "original_max_position_embeddings": 16} | factors})
    assert given.rope_scaling["attention_factor"] == 1.5 and given.rope_scaling["original_max_position_embeddings"] == 16


def test_a_gemma3_multimodal_config_is_read_as_its_text_config():
    import transformers

    text = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=4, sliding_window=3, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    d = transformers.Gemma3Config(text_config=text, eos_token_id=[2, 5]).to_dict()
    config = LlamaConfig.from_hf_dict(d)
    assert (config.architecture, config.language_model_of) == ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
    assert dataclasses.replace(config, language_model_of=None) == LlamaConfig.from_hf_dict(d["text_config"] | {"architectures": ["Gemma3ForCausalLM"],
                                                                  "eos_token_id": [2, 5], "tie_word_embeddings": True})
    with pytest.raises(ValueError, match=r"language_model_of='Gemma3ForConditionalGeneration': nanoserve reads the "
                                         r"language models of"):
        LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=2,
                    head_dim=4, language_model_of="Gemma3ForConditionalGeneration")


# ---- mixtures of experts -------------------------------------------------------------------------------

MOE_FAMILIES = {
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 6, "mlp_only_layers": [1]},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 6,
                  "shared_expert_intermediate_size": 10, "decoder_sparse_step": 2},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 1, "eos_token_id": 2, "pad_token_id": 0},
}


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_num_params_equals_transformers_parameter_count_for_every_mixture_of_experts(family):
    hf = make_hf_model(family, num_hidden_layers=3, **MOE_FAMILIES[family])
    assert LlamaConfig.from_hf_dict(hf.config.to_dict()).num_params == sum(p.numel() for p in hf.parameters())


def test_mixture_of_experts_fields_are_read_as_transformers_reads_them():
    import transformers

    small = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=4)
    qwen3 = LlamaConfig.from_hf_dict(transformers.Qwen3MoeConfig(**small, num_experts=8, num_experts_per_tok=2,
                                                                  moe_intermediate_size=6, norm_topk_prob=True,
                                                                  mlp_only_layers=[0]).to_dict())
    assert (qwen3.num_experts, qwen3.num_experts_per_tok, qwen3.moe_intermediate_size, qwen3.norm_topk_prob,
            qwen3.dense_layers, qwen3.qk_norm) == (8, 2, 6, True, (0,), True)
    qwen2 = LlamaConfig.from_hf_dict(transformers.Qwen2MoeConfig(**small, num_experts=4, num_experts_per_tok=2,
                                                                  moe_intermediate_size=6, decoder_sparse_step=2,
                                                                  shared_expert_intermediate_size=12).to_dict())
    # transformers' layer i is sparse where (i + 1) % decoder_sparse_step == 0
    assert (qwen2.dense_layers, qwen2.shared_expert_intermediate_size, qwen2.qkv_bias, qwen2.norm_topk_prob) == (
        (0, 2), 12, True, False)
    mixtral = LlamaConfig.from_hf_dict(transformers.MixtralConfig(**small, num_local_experts=4).to_dict())
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob, mixtral.dense_layers) == (
        4, 16, True, ())
    olmoe = LlamaConfig.from_hf_dict(transformers.OlmoeConfig(**small, num_experts=4, num_experts_per_tok=3,
                                                              eos_token_id=2).to_dict())
    assert (olmoe.qk_norm_whole, olmoe.qk_norm, olmoe.num_experts_per_tok, olmoe.moe_intermediate_size) == (
        True, False, 3, 16)


MOE_BASE = BASE | {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 8}


@pytest.mark.parametrize("change, message", [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 must be an integer from 1 to 4"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok=0 must be an integer from 1 to 4"),
    ({"num_experts": 0, "num_local_experts": None}, "gives no num_experts"),
    ({"num_experts": 2**13}, f"num_experts={2**13} must be an integer from 1 to {2**12}"),
    ({"moe_intermediate_size": -1}, "moe_intermediate_size=-1 must be an integer from 1 to"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size=None must be an integer"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be an integer from 1 to"),
    ({"mlp_only_layers": [7]}, r"mlp_only_layers=\[7\] name layers outside 0 .. 0"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob='yes' must be true or false"),
    ({"architectures": ["Qwen2MoeForCausalLM"]}, "gives no shared_expert_intermediate_size"),
    ({"architectures": ["OlmoeForCausalLM"], "clip_qkv": 8.0}, "clip_qkv=8.0 is not supported"),
    ({"num_experts": 2**12, "moe_intermediate_size": 2**22, "hidden_size": 2**16, "num_attention_heads": 32},
     "parameters, over the"),
])
def test_mixture_of_experts_configs_out_of_bounds_are_refused_with_the_value_and_the_limit(change, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_dict(MOE_BASE | change)
