"""peerbench's real-shape files (benchmarks/peerbench/realshapes.py) on tiny configs: the bf16
checkpoint written tensor by tensor is one transformers loads with no key missing or left over, its
weights initialized as transformers' (std 0.02, norms at their start value) and the same for the
same seed; a token's read bytes of a GGUF counted by hand."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from benchmarks.peerbench import realshapes

TINY_MOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=96,
                moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
TINY_GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=96,
                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32)


@pytest.mark.parametrize(("config_class", "fields", "norm_value"),
                         [("Qwen3MoeConfig", TINY_MOE, 1.0), ("Gemma3TextConfig", TINY_GEMMA3, 0.0)])
def test_the_random_checkpoint_loads_in_transformers_as_initialized(tmp_path, config_class, fields, norm_value):
    config = getattr(transformers, config_class)(**fields)
    realshapes.write_random_checkpoint(config, tmp_path / "a", seed=3, norm_value=norm_value)
    realshapes.write_random_checkpoint(config, tmp_path / "b", seed=3, norm_value=norm_value)
    # one shard per layer, the embedding, final norm and head in the first
    assert sorted(p.name for p in (tmp_path / "a").glob("*.safetensors")) == [
        "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a", output_loading_info=True)
    assert not any(info.values()), info
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b")
    for (name, tensor), (_, other) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert tensor.dtype == torch.bfloat16, name
        torch.testing.assert_close(tensor, other, rtol=0, atol=0)
        if tensor.ndim == 1:
            assert bool((tensor == norm_value).all()), name
        else:
            assert abs(tensor.float().std().item() - 0.02) < 0.004, name
            assert abs(tensor.float().mean().item()) < 0.004, name
    other_seed = tmp_path / "c"
    realshapes.write_random_checkpoint(config, other_seed, seed=4, norm_value=norm_value)
    changed = transformers.AutoModelForCausalLM.from_pretrained(other_seed)
    assert not torch.equal(changed.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_a_tokens_read_bytes_take_k_of_x_experts_and_one_embedding_row(tmp_path):
    file = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(file, "qwen3moe")
    writer.add_uint32("qwen3moe.expert_count", 8)
    writer.add_uint32("qwen3moe.expert_used_count", 2)
    writer.add_tensor("token_embd.weight", np.zeros((100, 16), np.float32))  # 100 rows of 64 bytes
    writer.add_tensor("output.weight", np.zeros((100, 16), np.float16))  # 3200 bytes
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((16, 16), np.float32))  # 1024
    writer.add_tensor("blk.0.attn_norm.weight", np.zeros(16, np.float32))  # 64
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((8, 4, 16), np.float32))  # 2048, 2 of 8: 512
    writer.add_tensor("blk.0.ffn_down_exps.weight", np.zeros((8, 16, 4), np.float16))  # 1024, 2 of 8: 256
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    read = realshapes.token_read_bytes(file)
    assert read == {"head": 3200, "experts": 768, "layers": 1088, "embedding": 64, "total": 5120,
                    "file": file.stat().st_size}
