"""Carrying out an execution plan (nanoserve.model.plan): each function returns a new LlamaModel and
leaves the one it was given as it was, so two engines built from one loaded model never share a change.

The weights a preparation does not touch (norms, the embedding) are shared between the two models,
not copied.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch

from nanoserve.model import blockdot
from nanoserve.model.driver import Driver
from nanoserve.model.forms import STORED, Dense, Form, FormKind, Weight, as_weight, pack
from nanoserve.model.fused_decode import fused_decode
from nanoserve.model.gguf import FileBlocks
from nanoserve.model.llama import (
    MATMULS,
    LayerWeights,
    LlamaModel,
    Step,
    decoder_layer,
    embedding_scale,
    run_layers,
)
from nanoserve.model.plan import STEPS, ExecutionPlan, check_laid_out
from nanoserve.model.precision import DTYPES
from nanoserve.model.quant import QuantLinear, quant_linear, quantize_int4, quantize_int8
from nanoserve.model.rope import local_rope_table, rope_table


def _laid_out_weight(w: Weight, form: Form, pack_weights: bool) -> Weight:
    """`w` in `form`: itself where it is in that form already, else built from its dense matrix or
    its stored quantized one (a tensor-parallel slice keeps its all-reduce, summed as the form says).
    A matrix still in its file is decoded here, and its codes are garbage once laid out: a layout
    holds one matrix's codes at a time."""
    if w.form == form:
        return w
    if isinstance(w, FileBlocks):
        w = w.decode()
    if form.all_reduced:  # a tensor-parallel slice: its matrix laid out, its all-reduce kept
        inner = _laid_out_weight(w.inner, dataclasses.replace(form, all_reduced=False, in_rank_order=False),
                                 pack_weights)
        return w.with_inner(inner, form.in_rank_order)
    dtype = DTYPES[form.dtype]
    if form.name == FormKind.TORCH:
        return Dense(w.dequantize(dtype))
    if form.name == FormKind.ONEDNN:
        return pack(w.dequantize(dtype))
    if form.name == FormKind.DENSE_PANELS:
        return blockdot.pack_dense(w.dequantize(dtype))
    if form.name == FormKind.TORCH_INT8:
        stored = w if w.form.stored == "int8" else quantize_int8(w.dequantize())
    elif form.name in (FormKind.BLOCKDOT, FormKind.BLOCKDOT_INT8, FormKind.TORCH_INT4):
        stored = w if w.form.name == STORED and w.form.stored != "int8" else quantize_int4(w.dequantize())
    else:
        raise ValueError(f"no weight is laid out as {form}")
    return quant_linear(stored, dtype, form.kernel_rows, pack_weights,
                        KERNEL_OF.get(form.name, "torch"), form.int16_rows,
                        form.wide == "dense copy", form.amx_rows)


KERNEL_OF = {FormKind.BLOCKDOT: "blockdot", FormKind.BLOCKDOT_INT8: "blockdot-int8"}  # quant_linear's kernels


def laid_out(model: LlamaModel, plan: ExecutionPlan) -> LlamaModel:
    """A model whose matmul weights are in the plan's forms and which computes in its dtype; a dense
    embedding follows the dtype (a quantized one stays as stored, its bytes copied out of the file
    where it was still there: a lookup decodes its rows);
    the norms stay float32, as the residual stream does. `model` itself where nothing changes.

    Raises:
        ValueError: a model already compiled.
    """
    if Driver.TORCH_COMPILED in model.drivers:
        raise ValueError("lay a model out before compiling it: the compiled graph reads plain tensors")
    dtype = plan.torch_dtype

    def layer_of(i: int, layer: LayerWeights) -> LayerWeights:
        weights = {name: _laid_out_weight(getattr(layer, name), plan.form_of(i, name), plan.pack_weights)
                   for name in MATMULS if getattr(layer, name) is not None}
        if layer.moe is not None:  # each expert's matrices in their name's form, like any other matrix
            weights["moe"] = layer.moe.map(lambda name, w: _laid_out_weight(w, plan.form_of(i, name), plan.pack_weights))
        biases = {name: getattr(layer, name).to(dtype) for name in ("qkv_bias", "o_bias") if getattr(layer, name) is not None}
        return dataclasses.replace(layer, **weights, **biases)

    layers = [layer_of(i, layer) for i, layer in enumerate(model.layers)]
    head = _laid_out_weight(model.lm_head_weight, plan.form_of(None, "head"), plan.pack_weights)
    unchanged = dtype == model.dtype and head is model.lm_head_weight and all(
        getattr(new, name) is getattr(old, name) for new, old in zip(layers, model.layers, strict=True)
        for name in MATMULS + ("moe",))
    if unchanged:
        return model
    prepared = copy.copy(model)
    prepared.layers = layers
    prepared.embed = (model.embed.to(dtype) if isinstance(model.embed, torch.Tensor)
                      else model.embed.in_memory() if isinstance(model.embed, FileBlocks) else model.embed)
    if model.lm_head is model.embed and isinstance(head, QuantLinear) and head.looks_up:
        prepared.embed = head  # a tied table on file-bit panels: lookups read the head's rows, held once
    prepared.lm_head = prepared.embed if model.lm_head is model.embed else model.lm_head
    prepared.lm_head_weight = head
    prepared.dtype = dtype
    prepared.shape = dataclasses.replace(model.shape, dtype=dtype)
    prepared.embed_scale = embedding_scale(model.config, dtype)
    if dtype != model.dtype:
        prepared.cos, prepared.sin = rope_table(model.config, model.cos.shape[0], dtype, model.device)
        prepared.local_rope = local_rope_table(model.config, model.cos.shape[0], dtype, model.device)
    return prepared


