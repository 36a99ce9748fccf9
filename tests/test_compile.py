"""EngineConfig(compile=True): the torch.compile'd decoder layer gives the eager tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import config_of, forms, make_hf_llama, make_tiny_engine, nanoserve_model_from_hf

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.model import blockdot
from nanoserve.model.driver import Driver
from nanoserve.model.forms import can_pack

pytestmark = pytest.mark.slow


def test_compiled_layer_gives_the_eager_tokens_for_prefill_chunks_and_decodes():
    prompts = [[5, 9, 13, 22, 7, 41, 3, 8], [17, 4], [30 + i % 50 for i in range(23)]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eager = make_tiny_engine(max_num_batched_tokens=16).generate(prompts, params)
    engine = make_tiny_engine(max_num_batched_tokens=16, compile=True)
    assert set(engine.model.drivers) == {Driver.TORCH_COMPILED}  # the compiled wrapper is what runs
    assert engine.warmup() > 0
    compiled = engine.generate(prompts, params)
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]


def test_a_packed_model_refuses_compile_by_name():
    engine = make_tiny_engine(dense_kernel="torch")  # pack_weights defaults on: the engine's model holds oneDNN tensors
    assert forms(engine.model) == {"onednn" if can_pack(torch.float32) else "torch"}
    with pytest.raises(ValueError, match="torch.compile traces torch's own forms.*onednn"):
        Engine(engine.model, None, EngineConfig(dtype="float32", quantization=None, compile=True, num_kv_blocks=8))
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids  # still serves
    if blockdot.library() is not None:  # and a model whose matrices are in blockdot's dense panels
        panels = make_tiny_engine(dense_kernel="blockdot")
        with pytest.raises(ValueError, match="torch.compile traces torch's own forms.*dense-panels"):
            Engine(panels.model, None, EngineConfig(dtype="float32", quantization=None, compile=True, num_kv_blocks=8))
    # a compiled engine's plan says torch runs its dense matmuls and the compiled layer every step, as they do
    compiled = make_tiny_engine(compile=True)
    assert compiled.plan.decode == compiled.plan.mixed == "torch-compiled" and set(compiled.model.drivers) == {Driver.TORCH_COMPILED}
    assert forms(compiled.model) == {"torch"} and compiled.model.fused_layers is None


def test_two_engines_from_one_loaded_model_do_not_share_a_preparation():
    hf = make_hf_llama(seed=0)
    model = nanoserve_model_from_hf(hf)
    plain = Engine(model, None, config_of(dtype="float32", quantization=None, pack_weights=False, num_kv_blocks=8, block_size=4,
                                             dense_kernel="torch"))
    compiled = Engine(model, None, EngineConfig(dtype="float32", quantization=None, compile=True, num_kv_blocks=8, block_size=4))
    packed = Engine(model, None, config_of(dtype="float32", quantization=None, num_kv_blocks=8, block_size=4,
                                              dense_kernel="torch"))
    # nothing to lay out on the exact path: the loaded model itself, its own weights
    assert plain.model.layers is model.layers and model.fused_layers is None
    assert model.plan is None and set(model.drivers) == {Driver.TORCH} and forms(model) == {"torch"}
    assert set(compiled.model.drivers) == {Driver.TORCH_COMPILED} and forms(compiled.model) == {"torch"}
    assert forms(packed.model) == {"onednn" if can_pack(torch.float32) else "torch"} and set(packed.model.drivers) == {Driver.TORCH}
