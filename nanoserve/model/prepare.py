"""Preparing a loaded model for the machine: each function returns a new LlamaModel and leaves the
one it was given as it was, so two engines built from one loaded model never share a change.

The weights a preparation does not touch (norms, the embedding) are shared between the two models,
not copied.
"""

from __future__ import annotations

import copy

import torch

from nanoserve.model.llama import LayerWeights, LlamaModel, can_pack, decoder_layer, pack_linear_weight


def packed(model: LlamaModel) -> LlamaModel:
    """A model whose matmul weights are reordered once into oneDNN's packed layout (see
    pack_linear_weight). The embedding stays plain for its lookup, so a tied head costs one extra
    [V, E] copy. Returns `model` itself when there is nothing to pack: already packed, not float32
    on a CPU with oneDNN, or compiled (the compiled graph reads plain tensors)."""
    if model.packed or not can_pack(model.lm_head) or model.layer_fn is not decoder_layer:
        return model
    prepared = copy.copy(model)
    prepared.layers = [
        LayerWeights(input_norm=layer.input_norm, qkv=pack_linear_weight(layer.qkv), o=pack_linear_weight(layer.o),
                     post_norm=layer.post_norm, gate_up=pack_linear_weight(layer.gate_up),
                     down=pack_linear_weight(layer.down))
        for layer in model.layers
    ]
    prepared.lm_head_weight = pack_linear_weight(model.lm_head)
    return prepared


def compiled(model: LlamaModel) -> LlamaModel:
    """A model whose decoder layer runs through torch.compile (one graph shared by all layers,
    dynamic in T, B and L); the first steps of each new shape kind pay the compile.

    Raises:
        ValueError: when the weights are packed: the compiled graph reads plain tensors.
    """
    if model.packed:
        raise ValueError("the model's weights are packed for oneDNN (pack_weights=True); torch.compile needs "
                         "plain weights: build the engine from the loaded model with pack_weights=False")
    if model.layer_fn is not decoder_layer:
        return model
    prepared = copy.copy(model)
    prepared.layer_fn = torch.compile(decoder_layer, dynamic=True)
    return prepared


def prepare_model(model: LlamaModel, *, pack_weights: bool, compile: bool) -> LlamaModel:
    """The model an engine runs: compiled, or packed, or `model` itself as it was loaded."""
    if compile:
        return compiled(model)
    return packed(model) if pack_weights else model
