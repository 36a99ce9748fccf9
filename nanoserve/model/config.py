"""LlamaConfig: the architecture numbers nanoserve reads from a checkpoint's config.json.

One forward (nanoserve.model.llama) runs every family here; a family is a set of switches on it,
read from the config and, where config.json does not say (Qwen2's q/k/v bias), from the
architecture's name:

- Llama: the plain pre-norm block (RMSNorm, rope, GQA, SwiGLU);
- Mistral: Llama, with every layer's attention limited to a sliding window when sliding_window is set;
- Qwen2 / Qwen2.5: a bias on the q, k and v projections; a window only when use_sliding_window is
  true, on the layers from max_window_layers on;
- Qwen3: RMSNorm over each head of q and k before rope; head_dim given apart from hidden / heads;
- Gemma: the embedding scaled by sqrt(E), norms scaling by (1 + w), tanh-approximated GELU gating;
- Gemma 2: Gemma, with norms on attention's and the MLP's outputs too, the attention scale from
  query_pre_attn_scalar, attention and final logits soft-capped, and alternating windowed layers;
- Gemma 3 (text): Gemma 2's sandwich norms and scale, q/k RMSNorm per head (by 1 + w), no soft-caps
  unless the config sets them, the windowed layers from layer_types (or sliding_window_pattern) with
  their own rope table (rope_local_base_freq, unscaled), the others rope_theta with its rope_scaling;
- Phi-3 / Phi-4-mini: q/k/v and gate/up fused in the checkpoint (qkv_proj, gate_up_proj), rope on
  the first partial_rotary_factor of each head's D, LongRoPE scaling (rope.py), every layer
  windowed when sliding_window is set;
- SmolLM3: Llama whose NoPE layers (no_rope_layers, or every no_rope_layer_interval-th) skip rope.

A multimodal checkpoint in LANGUAGE_MODELS (Gemma3ForConditionalGeneration) is read as its language
model: text_config, its tensors from under language_model (text_model_name), the vision tower left unread.
- the mixture-of-experts families (nanoserve.model.moe): the MLP a router over num_experts gated
  MLPs, each token's top_k of them run and summed by their routing weights. Qwen3-MoE: Qwen3's
  attention, some layers dense (mlp_only_layers, decoder_sparse_step); Mixtral: Mistral's
  attention, every layer sparse, the top_k weights renormalised; Qwen2-MoE: Qwen2's attention, a
  shared expert beside the routed ones, gated by sigmoid(shared_expert_gate(x)); OLMoE: Llama's
  attention with an RMSNorm over the whole q and k projections (not each head) before rope.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA, GEMMA2 = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
    "Gemma2ForCausalLM")
GEMMA3, PHI3, SMOLLM3 = "Gemma3ForCausalLM", "Phi3ForCausalLM", "SmolLM3ForCausalLM"
QWEN3_MOE, MIXTRAL, QWEN2_MOE, OLMOE = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                                        "OlmoeForCausalLM")
MOE_ARCHITECTURES = (QWEN3_MOE, MIXTRAL, QWEN2_MOE, OLMOE)
SUPPORTED_ARCHITECTURES = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA, GEMMA2, GEMMA3, PHI3, SMOLLM3) + MOE_ARCHITECTURES
# Architectures close to a supported one, refused with the feature the forward lacks.
REFUSED_ARCHITECTURES = {
    "DeepseekV3ForCausalLM": "multi-head latent attention (keys and values through a low-rank latent)",
    "Gemma3nForCausalLM": "per-layer embeddings and AltUp's several residual streams",
}
MODEL_TYPES = {"llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "qwen3": QWEN3, "gemma": GEMMA, "gemma2": GEMMA2,
               "qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE, "olmoe": OLMOE}
MODEL_TYPES |= {"gemma3_text": GEMMA3, "phi3": PHI3, "smollm3": SMOLLM3}
# Multimodal architectures served as their language model (text in, text out) -> that model's architecture.
GEMMA3_MULTIMODAL = "Gemma3ForConditionalGeneration"
LANGUAGE_MODELS = {GEMMA3_MULTIMODAL: GEMMA3}
# Where such a checkpoint keeps its language model's tensors (transformers 4.x's layout, which 5.x
# still saves, then 5.x's own), and the text model's names for them.
LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                           ("model.language_model.", "model."))
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# What a checkpoint may claim (a file is untrusted input): each count's range, far past any released
# model's, so that no size computed from them is absurd before anything is allocated.
LIMITS = {
    "vocab_size": 2**24, "hidden_size": 2**20, "intermediate_size": 2**22, "num_layers": 2**12,
    "num_heads": 2**12, "num_kv_heads": 2**12, "head_dim": 2**12, "max_position_embeddings": 2**24,
}
MOE_LIMITS = {"num_experts": 2**12, "moe_intermediate_size": 2**22, "shared_expert_intermediate_size": 2**22}
MAX_PARAMS = 2**42  # the parameters the counts imply, all together


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int  # E
    intermediate_size: int  # I, the gated MLP's width
    num_layers: int
    num_heads: int  # H, query heads
    num_kv_heads: int  # Hkv, key/value heads (GQA when < H)
    head_dim: int  # D
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3", "factor": ...} or None
    # [D / 2] divisors of the rotary frequencies, as a GGUF's rope_freqs.weight holds Llama 3.x's scaling; None: none
    rope_freq_factors: tuple[float, ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Family switches, each off for Llama (see the module docstring for who sets them).
    architecture: str = LLAMA  # the config.json "architectures" entry the switches were read for
    qkv_bias: bool = False  # q, k and v projections add a bias
    o_bias: bool = False  # the output projection adds a bias
    qk_norm: bool = False  # q and k pass an RMSNorm over each head's D before rope
    hidden_act: str = "silu"  # the MLP gate's activation, one of ACTIVATIONS
    embed_scale: bool = False  # the embedding is multiplied by sqrt(E), rounded to the model's dtype
    norm_offset: bool = False  # checkpoint norm weights w scale by (1 + w); the loader adds the 1
    sandwich_norms: bool = False  # attention's and the MLP's outputs are normed before the residual add
    query_pre_attn_scalar: float | None = None  # attention scores scale by this ** -0.5; None: D ** -0.5
    attn_logit_softcap: float | None = None  # c: scores become c tanh(scores / c) before the softmax
    final_logit_softcap: float | None = None  # c: logits become c tanh(logits / c)
    sliding_window: int | None = None  # W: a windowed layer's query at p sees keys p - W + 1 .. p; None: no window
    sliding_layers: tuple[int, ...] = ()  # the layers whose attention is windowed; () when W is None
    partial_rotary_factor: float = 1.0  # rope turns each head's first rotary_dim = int(D * this) dimensions (Phi-3)
    rope_local_theta: float | None = None  # the windowed layers' own rope base, unscaled (Gemma 3); None: one table
    no_rope_layers: tuple[int, ...] = ()  # the layers that skip rope (SmolLM3's NoPE layers)
    language_model_of: str | None = None  # the multimodal architecture whose language model this is; None: none
    qk_norm_whole: bool = False  # q and k pass an RMSNorm over the whole projection (H D, Hkv D) before rope (OLMoE)
    # Mixture of experts (nanoserve.model.moe), all None / off for a dense model.
    num_experts: int | None = None  # X, the routed experts of a sparse layer
    num_experts_per_tok: int | None = None  # k, the experts each token runs (top_k)
    moe_intermediate_size: int | None = None  # Ie, each expert's gated MLP width
    norm_topk_prob: bool = False  # the top k routing weights renormalised to sum to 1
    shared_expert_intermediate_size: int | None = None  # Is: a shared expert, gated by sigmoid(w . x) (Qwen2-MoE)
    dense_layers: tuple[int, ...] = ()  # in a model with experts, the layers whose MLP is the dense one of width I
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        """Checks every number a checkpoint's config (or a GGUF's metadata) claims, before anything
        is allocated by it.

        Raises:
            ValueError: naming the field, the value and the limit.
        """
        for name, high in LIMITS.items():
            _check_count(name, getattr(self, name), high)
        self._check_experts()
        if self.num_params > MAX_PARAMS:
            raise ValueError(f"the config implies {self.num_params} parameters, over the {MAX_PARAMS} nanoserve reads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even: rope rotates pairs of a head's dimensions")
        _check_positive("rms_norm_eps", self.rms_norm_eps, below=1.0)
        _check_positive("rope_theta", self.rope_theta)
        for key, value in (self.rope_scaling or {}).items():
            if key not in ("rope_type", "type") and isinstance(value, int | float) and not isinstance(value, bool):
                _check_positive(f"rope_scaling[{key!r}]", value)
        for i, value in enumerate(self.rope_freq_factors or ()):
            _check_positive(f"rope_freq_factors[{i}]", value)
        for name, value in [("eos_token_id", t) for t in self.eos_token_ids] + [("bos_token_id", self.bos_token_id)]:
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value < self.vocab_size):
                raise ValueError(f"{name}={value!r} is not a token id below vocab_size={self.vocab_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
        self._check_rope_switches()
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.rotary_dim // 2:
            raise ValueError(f"rope_freq_factors has {len(self.rope_freq_factors)} entries; head_dim={self.head_dim} "
                             f"rotates {self.rotary_dim // 2} frequencies")
        if self.language_model_of is not None and LANGUAGE_MODELS.get(self.language_model_of) != self.architecture:
            raise ValueError(f"language_model_of={self.language_model_of!r}: nanoserve reads the language models of "
                             f"{LANGUAGE_MODELS}, not a {self.architecture}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not one of {SUPPORTED_ARCHITECTURES}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported (supported: {ACTIVATIONS})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1")
        if (self.sliding_window is None) != (not self.sliding_layers):
            raise ValueError(f"sliding_window={self.sliding_window} and sliding_layers={self.sliding_layers}: "
                             "a window needs windowed layers and windowed layers need a window")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers):
            raise ValueError(f"sliding_layers={self.sliding_layers} name layers outside 0 .. {self.num_layers - 1}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None:
                _check_positive(name, value)

    def _check_rope_switches(self) -> None:
        _check_fraction("partial_rotary_factor", self.partial_rotary_factor)
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} of head_dim={self.head_dim} rotates "
                             f"{self.rotary_dim} dimensions: rope needs an even number, at least 2")
        if any(not 0 <= i < self.num_layers for i in self.no_rope_layers):
            raise ValueError(f"no_rope_layers={self.no_rope_layers} name layers outside 0 .. {self.num_layers - 1}")
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") != "longrope":
            return
        for key in ("short_factor", "long_factor"):
            factors = scaling.get(key)
            if not isinstance(factors, list | tuple) or len(factors) != self.rotary_dim // 2:
                raise ValueError(f"rope_scaling[{key!r}] must be a list of {self.rotary_dim // 2} numbers (one per "
                                 f"rotated frequency of rotary_dim={self.rotary_dim}), not {factors!r:.80}")
            for i, value in enumerate(factors):
                _check_positive(f"rope_scaling[{key!r}][{i}]", value)
        _check_count("rope_scaling['original_max_position_embeddings']",
                     scaling.get("original_max_position_embeddings"), LIMITS["max_position_embeddings"])
        _check_positive("rope_scaling['attention_factor']", scaling.get("attention_factor"))

    @property
    def rotary_dim(self) -> int:
        """Dr: how many of each head's D dimensions rope turns (all but where partial_rotary_factor < 1)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def _check_experts(self) -> None:
        if self.num_experts is None:
            if (self.num_experts_per_tok, self.moe_intermediate_size, self.shared_expert_intermediate_size,
                    self.dense_layers) != (None, None, None, ()):
                raise ValueError("num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size and "
                                 "dense_layers describe experts, and num_experts is None")
            return
        for name, high in MOE_LIMITS.items():
            if name != "shared_expert_intermediate_size" or self.shared_expert_intermediate_size is not None:
                _check_count(name, getattr(self, name), high)
        _check_count("num_experts_per_tok", self.num_experts_per_tok, self.num_experts)  # top_k <= num_experts
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ValueError(f"dense_layers={self.dense_layers} name layers outside 0 .. {self.num_layers - 1}")

    @property
    def is_moe(self) -> bool:
        """Whether some layer's MLP is a mixture of experts."""
        return self.num_experts is not None and len(self.dense_layers) < self.num_layers

    def is_sparse(self, layer: int) -> bool:
        """Whether layer's MLP is a mixture of experts."""
        return self.num_experts is not None and layer not in self.dense_layers

    @property
    def num_params(self) -> int:
        E, I, D = self.hidden_size, self.intermediate_size, self.head_dim
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * D
        attn = E * qkv_rows + self.num_heads * D * E
        attn += qkv_rows * self.qkv_bias + E * self.o_bias + 2 * D * self.qk_norm
        attn += (self.num_heads + self.num_kv_heads) * D * self.qk_norm_whole
        per_layer = attn + (4 if self.sandwich_norms else 2) * E
        num_sparse = 0 if self.num_experts is None else self.num_layers - len(self.dense_layers)
        mlps = (self.num_layers - num_sparse) * 3 * E * I
        if num_sparse:  # the router, the experts and a shared expert with its gate
            sparse = self.num_experts * E + self.num_experts * 3 * E * self.moe_intermediate_size
            if self.shared_expert_intermediate_size is not None:
                sparse += 3 * E * self.shared_expert_intermediate_size + E
            mlps += num_sparse * sparse
        embed = self.vocab_size * E * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + mlps + embed + E

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """Reads a Hugging Face config.json dict (transformers 4.x and 5.x spellings).

        Raises:
            ValueError: for an architecture, activation, bias, rope scaling or attention nanoserve does
                not run, naming the value (and, for an architecture close to a supported one, the feature
                the forward lacks); a count or number outside its limits (__post_init__); a value
                missing or of the wrong type.
        """
        if not isinstance(d, dict):
            raise ValueError(f"a config is a JSON object, not {type(d).__name__}")
        try:
            return cls._from_hf_dict(d)
        except (TypeError, KeyError, AttributeError, OverflowError) as e:  # a value of the wrong type, or missing
            raise ValueError(f"config: a value nanoserve reads is missing or of the wrong type ({e!r})") from None

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        if archs == [GEMMA3_MULTIMODAL] or (not archs and model_type == "gemma3"):
            return dataclasses.replace(cls._from_hf_dict(_language_model(d, GEMMA3_MULTIMODAL)),
                                       language_model_of=GEMMA3_MULTIMODAL)
        if not archs and model_type in MODEL_TYPES:
            archs = [MODEL_TYPES[model_type]]
        refused = [a for a in archs if a in REFUSED_ARCHITECTURES]
        if refused:
            raise ValueError(f"architecture {refused[0]!r} is not supported: it needs {REFUSED_ARCHITECTURES[refused[0]]}, "
                             f"which nanoserve's forward does not have (nanoserve runs {SUPPORTED_ARCHITECTURES})")
        unsupported = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
        if not archs or unsupported or len(set(archs)) > 1:
            raise ValueError(
                f"architecture {archs or model_type!r} is not supported: nanoserve runs {SUPPORTED_ARCHITECTURES}"
            )
        arch = archs[0]
        is_gemma = arch in (GEMMA, GEMMA2, GEMMA3)
        has_sandwich = arch in (GEMMA2, GEMMA3)
        if d.get("clip_qkv") is not None:
            raise ValueError(f"clip_qkv={d['clip_qkv']!r} is not supported: nanoserve does not clamp q, k and v")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if d.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=True is not supported: nanoserve's attention is causal")
        for key in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window",
                    "use_bidirectional_attention"):
            if d.get(key) is not None and not isinstance(d[key], bool):
                raise ValueError(f"{key}={d[key]!r} must be true or false")
        for key, name in (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                          ("intermediate_size", "intermediate_size"), ("num_hidden_layers", "num_layers"),
                          ("num_attention_heads", "num_heads")):
            if key not in d:
                raise ValueError(f"config has no {key!r}")
            _check_count(key, d[key], LIMITS[name])
        num_heads = d["num_attention_heads"]
        num_layers = d["num_hidden_layers"]
        window, sliding_layers = _sliding_window(d, arch, num_layers)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        theta, scaling = _rope(d)
        local_theta = None
        if arch == GEMMA3:
            theta, scaling, local_theta = _gemma3_rope(d)
        scaling = _longrope(d, scaling)
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or _DEFAULT_HEAD_DIM.get(arch) or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", is_gemma or arch == SMOLLM3)),
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            architecture=arch,
            # Qwen2's q/k/v bias is in its modelling code, not its config (Mistral's modelling code has none).
            qkv_bias=arch in (QWEN2, QWEN2_MOE) or (attention_bias and arch not in (MISTRAL, MIXTRAL)),
            o_bias=attention_bias and arch not in (MISTRAL, QWEN2, MIXTRAL, QWEN2_MOE),
            qk_norm=arch in (QWEN3, GEMMA3, QWEN3_MOE),
            qk_norm_whole=arch == OLMOE,
            hidden_act=_activation(d, arch),
            embed_scale=is_gemma,
            norm_offset=is_gemma,
            sandwich_norms=has_sandwich,
            query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256) if has_sandwich else None,
            # Gemma 2 caps unless told otherwise; Gemma 3 only where its config sets a cap
            attn_logit_softcap=d.get("attn_logit_softcapping", 50.0 if arch == GEMMA2 else None) if has_sandwich else None,
            final_logit_softcap=d.get("final_logit_softcapping", 30.0 if arch == GEMMA2 else None) if has_sandwich else None,
            sliding_window=window,
            sliding_layers=sliding_layers,
            rope_freq_factors=tuple(d["rope_freq_factors"]) if d.get("rope_freq_factors") else None,
            partial_rotary_factor=_partial_rotary_factor(d) if arch == PHI3 else 1.0,
            rope_local_theta=local_theta,
            no_rope_layers=_no_rope_layers(d, num_layers) if arch == SMOLLM3 else (),
            **_experts(d, arch, num_layers),
        )


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape, for every tensor the forward reads."""
    E, I, D = config.hidden_size, config.intermediate_size, config.head_dim
    H, Hkv = config.num_heads, config.num_kv_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, E), "model.norm.weight": (E,)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        if config.architecture == PHI3:  # q/k/v and gate/up fused in the checkpoint, used as they are
            shapes |= {p + "self_attn.qkv_proj.weight": ((H + 2 * Hkv) * D, E), p + "mlp.gate_up_proj.weight": (2 * I, E)}
        else:
            shapes |= {p + "self_attn.q_proj.weight": (H * D, E), p + "self_attn.k_proj.weight": (Hkv * D, E),
                       p + "self_attn.v_proj.weight": (Hkv * D, E), p + "mlp.gate_proj.weight": (I, E),
                       p + "mlp.up_proj.weight": (I, E)}
        shapes |= {
            p + "input_layernorm.weight": (E,),
            p + "self_attn.o_proj.weight": (E, H * D),
            p + "post_attention_layernorm.weight": (E,),
            p + "mlp.down_proj.weight": (E, I),
        }
        if config.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (H * D,), p + "self_attn.k_proj.bias": (Hkv * D,),
                       p + "self_attn.v_proj.bias": (Hkv * D,)}
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (E,)
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)}
        if config.sandwich_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (E,), p + "post_feedforward_layernorm.weight": (E,)}
        if config.qk_norm_whole:
            shapes |= {p + "self_attn.q_norm.weight": (H * D,), p + "self_attn.k_norm.weight": (Hkv * D,)}
        if config.is_sparse(i):
            for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
                del shapes[p + name]
            shapes |= expert_shapes(config, i)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, E)
    return shapes


def expert_shapes(config: LlamaConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """A sparse layer's tensors as a checkpoint stores them (one tensor per expert and projection),
    with their shapes: Mixtral's block_sparse_moe.experts.{j}.w1 (gate), w3 (up), w2 (down) and
    block_sparse_moe.gate; the others' mlp.experts.{j}.gate_proj, up_proj, down_proj and mlp.gate,
    Qwen2-MoE's mlp.shared_expert.* and mlp.shared_expert_gate."""
    E, Ie, X = config.hidden_size, config.moe_intermediate_size, config.num_experts
    p = f"model.layers.{layer}."
    if config.architecture == MIXTRAL:
        shapes = {p + "block_sparse_moe.gate.weight": (X, E)}
        for j in range(X):
            q = p + f"block_sparse_moe.experts.{j}."
            shapes |= {q + "w1.weight": (Ie, E), q + "w3.weight": (Ie, E), q + "w2.weight": (E, Ie)}
        return shapes
    shapes = {p + "mlp.gate.weight": (X, E)}
    for j in range(X):
        q = p + f"mlp.experts.{j}."
        shapes |= {q + "gate_proj.weight": (Ie, E), q + "up_proj.weight": (Ie, E), q + "down_proj.weight": (E, Ie)}
    Is = config.shared_expert_intermediate_size
    if Is is not None:
        q = p + "mlp.shared_expert."
        shapes |= {q + "gate_proj.weight": (Is, E), q + "up_proj.weight": (Is, E), q + "down_proj.weight": (E, Is),
                   p + "mlp.shared_expert_gate.weight": (1, E)}
    return shapes


