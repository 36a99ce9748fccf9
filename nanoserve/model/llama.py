"""The Llama forward as plain math: RMSNorm, rotary embeddings, GQA attention over paged K/V, SwiGLU.

Every family nanoserve runs (nanoserve.model.config) is this one forward with switches: a bias after
a projection, a per-head norm of q and k, norms on the sublayers' outputs, a scaled embedding, the
gate's activation, soft-capped scores and logits, a sliding window on some layers, rope on part of
each head, a second rope table for the windowed layers, layers without rope, a norm over the whole q
and k projections, and a mixture of experts in place of the MLP (nanoserve.model.moe). A switch that
is off costs nothing: its weight is None or its number is the plain one.

Dimension names: T tokens this step, R rows that sample, E hidden, H / Hkv heads, D head dim,
I the gated MLP's width, V vocabulary.

Precision: the matmuls, rope, attention and the KV cache run in the model's dtype (shape.dtype);
the residual stream h, the norms' statistics and weights, and the logits stay float32 whatever it
is. A bf16 residual stream, as transformers keeps it, cost accuracy for no speed (the default model
on the GGUF's Q4_1, 1,536 tokens of data/quantbench.txt: teacher-forced top-1 agreement with
float32 97.4% against 98.0% with a float32 residual, mean KL 0.0017 against 0.0015, decode rates
within noise at 1 and 16 slots).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from nanoserve.model.attention import AttentionMetadata, paged_attention
from nanoserve.model.config import PHI3, LlamaConfig, expected_shapes
from nanoserve.model.driver import Driver
from nanoserve.model.forms import Weight, as_weight
from nanoserve.model.kv_cache import KVCache
from nanoserve.model.moe import MoeWeights, from_tensors, moe_mlp, unfuse_experts
from nanoserve.model.quant import Stored, cat_rows, embedding
from nanoserve.model.rope import apply_rope, local_rope_table, rope_table


@dataclass
class ModelInputs:
    """What one step forwards. Built by nanoserve.inputs.build_inputs, the one place tensors are born."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its own sequence
    logits_indices: torch.Tensor  # [R] int64: the rows of T whose next token is sampled
    attn: AttentionMetadata
    pooled_indices: torch.Tensor | None = None  # [P] int64: rows whose final-normed state is returned, no head


