"""Carrying out an execution plan (nanoserve.model.plan): each function returns a new LlamaModel and
leaves the one it was given as it was, so two engines built from one loaded model never share a change.

The weights a preparation does not touch (norms, the embedding) are shared between the two models,
not copied.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from nanoserve.model import blockdot
from nanoserve.model.forms import QUANTIZED_FORMS, STORED, Dense, Form, Weight, as_weight, pack
from nanoserve.model.fused_decode import fused_decode
from nanoserve.model.llama import MATMULS, LayerWeights, LlamaModel, decoder_layer, embedding_scale
from nanoserve.model.plan import ExecutionPlan
from nanoserve.model.precision import DTYPES
from nanoserve.model.quant import quant_linear, quantize_int4, quantize_int8
from nanoserve.model.rope import rope_table


def _laid_out_weight(w: Weight, form: Form, pack_weights: bool, in_rank_order: bool = False) -> Weight:
    """`w` in `form`: itself where it is in that form already, else built from its dense matrix or
    its stored quantized one. in_rank_order: a tensor-parallel slice's partials summed in rank order
    (the batch-invariant plan's)."""
    if form.all_reduced:  # a tensor-parallel slice: its matrix laid out, its all-reduce kept
        if w.form == form and w.in_rank_order == in_rank_order:
            return w
        inner = _laid_out_weight(w.inner, dataclasses.replace(form, all_reduced=False), pack_weights)
        return w.with_inner(inner, in_rank_order)
    if w.form == form:
        return w
    dtype = DTYPES[form.dtype]
    if form.name == "torch":
        return Dense(w.dequantize(dtype))
    if form.name == "onednn":
        return pack(w.dequantize(dtype))
    if form.name == "dense-panels":
        return blockdot.pack_dense(w.dequantize(dtype))
    if form.name not in QUANTIZED_FORMS:
        raise ValueError(f"no weight is laid out as {form}")
    if form.name == "torch-int8":
        stored = w if w.form.stored == "int8" else quantize_int8(w.dequantize())
    else:
        stored = w if w.form.name == STORED and w.form.stored != "int8" else quantize_int4(w.dequantize())
    return quant_linear(stored, dtype, form.kernel_rows, pack_weights, "blockdot" if form.name == "blockdot" else "torch",
                        form.int16_rows, form.wide == "dense copy")


def laid_out(model: LlamaModel, plan: ExecutionPlan) -> LlamaModel:
    """A model whose matmul weights are in the plan's forms and which computes in its dtype; a dense
    embedding follows the dtype (a quantized one stays as stored: a lookup dequantizes its rows);
    the norms stay float32, as the residual stream does. `model` itself where nothing changes.

    Raises:
        ValueError: a model already compiled.
    """
    if model.layer_fn is not decoder_layer:
        raise ValueError("lay a model out before compiling it: the compiled graph reads plain tensors")
    dtype = plan.torch_dtype

    def layer_of(i: int, layer: LayerWeights) -> LayerWeights:
        weights = {name: _laid_out_weight(getattr(layer, name), plan.form_of(i, name), plan.pack_weights,
                                          plan.is_batch_invariant) for name in MATMULS}
        biases = {name: getattr(layer, name).to(dtype) for name in ("qkv_bias", "o_bias") if getattr(layer, name) is not None}
        return dataclasses.replace(layer, **weights, **biases)

    layers = [layer_of(i, layer) for i, layer in enumerate(model.layers)]
    head = _laid_out_weight(model.lm_head_weight, plan.form_of(None, "head"), plan.pack_weights)
    unchanged = dtype == model.dtype and head is model.lm_head_weight and all(
        getattr(new, name) is getattr(old, name) for new, old in zip(layers, model.layers, strict=True) for name in MATMULS)
    if unchanged:
        return model
    prepared = copy.copy(model)
    prepared.fused_layers = None  # built over the given model's layers; prepare_model builds one for these
    prepared.layers = layers
    prepared.embed = model.embed.to(dtype) if isinstance(model.embed, torch.Tensor) else model.embed
    prepared.lm_head = prepared.embed if model.lm_head is model.embed else model.lm_head
    prepared.lm_head_weight = head
    prepared.dtype = dtype
    prepared.shape = dataclasses.replace(model.shape, dtype=dtype)
    prepared.embed_scale = embedding_scale(model.config, dtype)
    if dtype != model.dtype:
        prepared.cos, prepared.sin = rope_table(model.config, model.cos.shape[0], dtype, model.device)
    return prepared


def compiled(model: LlamaModel) -> LlamaModel:
    """A model whose decoder layer runs through torch.compile (one graph shared by all layers,
    dynamic in T, B and L); the first steps of each new shape kind pay the compile.

    Raises:
        ValueError: a matrix in a form the compiled graph cannot trace (oneDNN-packed, blockdot's).
    """
    traced = ("torch", "torch-int4", "torch-int8", STORED)
    untraceable = sorted({str(w.form) for _, _, w in model.matrices() if w.form.name not in traced})
    if untraceable:
        raise ValueError(f"torch.compile traces torch's own forms {list(traced)}; this model has {untraceable}: "
                         "build the engine from the loaded model with compile=True")
    if model.layer_fn is not decoder_layer:
        return model
    prepared = copy.copy(model)
    prepared.fused_layers = None  # the compiled layer runs every step
    prepared.layer_fn = torch.compile(decoder_layer, dynamic=True)
    return prepared


def is_quantized(model: LlamaModel) -> bool:
    """Whether any matmul weight of a loaded model is a quantized matrix as stored."""
    return any(w.form.name == STORED for _, _, w in model.matrices())


def prepare_model(model: LlamaModel, plan: ExecutionPlan) -> LlamaModel:
    """The model an engine runs: `model` laid out as `plan` says (each matmul in its form, the
    dtype), compiled where the plan's mixed driver is, with the fused decode where its decode driver
    is C; `model` itself when nothing changes. check_laid_out holds the result to the plan."""
    prepared = laid_out(model, plan)
    if plan.mixed == "torch-compiled":
        return compiled(prepared)
    fused = (fused_decode(prepared, plan.one_call_rows, plan.form_of(0, "qkv").int16_rows, plan.mixed.startswith("c-"))
             if plan.decode.startswith("c-") else None)
    if fused is not None or prepared.fused_layers is not None:  # a given model's own is not this engine's
        prepared = copy.copy(prepared) if prepared is model else prepared
        prepared.fused_layers = fused
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
                                        layer.k_norm, layer.attn_out_norm, layer.mlp_out_norm) if t is not None]
    total["dense"] += sum(t.nbytes for t in tensors)
    parts = [as_weight(model.embed).nbytes_by_kind()] + [w.nbytes_by_kind() for _, _, w in model.matrices()
                                                         if w is not model.embed]
    for part in parts:
        for key, value in part.items():
            total[key] += value
    return total
