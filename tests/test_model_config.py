"""model/config.py: LlamaConfig read from transformers' own config dicts (4.x and 5.x spellings),
its parameter count against transformers' model, and the refusals, each naming the value."""

from __future__ import annotations

import pytest
from conftest import LLAMA3_ROPE, make_hf_llama
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
    # A window as long as the context is no window.
    assert LlamaConfig.from_hf_dict(BASE | {"sliding_window": 64}).max_position_embeddings == 64


def test_model_type_alone_stands_for_the_architecture():
    assert LlamaConfig.from_hf_dict(BASE | {"architectures": None, "model_type": "llama"}).num_layers == 1
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        LlamaConfig.from_hf_dict(BASE | {"architectures": None, "model_type": "gpt2"})


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"sliding_window": 16}, "sliding_window=16"),
])
def test_unsupported_configs_are_refused_by_name(change, message):
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_dict(base | change)


@pytest.mark.parametrize("change, message", [
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"architectures": ["LlamaForCausalLM", "BertModel"]}, r"\['LlamaForCausalLM', 'BertModel'\] is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     r"rope_scaling type 'dynamic' is not supported \(supported: \('default', 'linear', 'llama3'\)\)"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3},
     "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
])
def test_more_unsupported_configs_are_refused_with_the_value_and_the_limit(change, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_dict(BASE | change)