MATMULS = ("qkv", "o", "gate_up", "down")  # a layer's matmul weights, in the order a step runs them


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [E] float32, as every norm weight (Gemma's (1 + w) already added)
    qkv: Weight  # [(H + 2 Hkv) D, E]: q, k, v projections fused into one matmul
    o: Weight  # [E, H D]
    post_norm: torch.Tensor  # [E]: the norm before the MLP (Gemma 2's pre_feedforward_layernorm)
    gate_up: Weight | None  # [2 I, E]: gate and up fused into one matmul; None where `moe` is the MLP
    down: Weight | None  # [E, I]
    # Family switches: None where the family has no such weight.
    qkv_bias: torch.Tensor | None = None  # [(H + 2 Hkv) D] in the model's dtype (Qwen2)
    o_bias: torch.Tensor | None = None  # [E] in the model's dtype
    q_norm: torch.Tensor | None = None  # [D]: RMSNorm over each query head's D, before rope (Qwen3)
    k_norm: torch.Tensor | None = None  # [D]: the same over each key head
    attn_out_norm: torch.Tensor | None = None  # [E]: on attention's output, before the residual add (Gemma 2)
    mlp_out_norm: torch.Tensor | None = None  # [E]: on the MLP's output, before the residual add (Gemma 2)
    q_whole_norm: torch.Tensor | None = None  # [H D]: RMSNorm over the whole query projection, before rope (OLMoE)
    k_whole_norm: torch.Tensor | None = None  # [Hkv D]: the same over the key projection
    moe: MoeWeights | None = None  # the mixture of experts in place of gate_up and down (a sparse layer)


@dataclass(frozen=True)
class LayerShape:
    num_heads: int  # H
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    eps: float
    dtype: torch.dtype = torch.float32  # the matmuls' and attention's; the residual stream is float32
    activation: str = "silu"  # the MLP gate's: "silu" or "gelu_pytorch_tanh"
    attn_scale: float | None = None  # what scores q . k are multiplied by; None: D ** -0.5
    attn_softcap: float | None = None  # c: scores become c tanh(scores / c) before the softmax


def decoder_layer(h: torch.Tensor, layer: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, attn_meta: AttentionMetadata, shape: LayerShape) -> torch.Tensor:
    """One pre-norm block: h [T, E] -> [T, E]. Attention writes this layer's K/V into its cache.
    cos, sin [T, 1, Dr]: this layer's rope (Dr < D rotates each head's first Dr); None: no rope."""
    H, Hkv, D, eps = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.eps
    T = h.shape[0]
    x = F.rms_norm(h, layer.input_norm.shape, layer.input_norm, eps).to(shape.dtype)  # [T, E]
    qkv = layer.qkv(x)  # [T, (H + 2 Hkv) D]
    if layer.qkv_bias is not None:  # after the matmul, so it holds for every form of the weight
        qkv = qkv + layer.qkv_bias
    if layer.q_whole_norm is not None:
        qkv = whole_qk_norm(qkv, layer, eps)
    qk, v = qkv.split([(H + Hkv) * D, Hkv * D], dim=-1)  # [T, (H + Hkv) D], [T, Hkv D]
    qk = qk.view(T, H + Hkv, D)  # the query heads, then the key heads
    if layer.q_norm is not None:  # each head's D normed, in float32 as every norm
        q, k = qk.split([H, Hkv], dim=1)
        qk = torch.cat([F.rms_norm(q.float(), layer.q_norm.shape, layer.q_norm, eps),
                        F.rms_norm(k.float(), layer.k_norm.shape, layer.k_norm, eps)], dim=1).to(shape.dtype)
    # One rotation for the query and key heads together: the same elementwise arithmetic as two, in
    # half the operations (a decode step's glue is dozens of small operations a layer).
    if cos is not None:  # None: a layer without rope (SmolLM3's NoPE layers)
        qk = apply_rope(qk, cos, sin)
    q, k = qk.split([H, Hkv], dim=1)  # [T, H, D], [T, Hkv, D]
    attn = paged_attention(q, k, v.view(T, Hkv, D), k_cache, v_cache, attn_meta,
                           shape.attn_scale, shape.attn_softcap)  # [T, H, D]
    out = layer.o(attn.reshape(T, H * D))  # [T, E]
    if layer.o_bias is not None:
        out = out + layer.o_bias
    if layer.attn_out_norm is not None:
        out = F.rms_norm(out.float(), layer.attn_out_norm.shape, layer.attn_out_norm, eps)
    h = h + out  # [T, E] float32
    x = F.rms_norm(h, layer.post_norm.shape, layer.post_norm, eps).to(shape.dtype)
    if layer.moe is not None:
        out = moe_mlp(x, layer.moe, shape.activation)  # [T, E]
    else:
        gate, up = layer.gate_up(x).chunk(2, dim=-1)  # [T, I] each
        gate = F.silu(gate) if shape.activation == "silu" else F.gelu(gate, approximate="tanh")
        out = layer.down(gate * up)  # [T, E]
    if layer.mlp_out_norm is not None:
        out = F.rms_norm(out.float(), layer.mlp_out_norm.shape, layer.mlp_out_norm, eps)
    return h + out  # [T, E] float32: h + the dtype's output


def whole_qk_norm(qkv: torch.Tensor, layer: LayerWeights, eps: float) -> torch.Tensor:
    """qkv [T, (H + 2 Hkv) D] with q and k each normed over its whole projection, in float32 as every norm."""
    q_width, k_width = layer.q_whole_norm.shape[0], layer.k_whole_norm.shape[0]  # H D, Hkv D
    q, k, v = qkv.split([q_width, k_width, qkv.shape[-1] - q_width - k_width], dim=-1)
    return torch.cat([F.rms_norm(q.float(), layer.q_whole_norm.shape, layer.q_whole_norm, eps).to(qkv.dtype),
                      F.rms_norm(k.float(), layer.k_whole_norm.shape, layer.k_whole_norm, eps).to(qkv.dtype), v],
                     dim=-1)


# A step's decoder layers: (model, h [T, E] float32 after the embedding, inputs, kv) -> h after the last layer.
Step = Callable[["LlamaModel", torch.Tensor, ModelInputs, KVCache], torch.Tensor]


def run_layers(model: LlamaModel, h: torch.Tensor, inputs: ModelInputs, kv: KVCache,
               layer_fn: Callable[..., torch.Tensor] = decoder_layer) -> torch.Tensor:
    """The torch drivers: every layer through `layer_fn` (decoder_layer, or its compiled graph)."""
    windowed = inputs.attn.windowed or inputs.attn  # windowed None: no context in this step is longer than the window
    ropes = layer_ropes(model, inputs.positions)
    for i, layer in enumerate(model.layers):
        attn = windowed if i in model.sliding_layers else inputs.attn
        h = layer_fn(h, layer, *ropes[i], kv.k[i], kv.v[i], attn, model.shape)
    return h


def layer_ropes(model: LlamaModel, positions: torch.Tensor) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Each layer's (cos, sin) [T, 1, Dr] at positions [T]: the model's table, the windowed layers' own
    where it has one (Gemma 3), (None, None) for a layer without rope (SmolLM3)."""
    full = (model.cos[positions].unsqueeze(1), model.sin[positions].unsqueeze(1))  # [T, 1, Dr] each
    local = full if model.local_rope is None else tuple(t[positions].unsqueeze(1) for t in model.local_rope)
    return [(None, None) if i in model.no_rope_layers else local if i in model.sliding_layers else full
            for i in range(len(model.layers))]


def layer_shape(config: LlamaConfig, dtype: torch.dtype) -> LayerShape:
    scalar = config.query_pre_attn_scalar  # None: attention's own D ** -0.5
    return LayerShape(config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps, dtype,
                      config.hidden_act, None if scalar is None else scalar ** -0.5, config.attn_logit_softcap)


def embedding_scale(config: LlamaConfig, dtype: torch.dtype) -> float | None:
    """What the embedding is multiplied by (None: nothing): sqrt(E) rounded to the model's dtype, as
    Gemma's checkpoints were trained with it (sqrt(3072) = 55.43 is 55.5 in bfloat16)."""
    return torch.tensor(math.sqrt(config.hidden_size), dtype=dtype).item() if config.embed_scale else None


class LlamaModel:
    """Weights and the forward pass. Call it under torch.inference_mode()."""

    def __init__(self, config: LlamaConfig, embed: torch.Tensor | Stored, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: Weight, max_positions: int | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.config = config
        self.embed = embed  # [V, E], dense or as stored (a lookup dequantizes its rows)
        self.layers = layers
        self.norm = norm  # [E] float32, as every norm weight
        self.lm_head = lm_head  # [V, E] as loaded, the same object as embed when tied
        self.dtype = dtype or norm.dtype  # the matmuls' dtype (see the module docstring)
        self.device = norm.device
        # The table covers the positions the engine will use, not the model's 128k maximum.
        num_positions = min(max_positions or config.max_position_embeddings, config.max_position_embeddings)
        self.cos, self.sin = rope_table(config, num_positions, self.dtype, self.device)  # [P, Dr]
        self.local_rope = local_rope_table(config, num_positions, self.dtype, self.device)  # windowed layers' (cos, sin), or None
        self.no_rope_layers = frozenset(config.no_rope_layers)
        self.shape = layer_shape(config, self.dtype)
        self.embed_scale = embedding_scale(config, self.dtype)
        self.sliding_layers = frozenset(config.sliding_layers)  # layers that attend within config.sliding_window
        self.lm_head_weight = as_weight(lm_head)  # the head as a weight (nanoserve.model.forms), laid out by prepare_model
        # How steps run (nanoserve.model.prepare sets both): the plan forward asks which driver runs
        # each step (None: every step on decoder_layer, as loaded), and the table it calls it from.
        self.plan: Any = None  # an ExecutionPlan (nanoserve.model.plan, which imports this module)
        self.drivers: dict[Driver, Step] = {Driver.TORCH: run_layers}
        # What fused_decode.c reads (nanoserve.model.fused_decode.FusedDecode), where a driver is in C.
        self.fused_layers: Any = None

    @classmethod
    def from_state_dict(cls, config: LlamaConfig, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                        device: torch.device | str, max_positions: int | None = None) -> LlamaModel:
        """Builds the model from Hugging Face-named tensors.

        Raises:
            ValueError: naming a missing tensor, or a tensor whose shape differs, with both shapes.
        """
        tensors = unfuse_experts(tensors, config)  # a state_dict's [X, ...] experts as a checkpoint stores them
        for name, shape in expected_shapes(config).items():
            if name not in tensors:
                raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {list(shape)})")
            got = tuple(tensors[name].shape)
            if got != shape:
                raise ValueError(f"tensor {name!r} has shape {list(got)}, expected {list(shape)}")

        def get(name: str) -> torch.Tensor | Stored:
            value = tensors[name]  # a quantized matrix stays as stored: prepare_model chooses its form
            return value.to(device=device, dtype=dtype) if isinstance(value, torch.Tensor) else value

        def norm(name: str) -> torch.Tensor:
            weight = tensors[name].to(device=device, dtype=torch.float32)
            return 1.0 + weight if config.norm_offset else weight  # Gemma's norms scale by (1 + w)

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            # Gemma 2's post_attention_layernorm norms attention's output; its pre_feedforward_layernorm
            # is what Llama calls post_attention_layernorm, the norm before the MLP.
            sandwich, sparse, whole = config.sandwich_norms, config.is_sparse(i), config.qk_norm_whole
            fused = config.architecture == PHI3  # Phi-3's checkpoints hold qkv and gate_up fused already
            layers.append(LayerWeights(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=as_weight(get(attn + "qkv_proj.weight") if fused else
                              cat_rows([get(attn + f"{n}_proj.weight") for n in "qkv"])),
                o=as_weight(get(attn + "o_proj.weight")),
                post_norm=norm(p + ("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight")),
                gate_up=None if sparse else as_weight(get(p + "mlp.gate_up_proj.weight") if fused else
                                                      cat_rows([get(p + "mlp.gate_proj.weight"),
                                                                get(p + "mlp.up_proj.weight")])),
                down=None if sparse else as_weight(get(p + "mlp.down_proj.weight")),
                qkv_bias=torch.cat([get(attn + f"{n}_proj.bias") for n in "qkv"]) if config.qkv_bias else None,
                o_bias=get(attn + "o_proj.bias") if config.o_bias else None,
                q_norm=norm(attn + "q_norm.weight") if config.qk_norm else None,
                k_norm=norm(attn + "k_norm.weight") if config.qk_norm else None,
                attn_out_norm=norm(p + "post_attention_layernorm.weight") if sandwich else None,
                mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if sandwich else None,
                q_whole_norm=norm(attn + "q_norm.weight") if whole else None,
                k_whole_norm=norm(attn + "k_norm.weight") if whole else None,
                moe=from_tensors(config, i, get, as_weight, cat_rows) if sparse else None,
            ))
        embed = get("model.embed_tokens.weight")
        lm_head = embed if config.tie_word_embeddings else get("lm_head.weight")
        return cls(config, embed, layers, norm("model.norm.weight"), lm_head, max_positions, dtype)

    def forward(self, inputs: ModelInputs, kv: KVCache) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Runs one step and returns logits [R, V] for the rows that sample, in float32; where
        inputs.pooled_indices is set, (logits, hidden [P, E]): those rows after the final norm, in
        float32 (what transformers calls last_hidden_state), the head not run on them.

        Raises:
            ValueError: when the model has windowed layers and inputs.attn was built for another window.
        """
        config = self.config
        window = config.sliding_window
        if window is not None and inputs.attn.sliding_window != window:
            raise ValueError(f"layers {sorted(self.sliding_layers)} attend within a sliding window of {window} tokens, "
                             f"but the inputs were built with sliding_window={inputs.attn.sliding_window}")
        h = embedding(inputs.input_ids, self.embed, torch.float32)  # [T, E]
        if self.embed_scale is not None:
            h = h * self.embed_scale
        driver = Driver.TORCH if self.plan is None else self.plan.driver(h.shape[0], not inputs.attn.prefill_runs)
        h = self.drivers[driver](self, h, inputs, kv)
        # Only the rows that sample need the norm and the [E, V] head: the rest of T is prefill.
        # Pooled rows (an embedding's) need the norm only.
        pooled = inputs.pooled_indices
        rows = inputs.logits_indices if pooled is None else torch.cat([inputs.logits_indices, pooled])  # [R + P]
        normed = F.rms_norm(h[rows], self.norm.shape, self.norm, config.rms_norm_eps)  # [R + P, E] float32
        R = inputs.logits_indices.shape[0]
        logits = self.lm_head_weight(normed[:R].to(self.dtype)).float()  # [R, V]
        cap = config.final_logit_softcap
        logits = logits if cap is None else cap * torch.tanh(logits / cap)
        return logits if pooled is None else (logits, normed[R:])  # [R, V], [P, E]

    def matrices(self) -> list[tuple[int | None, str, Weight]]:
        """Every matmul weight: (layer index, or None for the head; its name; the weight). A sparse
        layer's experts share a name (MoeWeights.matrices), one entry each."""
        found = []
        for i, layer in enumerate(self.layers):
            found += [(i, name, getattr(layer, name)) for name in MATMULS if getattr(layer, name) is not None]
            found += [(i, name, w) for name, w in (layer.moe.matrices() if layer.moe is not None else ())]
        return found + [(None, "head", self.lm_head_weight)]

    __call__ = forward