def _experts(d: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a config.json as transformers' modelling code for `arch`
    reads them (none for a dense family)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    num_experts = d.get("num_experts") or d.get("num_local_experts")  # transformers 5 writes the latter for some
    if num_experts is None or "num_experts_per_tok" not in d:
        raise ValueError(f"{arch}'s config gives no num_experts (or num_local_experts) and num_experts_per_tok")
    for key in ("norm_topk_prob",):
        if d.get(key) is not None and not isinstance(d[key], bool):
            raise ValueError(f"{key}={d[key]!r} must be true or false")
    fields: dict[str, Any] = {"num_experts": num_experts, "num_experts_per_tok": d["num_experts_per_tok"],
                              "norm_topk_prob": arch == MIXTRAL or bool(d.get("norm_topk_prob", False))}
    if arch in (QWEN3_MOE, QWEN2_MOE):
        fields["moe_intermediate_size"] = d.get("moe_intermediate_size")
        step = d.get("decoder_sparse_step", 1)
        _check_count("decoder_sparse_step", step, num_layers)
        only = d.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise ValueError(f"mlp_only_layers={only!r} must be a list of layer indices")
        fields["dense_layers"] = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
        if any(not 0 <= i < num_layers for i in only):
            raise ValueError(f"mlp_only_layers={only} name layers outside 0 .. {num_layers - 1}")
    else:  # Mixtral's and OLMoE's experts are intermediate_size wide, and every layer is sparse
        fields["moe_intermediate_size"] = d["intermediate_size"]
    if arch == QWEN2_MOE:
        fields["shared_expert_intermediate_size"] = d.get("shared_expert_intermediate_size")
        if fields["shared_expert_intermediate_size"] is None:
            raise ValueError("Qwen2-MoE's config gives no shared_expert_intermediate_size")
    return fields


def _check_count(name: str, value: Any, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
        raise ValueError(f"{name}={value!r} must be an integer from 1 to {high}")


def _check_positive(name: str, value: Any, below: float = math.inf) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < below:
        limit = "a finite number > 0" if below == math.inf else f"a number > 0 and < {below}"
        raise ValueError(f"{name}={value!r} must be {limit}")


def _check_fraction(name: str, value: Any) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value <= 1:
        raise ValueError(f"{name}={value!r} must be a number > 0 and <= 1")


# head_dim when config.json leaves it out: transformers' defaults for the families that set their own.
_DEFAULT_HEAD_DIM = {QWEN3: 128, GEMMA: 256, GEMMA2: 256, GEMMA3: 256}


def _activation(d: dict[str, Any], arch: str) -> str:
    if arch in (GEMMA2, GEMMA3):
        return d.get("hidden_activation") or "gelu_pytorch_tanh"
    act = d.get("hidden_act") or d.get("hidden_activation") or ("gelu_pytorch_tanh" if arch == GEMMA else "silu")
    if arch == GEMMA and act == "gelu":  # Gemma's first releases wrote "gelu" and meant the tanh form
        return "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_act={act!r} is not supported (supported: {ACTIVATIONS})")
    return act


def _sliding_window(d: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(W, the windowed layers) as transformers' modelling code for `arch` reads the config."""
    window = d.get("sliding_window")
    if arch in (LLAMA, GEMMA, OLMOE) or window is None:
        return None, ()  # Llama's and Gemma's modelling code never reads a window
    if arch in (QWEN2, QWEN3, SMOLLM3, QWEN2_MOE, QWEN3_MOE) and not d.get("use_sliding_window", False):
        return None, ()
    layer_types = d.get("layer_types")
    if arch in (MISTRAL, PHI3, MIXTRAL):
        layers = range(num_layers)
    elif layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"layer_types {sorted(unknown)} are not supported (full_attention, sliding_attention)")
        layers = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    elif arch == GEMMA2:
        layers = range(0, num_layers, 2)  # local, global, local, ...
    elif arch == GEMMA3:  # every pattern-th layer global, the rest local
        pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
        _check_count("sliding_window_pattern", pattern, LIMITS["num_layers"])
        layers = [i for i in range(num_layers) if (i + 1) % pattern]
    else:  # Qwen2 / Qwen3: the layers from max_window_layers on
        layers = range(d.get("max_window_layers", 28), num_layers)
    layers = tuple(layers)
    return (window, layers) if layers else (None, ())


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 moved rope_theta and rope_scaling into rope_parameters.
    rope = dict(d.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
    _check_positive("rope_theta", theta)
    scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    return float(theta), scaling



def _gemma3_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta and rope_scaling of the global layers, the local layers' base) as Gemma 3's configs
    write them: transformers 5's rope_parameters per layer type, or rope_theta, rope_scaling and
    rope_local_base_freq."""
    rope = d.get("rope_parameters") or {}
    full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        raise ValueError(f"Gemma 3's sliding_attention rope_type {local_type!r} is not supported (its local layers' "
                         "rope is unscaled: 'default')")
    theta = full.pop("rope_theta", d.get("rope_theta", 1_000_000.0))
    local_theta = local.get("rope_theta", d.get("rope_local_base_freq", 10_000.0))
    _check_positive("rope_theta", theta)
    _check_positive("rope_local_base_freq", local_theta)
    scaling = d.get("rope_scaling") or full or None
    if scaling is not None:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    return float(theta), scaling, float(local_theta)


def _longrope(d: dict[str, Any], scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """LongRoPE's rope_scaling ("longrope", or Phi-3's first name "su") with what transformers' rope init
    derives made explicit: original_max_position_embeddings (the config's top-level value first, as
    transformers takes it) and the attention factor that scales cos and sin, given or
    sqrt(1 + ln(factor) / ln(original)) with factor = max_position_embeddings / original."""
    if scaling is None or scaling.get("rope_type") not in ("longrope", "su"):
        return scaling
    scaling = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    scaling["rope_type"] = "longrope"
    max_positions = d.get("max_position_embeddings", 2048)
    original = next((v for v in (d.get("original_max_position_embeddings"),
                                 scaling.get("original_max_position_embeddings")) if v is not None), max_positions)
    _check_count("original_max_position_embeddings", original, LIMITS["max_position_embeddings"])
    _check_count("max_position_embeddings", max_positions, LIMITS["max_position_embeddings"])
    factor = scaling["factor"] if scaling.get("factor") is not None else max_positions / original
    _check_positive("rope_scaling['factor']", factor)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if factor > 1.0 and original == 1:
            raise ValueError(f"original_max_position_embeddings={original} with factor {factor}: the attention factor "
                             "divides by ln(original); it must be >= 2")
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return scaling | {"original_max_position_embeddings": original, "attention_factor": attention_factor}


def _partial_rotary_factor(d: dict[str, Any]) -> float:
    factor = d.get("partial_rotary_factor", (d.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    _check_fraction("partial_rotary_factor", factor)
    return float(factor)


def _no_rope_layers(d: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """SmolLM3's NoPE layers as transformers reads them: no_rope_layers holds 1 for a layer with rope
    and 0 for one without; absent, every no_rope_layer_interval-th layer (default 4) has none."""
    flags = d.get("no_rope_layers")
    if flags is None:
        interval = d.get("no_rope_layer_interval", 4)
        _check_count("no_rope_layer_interval", interval, LIMITS["num_layers"])
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not isinstance(flags, list) or len(flags) != num_layers or any(f not in (0, 1) for f in flags):
        raise ValueError(f"no_rope_layers={flags!r:.80} must be a list of {num_layers} entries, each 0 or 1")
    return tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)


def _language_model(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """A multimodal config's text_config as its language model's own config, with the top level's
    token ids and tying where it sets them."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{arch}'s config has no text_config object (got {type(text).__name__})")
    merged = dict(text) | {"architectures": [LANGUAGE_MODELS[arch]]}
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if d.get(key) is not None:
            merged[key] = d[key]
    return merged


def text_model_name(config: LlamaConfig, stored: str) -> str:
    """A checkpoint's tensor name as the model reads it: a multimodal checkpoint's language model
    tensors under the text model's names; any other name (the vision tower's) as it is, and unread."""
    if config.language_model_of is not None:
        for prefix, name in LANGUAGE_MODEL_PREFIXES:
            if stored.startswith(prefix):
                return name + stored[len(prefix):]
    return stored
