"""The execution plan: what it says runs is what runs, on every path it can choose, and every family
on every such path gives transformers' logits (the conformance matrix)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import (
    CharTokenizer,
    config_of,
    forms,
    make_hf_llama,
    make_hf_model,
    nanoserve_model_from_hf,
    prepared,
)
from test_families import FAMILIES
from test_fused_decode import PROMPTS, count_one_call_steps, load_engine_weights_into
from test_llama import assert_logits_match, run_and_capture
from test_precision import fake

from nanoserve import Engine, EngineConfig
from nanoserve.model import blockdot, precision
from nanoserve.model.driver import EVERY_WIDTH, Driver
from nanoserve.model.forms import Dense, Form, can_pack
from nanoserve.model.plan import STEPS, ExecutionPlan, Route, check_laid_out, resolve_plan
from nanoserve.model.shard import AllReduced, CollectiveStats

needs_build = pytest.mark.skipif(blockdot.library() is None, reason=f"blockdot not built here: {blockdot.failure()}")

# Every way the plan runs a step, as EngineConfig values: (config, decode driver for a family the C
# decode takes, whether the weights are quantized). Float32 activations throughout, x never rounded
# to int16, so each path owes transformers float32's rounding only.
PATHS = {
    "exact": ({"quantization": None}, "torch"),
    "dense-one-call": ({"quantization": None, "fused_decode": True, "dense_kernel": "torch"}, "c-one-call"),
    "dense-panels": ({"quantization": None, "fused_decode": True, "dense_kernel": "blockdot"}, "c-one-call"),
    "int4-one-call": ({"quantization": "int4", "kernels": "blockdot"}, "c-one-call"),
    "int4-per-layer-past-2-rows": ({"quantization": "int4", "kernels": "blockdot", "max_kernel_rows": 2}, "c-one-call"),
    "int4-torch-kernels": ({"quantization": "int4", "kernels": "torch"}, "c-per-layer"),
    "int4-decoder-layer": ({"quantization": "int4", "kernels": "blockdot", "fused_decode": False}, "torch"),
    "int8": ({"quantization": "int8"}, "c-per-layer"),
    # the batch-invariant plan: every step, prompts too, in the one call
    "invariant-dense": ({"quantization": None, "batch_invariant": True}, "c-one-call"),
    "invariant-int4": ({"quantization": "int4", "batch_invariant": True}, "c-one-call"),
}
# test_families' switches; Qwen3's head_dim 16, so that o's input width (H D = 64) quantizes to int4
CASES = FAMILIES | {"qwen3": ("qwen3", {"head_dim": 16})}
# the others' switches are not in fused_decode.c (Gemma 2's soft-caps, an o bias, NoPE layers)
C_FAMILIES = {"mistral-window", "qwen2", "qwen2-window", "qwen3", "gemma", "gemma3", "phi3"}
# Mixtures of experts whose other switches fused_decode.c runs: their sparse MLP runs there too, on
# every route a dense model of the family takes (OLMoE's norm over the whole q and k keeps it on torch).
MOE_IN_C = {"qwen3-moe", "mixtral", "qwen2-moe"}


def engine_for(hf, **overrides) -> Engine:
    config = config_of(**({"dtype": "float32", "block_size": 4, "num_kv_blocks": 80, "max_num_seqs": 4,
                              "decode_group_min_rows": 2, "blockdot_int16_rows": None, "kv_cache_dtype": "float32",
                              "max_kernel_rows": None, "batch_invariant": False} | overrides))
    return Engine(nanoserve_model_from_hf(hf), CharTokenizer(hf.config.vocab_size), config)


@needs_build
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_family_on_every_path_gives_transformers_logits(name, path):
    family, family_overrides = CASES[name]
    overrides, decode = PATHS[path]
    hf = make_hf_model(family, seed=21, **family_overrides | {"tie_word_embeddings": False})
    invariant = overrides.get("batch_invariant", False)
    if invariant and name not in C_FAMILIES | MOE_IN_C:
        with pytest.raises(ValueError, match="batch_invariant=True, but no C decode: the family's"):
            engine_for(hf, **overrides)
        return
    engine = engine_for(hf, **overrides)
    assert check_laid_out(engine.model, engine.plan) == []  # the engine refuses to start otherwise
    expected_decode = decode if name in C_FAMILIES | MOE_IN_C or decode == "torch" else "torch"
    expected_mixed = "c-one-call" if invariant else "torch"
    assert (engine.plan.decode, engine.plan.mixed) == (expected_decode, expected_mixed)
    assert engine.plan.is_batch_invariant == invariant
    # exact: torch's ops on dense float32 matrices, which a family the C decode refuses gets from "dense-one-call" too
    assert engine.plan.exact == (path == "exact" or (path == "dense-one-call" and expected_decode == "torch"))
    if overrides["quantization"]:
        load_engine_weights_into(hf, engine)  # transformers runs the matrices the kernels hold, dequantized
    one_call_rows = count_one_call_steps(engine) if expected_decode.startswith("c-") else []
    captured, outputs = run_and_capture(engine, PROMPTS, max_tokens=[6, 6, 3, 3])  # four rows a step, then two
    assert assert_logits_match(hf, captured, outputs) == 18
    if expected_decode == "c-one-call":  # within the plan's width: four-row steps past 2 rows leave the one call
        assert one_call_rows and max(one_call_rows) <= engine.plan.one_call_rows
        assert (4 in one_call_rows) == (engine.plan.one_call_rows >= 4)
    engine.check_invariants()


def test_the_exact_path_runs_torchs_ops_only():
    engine = engine_for(make_hf_llama(seed=22), quantization=None, kv_cache_dtype="auto", max_kernel_rows="auto")
    plan = engine.plan
    assert plan.exact and plan.decode == plan.wide_decode == plan.mixed == "torch" and engine.model.fused_layers is None
    assert forms(engine.model) == {"onednn" if can_pack(torch.float32) else "torch"} and plan.kv_cache_dtype == "float32"
    assert "the exact path (dtype float32, quantization None): torch's ops only" in plan.reasons
    asked = engine_for(make_hf_llama(seed=22), quantization=None, fused_decode=True)  # an override names what differs
    assert not asked.plan.exact and "the exact path (dtype float32, quantization None): torch's ops, the C decode as " \
        "configured" in asked.plan.reasons


def test_compile_is_planned_as_it_runs():
    # Told kernels "blockdot" is refused for compile elsewhere; here "auto": the plan puts every matrix on
    # torch's forms and every step on the compiled layer, with no fused decode, and the KV cache's
    # reason names the dtype's, not blockdot's.
    engine = engine_for(make_hf_llama(seed=23), dtype="auto", quantization="int4", compile=True, kv_cache_dtype="auto")
    plan = engine.plan
    assert plan.decode == plan.mixed == "torch-compiled" and engine.model.fused_layers is None
    assert {m.form.name for m in plan.matrices} <= {"torch", "torch-int4", "torch-int8"}
    assert plan.kv_cache_dtype == plan.dtype and f"kv cache {plan.dtype}: the dtype's" in plan.reasons


def test_keeping_a_checkpoints_blocks_is_timed_on_the_kernel_that_will_run_them():
    # blockdot streamed fast, torch's int4 streamed slow: with kernels "torch" the blocks are dequantized.
    hf = make_hf_llama(seed=24)
    stored = nanoserve_model_from_hf(hf)
    from test_quant import _as_q8_0  # a GGUF-style Q8_0 matrix

    for layer in stored.layers:
        layer.qkv = _as_q8_0(layer.qkv.weight)
    probe = fake(0.2, 14.0, int4_ms=0.5, blockdot_ms=0.01, dense_ms=0.1)

    def figures(kernel_dtype=None):
        return dataclasses.replace(probe(kernel_dtype), int4_stream_ms=0.5, blockdot_stream_ms=0.02)

    on_torch = resolve_plan(config_of(kernels="torch"), stored, probe=figures)
    assert on_torch.quantization is None and on_torch.form_of(0, "qkv").name in ("torch", "onednn")
    assert "the checkpoint's quantization dequantized: torch's int4 0.20x" in on_torch.reason
    if blockdot.library() is not None:
        on_blockdot = resolve_plan(EngineConfig(), stored, probe=figures)
        # a Q8_0 matrix kept on blockdot runs on its file-bit panels (blockdot.INT8_CHOSEN)
        assert on_blockdot.quantization == "keep" and on_blockdot.form_of(0, "qkv").name == "blockdot-int8"


def test_a_model_that_differs_from_its_plan_is_named():
    model = prepared(nanoserve_model_from_hf(make_hf_llama(seed=25)), dtype="float32", quantization=None)
    plan = resolve_plan(EngineConfig(dtype="float32", quantization=None), model)
    assert check_laid_out(model, plan) == []
    wrong = dataclasses.replace(plan, matrices=tuple(
        dataclasses.replace(m, form=Form("dense-panels", "float32")) if (m.layer, m.name) == (1, "down") else m
        for m in plan.matrices), routes=(Route(False, 7, Driver.C_ONE_CALL), Route(False, EVERY_WIDTH, Driver.TORCH),
                                         Route(True, EVERY_WIDTH, Driver.TORCH)))
    problems = check_laid_out(model, wrong)
    assert problems[0].startswith("layer 1 down: runs ") and problems[0].endswith("the plan says dense-panels float32")
    assert problems[1] == "the model routes its steps by another table than the plan's"
    assert problems[2] == "the model's drivers are ['torch'], the plan routes to ['c-one-call', 'torch']"
    assert problems[3] == "the plan's drivers are ['c-one-call', 'torch'], the model's fused decode is None"


def test_the_plan_travels_as_json_to_tensor_parallel_workers(monkeypatch):
    monkeypatch.setattr(precision, "probe_cpu", fake(0.2, 14.0, int4_ms=0.01, dense_ms=1.0))
    plan = resolve_plan(config_of(quantization="int4", kernels="torch"), nanoserve_model_from_hf(make_hf_llama(seed=26)))
    again = ExecutionPlan.from_message(json.loads(json.dumps(plan.to_message())))
    assert again == dataclasses.replace(plan, probe=None) and again.render() == dataclasses.replace(plan, probe=None).render()


def test_render_groups_layers_and_names_every_step():
    engine = engine_for(make_hf_llama(seed=27), quantization="int4", kernels="torch", max_kernel_rows=8)
    text = engine.plan.render()
    assert "  layers 0-1 qkv" in text and "  head" in text
    assert "torch-int4 float32 up to 8 rows, dense copy past" in text and "torch-int8 float32" in text
    assert "decode-only: c-per-layer" in text and "with a prompt: torch" in text
    assert "no   quantized kernels up to 8 rows, dense copy past" in text


@needs_build
def test_check_laid_out_names_every_arithmetic_choice_changed_behind_the_plans_back():
    # An engine on the invariant plan with a draft model beside it: int4 on blockdot's panels, x in
    # int16 from one row, every step in one C call. Each change below alters a row's arithmetic
    # without the plan knowing; each must be named.
    from test_speculative import draft_spec

    hf = make_hf_llama(seed=28)
    engine = Engine(nanoserve_model_from_hf(hf), CharTokenizer(hf.config.vocab_size),
                    config_of(dtype="float32", quantization="int4", batch_invariant=True, block_size=4,
                              num_kv_blocks=64, speculative_config=draft_spec(hf)))
    model, plan, draft = engine.model, engine.plan, engine.speculation.draft.model
    assert plan.int16_rows == 1 and plan.draft is not None and plan.draft.is_batch_invariant
    assert check_laid_out(model, plan, draft) == []
    assert check_laid_out(model, plan) == ["the plan has a draft model's plan and no draft model is given"]
    assert "draft model (speculative decoding):" in plan.render()

    def altered(m, name, weight):
        """A copy of model m whose layer 0 `name` is `weight`."""
        copy = type(m).__new__(type(m))
        copy.__dict__ = dict(m.__dict__)
        copy.layers = [dataclasses.replace(m.layers[0], **{name: weight}), *m.layers[1:]]
        return copy

    qkv = model.layers[0].qkv
    # one matrix's int16 rounding
    rounded = dataclasses.replace(qkv, passes=[dataclasses.replace(qkv.passes[0], int16_rows=4)])
    problems = check_laid_out(altered(model, "qkv", rounded), plan, draft)
    assert problems == ["layer 0 qkv: runs blockdot float32, x in int16 from 4 rows, the plan says blockdot float32, "
                        "x in int16 from 1 row"]
    # the one call's own int16 threshold
    shape = model.fused_layers.shape
    try:
        shape.int16_rows = 0
        assert check_laid_out(model, plan, draft) == [
            "fused_decode.c rounds x to int16 from 0 rows (0: never), the plan says 1"]
    finally:
        shape.int16_rows = 1
    # the dispatch table: an entry swapped for another driver's
    swapped = type(model).__new__(type(model))
    swapped.__dict__ = dict(model.__dict__) | {"drivers": {Driver.C_ONE_CALL: STEPS[Driver.C_PER_LAYER]}}
    assert check_laid_out(swapped, plan, draft) == ["the model's table calls run_per_layer for c-one-call, "
                                                    "not run_one_call"]
    # the draft model's own matrix
    down = draft.layers[0].down
    assert check_laid_out(model, plan, altered(draft, "down", Dense(down.dequantize()))) == [
        f"draft model: layer 0 down: runs torch float32, the plan says {down.form}"]
    # the dtype
    cast = type(model).__new__(type(model))
    cast.__dict__ = dict(model.__dict__) | {"dtype": torch.bfloat16}
    assert check_laid_out(cast, plan, draft) == ["the model computes in torch.bfloat16, the plan says float32"]


def test_a_tensor_parallel_slice_summed_out_of_rank_order_is_named():
    # The rank-order sum is a field of the form: a slice whose all-reduce sums in ring order where the
    # plan says rank order (or the other way round) is named, as any other form.
    model = prepared(nanoserve_model_from_hf(make_hf_llama(seed=29)), dtype="float32", quantization=None)
    plan = model.plan
    o = model.layers[1].o
    in_order = dataclasses.replace(o.form, all_reduced=True, in_rank_order=True)
    sliced_plan = dataclasses.replace(plan, matrices=tuple(
        dataclasses.replace(m, form=in_order) if (m.layer, m.name) == (1, "o") else m for m in plan.matrices))
    sliced = type(model).__new__(type(model))
    sliced.__dict__ = dict(model.__dict__) | {"layers": list(model.layers)}
    for in_rank_order, expected in ((True, []), (False, [f"layer 1 o: runs {o.form}, all-reduced, the plan says "
                                                          f"{in_order}"])):
        sliced.layers[1] = dataclasses.replace(model.layers[1], o=AllReduced(o, None, CollectiveStats(), in_rank_order))
        assert check_laid_out(sliced, sliced_plan) == expected
