"""model/config.py: LlamaConfig read from transformers' own config dicts (4.x and 5.x spellings),
each family's switches as transformers' configs set them, its parameter count against transformers'
model, and the refusals, each naming the value (and a near architecture's missing feature)."""

from __future__ import annotations

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
    ({"architectures": ["Gemma3ForCausalLM"]}, r"architecture 'Gemma3ForCausalLM' is not supported: it needs a second "
                                                r"rope table \(local layers' own base frequency\)"),
    ({"architectures": ["GemmaForCausalLM"], "use_bidirectional_attention": True},
     "use_bidirectional_attention=True is not supported"),
    ({"hidden_act": "relu"}, r"hidden_act='relu' is not supported \(supported: \('silu', 'gelu_pytorch_tanh'\)\)"),
    ({"architectures": ["Gemma2ForCausalLM"], "sliding_window": 4, "layer_types": ["full_attention"] * 2},
     "layer_types has 2 entries for 1 layers"),
    ({"architectures": ["Gemma2ForCausalLM"], "sliding_window": 4, "layer_types": ["chunked_attention"]},
     r"layer_types \['chunked_attention'\] are not supported"),
    ({"architectures": ["LlamaForCausalLM", "BertModel"]}, r"\['LlamaForCausalLM', 'BertModel'\] is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     r"rope_scaling type 'dynamic' is not supported \(supported: \('default', 'linear', 'llama3'\)\)"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3},
     "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
])
def test_more_unsupported_configs_are_refused_with_the_value_and_the_limit(change, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_dict(BASE | change)


# ---- the families' switches, read from transformers' own configs ----------------------------------------

def hf_config(family: str, **overrides) -> dict:
    import transformers

    name = {"mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "gemma": "GemmaConfig",
            "gemma2": "Gemma2Config"}[family]
    small = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=4)
    return getattr(transformers, name)(**(small | overrides)).to_dict()


def switches(config: LlamaConfig) -> dict:
    return {f: getattr(config, f) for f in ("qkv_bias", "o_bias", "qk_norm", "hidden_act", "embed_scale", "norm_offset",
                                            "sandwich_norms", "query_pre_attn_scalar", "attn_logit_softcap",
                                            "final_logit_softcap", "sliding_window", "sliding_layers")}


OFF = {"qkv_bias": False, "o_bias": False, "qk_norm": False, "hidden_act": "silu", "embed_scale": False,
       "norm_offset": False, "sandwich_norms": False, "query_pre_attn_scalar": None, "attn_logit_softcap": None,
       "final_logit_softcap": None, "sliding_window": None, "sliding_layers": ()}


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
])
def test_num_params_equals_transformers_parameter_count_for_every_family(family, overrides):
    hf = make_hf_model(family, **overrides)
    assert LlamaConfig.from_hf_dict(hf.config.to_dict()).num_params == sum(p.numel() for p in hf.parameters())


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
