"""Preparing a loaded model for the machine: each function returns a new LlamaModel and leaves the
one it was given as it was, so two engines built from one loaded model never share a change.

The weights a preparation does not touch (norms, the embedding) are shared between the two models,
not copied.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from nanoserve.model import blockdot
from nanoserve.model.fused_decode import fused_decode
from nanoserve.model.llama import LayerWeights, LlamaModel, Weight, decoder_layer, embedding_scale
from nanoserve.model.quant import (
    ChannelInt8,
    QuantLinear,
    Stored,
    can_pack,
    dense_of,
    pack_linear_weight,
    quant_linear,
    quantize_int4,
    quantize_int8,
)
from nanoserve.model.rope import rope_table
from nanoserve.model.shard import AllReduced

QUANTIZATIONS = ("int8", "int4", "keep")  # and None: dense


@dataclass(frozen=True)
class Layout:
    """What every matmul weight becomes.

    quantization: None (dense in dtype), "int8" (per output channel), "int4" (groups of 32; the
        head in int8), or "keep" (a checkpoint's own quantized matrices in kernel form, the others
        dense).
    max_kernel_rows: past this many rows a quantized linear multiplies by its dense matrix; None:
        the kernels take every row count.
    dense_copies: that dense matrix is a copy held for the model's life (else, on blockdot, its
        panels dequantized per call).
    kernels: "torch" or "blockdot", who runs the quantized linears' few-row passes (quant_linear).
    int16_rows: from this many rows blockdot rounds the activations to int16 (None: never).
    dense_panels: dense matrices (float32 or bf16, on the CPU) become blockdot's DensePanels, which
        run them at every width, in place of torch's (oneDNN-packed where pack_weights).
    """

    dtype: torch.dtype
    quantization: str | None = None
    max_kernel_rows: int | None = None
    pack_weights: bool = True
    kernels: str = "torch"
    int16_rows: int | None = None
    dense_copies: bool = True
    dense_panels: bool = False


def _linear_weight(w: Weight, layout: Layout, head: bool) -> Weight:
    if isinstance(w, AllReduced):  # a tensor-parallel slice: its matrix laid out, its all-reduce kept
        return w.with_inner(_linear_weight(w.inner, layout, head))
    if isinstance(w, (QuantLinear, blockdot.DensePanels)) or (isinstance(w, torch.Tensor) and w.is_mkldnn):
        return w  # already prepared
    stored: Stored | None = None
    if layout.quantization == "keep" and not isinstance(w, torch.Tensor):
        stored = w
    elif layout.quantization == "int8" or (layout.quantization == "int4" and head):
        stored = w if isinstance(w, ChannelInt8) else quantize_int8(dense_of(w))
    elif layout.quantization == "int4":
        stored = quantize_int4(dense_of(w))
    if stored is not None:
        return quant_linear(stored, layout.dtype, layout.max_kernel_rows, layout.pack_weights, layout.kernels,
                            layout.int16_rows, layout.dense_copies)
    dense = dense_of(w).to(layout.dtype)
    if layout.dense_panels and dense.dtype in blockdot.DTYPES and dense.device.type == "cpu":
        return blockdot.pack_dense(dense)
    return pack_linear_weight(dense) if layout.pack_weights and can_pack(dense) else dense


def laid_out(model: LlamaModel, layout: Layout) -> LlamaModel:
    """A model whose matmuls run in layout.dtype, their weights in the layout's form; a dense
    embedding follows the dtype (a quantized one stays as stored: a lookup dequantizes its rows);
    the norms stay float32, as the residual stream does.

    Raises:
        ValueError: an unknown quantization, or a model already compiled.
    """
    if layout.quantization not in (*QUANTIZATIONS, None):
        raise ValueError(f"quantization={layout.quantization!r} is not one of {[*QUANTIZATIONS, None]}")
    if model.layer_fn is not decoder_layer:
        raise ValueError("lay a model out before compiling it: the compiled graph reads plain tensors")
    dtype = layout.dtype
    prepared = copy.copy(model)
    prepared.fused_layers = None  # built over the given model's layers; prepare_model builds one for these
    prepared.layers = [_laid_out_layer(layer, layout) for layer in model.layers]
    prepared.embed = model.embed.to(dtype) if isinstance(model.embed, torch.Tensor) else model.embed
    prepared.lm_head = prepared.embed if model.lm_head is model.embed else model.lm_head
    prepared.lm_head_weight = _linear_weight(model.lm_head_weight, layout, True)  # a prepared head stays as it is
    prepared.dtype = dtype
    prepared.shape = dataclasses.replace(model.shape, dtype=dtype)
    prepared.embed_scale = embedding_scale(model.config, dtype)
    if dtype != model.dtype:
        prepared.cos, prepared.sin = rope_table(model.config, model.cos.shape[0], dtype, model.device)
    return prepared


def _laid_out_layer(layer: LayerWeights, layout: Layout) -> LayerWeights:
    """The layer's matmul weights in the layout's form and its biases in its dtype; norms as they were."""
    def bias(b: torch.Tensor | None) -> torch.Tensor | None:
        return None if b is None else b.to(layout.dtype)

    return dataclasses.replace(layer, qkv=_linear_weight(layer.qkv, layout, False), o=_linear_weight(layer.o, layout, False),
                               gate_up=_linear_weight(layer.gate_up, layout, False),
                               down=_linear_weight(layer.down, layout, False),
                               qkv_bias=bias(layer.qkv_bias), o_bias=bias(layer.o_bias))


def compiled(model: LlamaModel) -> LlamaModel:
    """A model whose decoder layer runs through torch.compile (one graph shared by all layers,
    dynamic in T, B and L); the first steps of each new shape kind pay the compile.

    Raises:
        ValueError: when the weights are packed (for oneDNN, or in dense panels): the compiled graph
            reads plain tensors.
    """
    if model.packed:
        raise ValueError("the model's weights are packed for oneDNN (pack_weights=True); torch.compile needs "
                         "plain weights: build the engine from the loaded model with pack_weights=False")
    if any(isinstance(w, blockdot.DensePanels) for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)):
        raise ValueError("the model's dense matrices are in blockdot's dense panels (dense_kernel='blockdot'); "
                         "torch.compile needs plain weights: build the engine from the loaded model with dense_kernel='torch'")
    if model.layer_fn is not decoder_layer:
        return model
    prepared = copy.copy(model)
    prepared.fused_layers = None  # the compiled layer runs every step
    prepared.layer_fn = torch.compile(decoder_layer, dynamic=True)
    return prepared


def packed(model: LlamaModel) -> LlamaModel:
    """A model whose dense matmul weights are reordered once into oneDNN's packed layout (see
    pack_linear_weight), in its own dtype. The embedding stays plain for its lookup, so a tied head
    costs one extra [V, E] copy. Returns `model` itself when there is nothing to pack."""
    if model.packed or not isinstance(model.lm_head, torch.Tensor) or not can_pack(model.lm_head) \
            or model.layer_fn is not decoder_layer:
        return model
    return laid_out(model, Layout(model.dtype, pack_weights=True))


def is_quantized(model: LlamaModel) -> bool:
    """Whether any matmul weight of a loaded model is a quantized matrix as stored."""
    weights = [model.lm_head_weight] + [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    weights = [w.inner if isinstance(w, AllReduced) else w for w in weights]
    return any(not isinstance(w, (torch.Tensor, QuantLinear, blockdot.DensePanels)) for w in weights)


def prepare_model(model: LlamaModel, *, pack_weights: bool, compile: bool, dtype: torch.dtype | None = None,
                  quantization: str | None = None, max_kernel_rows: int | None = None,
                  kernels: str = "torch", int16_rows: int | None = None, fuse_decode: bool = False,
                  bf16_one_call_rows: int | None = None, dense_copies: bool = True,
                  dense_kernel: str = "torch") -> LlamaModel:
    """The model an engine runs: laid out in `dtype` (default: the model's own) with the weights'
    quantization, then compiled, or `model` itself when nothing changes. fuse_decode: decode steps
    run their glue in C where the family allows it (nanoserve.model.fused_decode; bf16_one_call_rows:
    a bf16 model's one-call width, None for its default). dense_kernel "blockdot": the dense matrices
    on blockdot's dense panels (Layout.dense_panels), "torch": on torch's linears."""
    dtype = dtype or model.dtype
    dense_panels = dense_kernel == "blockdot" and not compile
    # A checkpoint's matrices as stored always need a form (kernels, or dense when quantization is None).
    needs_layout = dtype != model.dtype or quantization is not None or is_quantized(model) or dense_panels
    if compile:  # torch's kernels: a compiled graph cannot trace blockdot's foreign call
        if needs_layout:
            model = laid_out(model, Layout(dtype, quantization, max_kernel_rows, pack_weights=False))
        return compiled(model)
    if not needs_layout:
        prepared = packed(model) if pack_weights else model
    else:
        prepared = laid_out(model, Layout(dtype, quantization, max_kernel_rows, pack_weights, kernels, int16_rows,
                                          dense_copies, dense_panels))
    fused = fused_decode(prepared, bf16_one_call_rows) if fuse_decode else None  # None where why_not(prepared) says it cannot run
    if fused is not None or prepared.fused_layers is not None:  # a given model's own is not this engine's
        prepared = copy.copy(prepared) if prepared is model else prepared
        prepared.fused_layers = fused
    return prepared


def _nbytes(w: Weight) -> dict[str, int]:
    if isinstance(w, AllReduced):
        return _nbytes(w.inner)
    if isinstance(w, QuantLinear):
        return {"quantized": w.kernel_bytes, "dense_copies": w.dense_bytes}
    if isinstance(w, blockdot.DensePanels):
        return {"dense": w.nbytes}
    if isinstance(w, torch.Tensor):
        return {"dense": w.numel() * w.element_size()}  # numel: an oneDNN-packed tensor has no plain storage
    parts = [w.codes, w.scales] + ([w.mins] if getattr(w, "mins", None) is not None else [])
    return {"stored": sum(t.nbytes for t in parts)}


def weight_bytes(model: LlamaModel) -> dict[str, int]:
    """Bytes the model's weights hold, by form: dense (plain, oneDNN-packed or dense panels), quantized (the
    kernels' layouts), dense_copies (what quantized linears keep to read past max_kernel_rows), stored
    (quantized matrices as loaded, such as a GGUF embedding that lookups dequantize by row) and
    fused_copies (dense panels copied from torch's dense matrices, what a dense model's one-call
    decode reads where torch runs its other steps)."""
    total = {"dense": 0, "quantized": 0, "dense_copies": 0, "stored": 0,
             "fused_copies": getattr(model.fused_layers, "copy_bytes", 0)}
    weights: list[Weight] = [model.embed, model.norm]
    if model.lm_head_weight is not model.embed:
        weights.append(model.lm_head_weight)
    for layer in model.layers:
        weights += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down]
        weights += [w for w in (layer.qkv_bias, layer.o_bias, layer.q_norm, layer.k_norm, layer.attn_out_norm,
                                layer.mlp_out_norm) if w is not None]
    for w in weights:
        for key, value in _nbytes(w).items():
            total[key] += value
    return total