def compiled_layers(model: LlamaModel) -> Step:
    """Driver.TORCH_COMPILED's entry for a laid-out model: its decoder layer through torch.compile
    (one graph shared by all layers, dynamic in T, B and L); the first steps of each new shape kind
    pay the compile.

    Raises:
        ValueError: a matrix in a form the compiled graph cannot trace (oneDNN-packed, blockdot's).
    """
    traced = (FormKind.TORCH, FormKind.TORCH_INT4, FormKind.TORCH_INT8, STORED)
    untraceable = sorted({str(w.form) for _, _, w in model.matrices() if w.form.name not in traced})
    if untraceable:
        raise ValueError(f"torch.compile traces torch's own forms {[str(t) for t in traced]}; this model has "
                         f"{untraceable}: build the engine from the loaded model with compile=True")
    return functools.partial(run_layers, layer_fn=torch.compile(decoder_layer, dynamic=True))


def prepare_model(model: LlamaModel, plan: ExecutionPlan) -> LlamaModel:
    """The model an engine runs: a copy of `model` laid out as `plan` says (each matmul in its form,
    the dtype), dispatching its steps by the plan, with its table of drivers (STEPS' entries for the
    drivers the plan routes to) and, where a driver is in C, what fused_decode.c reads; `model`
    itself where it is laid out so already. check_laid_out holds the result to the plan."""
    prepared = laid_out(model, plan)
    if prepared is model and not check_laid_out(model, plan):
        return model
    prepared = copy.copy(prepared) if prepared is model else prepared  # the given model's plan and table stay its own
    table = dict(STEPS)
    if Driver.TORCH_COMPILED in plan.drivers:
        table[Driver.TORCH_COMPILED] = compiled_layers(prepared)
    prepared.plan = plan
    prepared.drivers = {driver: table[driver] for driver in plan.drivers}
    in_c = any(driver.in_c for driver in plan.drivers)
    prepared.fused_layers = fused_decode(prepared, Driver.C_ONE_CALL in plan.drivers, plan.int16_rows,
                                          plan.amx_rows) if in_c else None
    return prepared


def weight_bytes(model: LlamaModel) -> dict[str, int]:
    """Bytes the model's weights hold, by form: dense (plain, oneDNN-packed or dense panels), quantized (the
    kernels' layouts), dense_copies (what quantized linears keep to read past max_kernel_rows), stored
    (quantized matrices as loaded, such as a GGUF embedding that lookups dequantize by row) and
    fused_copies (dense panels copied from torch's dense matrices, what a dense model's one-call
    decode reads where torch runs its other steps)."""
    total = {"dense": 0, "quantized": 0, "dense_copies": 0, "stored": 0,
             "fused_copies": getattr(model.fused_layers, "copy_bytes", 0)}
    tensors = [model.norm] + [t for layer in model.layers
                              for t in (layer.input_norm, layer.post_norm, layer.qkv_bias, layer.o_bias, layer.q_norm,
                                        layer.k_norm, layer.attn_out_norm, layer.mlp_out_norm, layer.q_whole_norm,
                                        layer.k_whole_norm) if t is not None]
    total["dense"] += sum(t.nbytes for t in tensors)
    parts = [as_weight(model.embed).nbytes_by_kind()] + [w.nbytes_by_kind() for _, _, w in model.matrices()
                                                         if w is not model.embed]
    for part in parts:
        for key, value in part.items():
            total[key] += value
    return total
