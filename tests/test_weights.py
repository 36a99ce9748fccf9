"""model/weights.py: checkpoint directories written here with safetensors (one file, hand-made
shards with an index, and transformers' own save_pretrained shards), read back tensor for tensor;
the refusals name what is missing."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from conftest import make_hf_llama
from safetensors.torch import save_file

from nanoserve.model.weights import load_config, load_model, load_tensors, safetensors_files


@pytest.fixture(scope="module")
def hf():
    return make_hf_llama(seed=5)


def state(hf) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone().contiguous() for name, t in hf.state_dict().items()}


def write_config(path: Path, hf, **overrides) -> None:
    d = hf.config.to_dict() | {"architectures": ["LlamaForCausalLM"]} | overrides
    (path / "config.json").write_text(json.dumps(d))


def write_shards(path: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> dict[str, str]:
    """Splits tensors round-robin over num_shards files and writes the index transformers writes."""
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {n: tensors[n] for n in names[i::num_shards]}
        save_file(shard, str(path / file))
        weight_map |= dict.fromkeys(shard, file)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def assert_model_holds(model, hf) -> None:
    """Every weight of the loaded model is the transformers tensor of the same name."""
    sd = hf.state_dict()
    assert torch.equal(model.embed, sd["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head, sd["lm_head.weight"])
    assert torch.equal(model.norm, sd["model.norm.weight"])
    assert len(model.layers) == hf.config.num_hidden_layers
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        assert torch.equal(layer.input_norm, sd[p + "input_layernorm.weight"])
        assert torch.equal(layer.post_norm, sd[p + "post_attention_layernorm.weight"])
        assert torch.equal(layer.qkv.weight, torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
        assert torch.equal(layer.o.weight, sd[p + "self_attn.o_proj.weight"])
        assert torch.equal(layer.gate_up.weight, torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
        assert torch.equal(layer.down.weight, sd[p + "mlp.down_proj.weight"])


def test_single_file(tmp_path, hf):
    tensors = state(hf)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    write_config(tmp_path, hf)
    assert safetensors_files(tmp_path) == [tmp_path / "model.safetensors"]
    loaded = load_tensors(tmp_path)
    assert sorted(loaded) == sorted(tensors)
    assert all(torch.equal(loaded[n], tensors[n]) for n in tensors)
    assert_model_holds(load_model(tmp_path, torch.float32, "cpu"), hf)


def test_sharded_with_an_index_reads_the_files_the_index_names(tmp_path, hf):
    tensors = state(hf)
    weight_map = write_shards(tmp_path, tensors, num_shards=3)
    # A stray file the index does not name is not read (its tensor would otherwise appear).
    save_file({"stray.weight": torch.ones(2)}, str(tmp_path / "zz-stray.safetensors"))
    write_config(tmp_path, hf)
    assert safetensors_files(tmp_path) == [tmp_path / f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    loaded = load_tensors(tmp_path)
    assert sorted(loaded) == sorted(weight_map) == sorted(tensors)
    assert all(torch.equal(loaded[n], tensors[n]) for n in tensors)
    assert_model_holds(load_model(tmp_path, torch.float32, "cpu"), hf)


def test_transformers_save_pretrained_shards(tmp_path, hf):
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    assert_model_holds(load_model(tmp_path, torch.float32, "cpu"), hf)


def test_unindexed_shards_are_all_read(tmp_path, hf):
    tensors = state(hf)
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:5]}, str(tmp_path / "a.safetensors"))
    save_file({n: tensors[n] for n in names[5:]}, str(tmp_path / "b.safetensors"))
    assert safetensors_files(tmp_path) == [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    assert sorted(load_tensors(tmp_path)) == names


def test_dtype_is_converted_at_load(tmp_path, hf):
    save_file(state(hf), str(tmp_path / "model.safetensors"))
    write_config(tmp_path, hf)
    model = load_model(tmp_path, torch.bfloat16, "cpu")
    assert model.embed.dtype == torch.bfloat16
    assert torch.equal(model.embed, hf.state_dict()["model.embed_tokens.weight"].to(torch.bfloat16))


def test_a_missing_tensor_is_refused_by_name(tmp_path, hf):
    tensors = state(hf)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    write_config(tmp_path, hf)
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.mlp.down_proj.weight' \(expected shape \[32, 64\]\)"):
        load_model(tmp_path, torch.float32, "cpu")


def test_a_tensor_of_the_wrong_shape_is_refused_by_name(tmp_path, hf):
    tensors = state(hf)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)  # Hkv D = 16 rows expected
    save_file(tensors, str(tmp_path / "model.safetensors"))
    write_config(tmp_path, hf)
    with pytest.raises(ValueError,
                       match=r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \[8, 32\], expected \[16, 32\]"):
        load_model(tmp_path, torch.float32, "cpu")


def test_missing_config_json_is_refused(tmp_path, hf):
    save_file(state(hf), str(tmp_path / "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="needs config.json"):
        load_model(tmp_path, torch.float32, "cpu")


def test_no_safetensors_is_refused_and_nothing_is_unpickled(tmp_path, hf, monkeypatch):
    write_config(tmp_path, hf)
    torch.save(state(hf), tmp_path / "pytorch_model.bin")  # a pickled checkpoint, which must not be read

    def unpickles(*args, **kwargs):
        raise AssertionError("a pickle was loaded")

    for module, name in ((torch, "load"), (pickle, "load"), (pickle, "loads"), (pickle, "Unpickler")):
        monkeypatch.setattr(module, name, unpickles)
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors in .* \(nanoserve never loads pickled checkpoints\)"):
        load_model(tmp_path, torch.float32, "cpu")


def test_generation_config_eos_overrides_config_json(tmp_path, hf):
    write_config(tmp_path, hf, eos_token_id=2)
    assert load_config(tmp_path).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 11]}))
    assert load_config(tmp_path).eos_token_ids == (2, 11)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None, "do_sample": True}))
    assert load_config(tmp_path).eos_token_ids == (2,)  # no EOS there: config.json's stands
