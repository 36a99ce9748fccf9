"""LlamaConfig: the architecture numbers nanoserve reads from a checkpoint's config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int  # E
    intermediate_size: int  # I, the SwiGLU width
    num_layers: int
    num_heads: int  # H, query heads
    num_kv_heads: int  # Hkv, key/value heads (GQA when < H)
    head_dim: int  # D
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3", "factor": ...} or None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")

    @property
    def num_params(self) -> int:
        E, I, D = self.hidden_size, self.intermediate_size, self.head_dim
        attn = E * D * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * E * I + 2 * E
        embed = self.vocab_size * E * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + E

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """Reads a Hugging Face config.json dict (transformers 4.x and 5.x spellings).

        Raises:
            ValueError: for an architecture, activation, bias or sliding window nanoserve does not run.
        """
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        if not archs and model_type in ("llama", "mistral"):
            archs = ["LlamaForCausalLM"]
        unsupported = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
        if not archs or unsupported:
            raise ValueError(
                f"architecture {archs or model_type!r} is not supported: nanoserve runs {SUPPORTED_ARCHITECTURES}"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={d['hidden_act']!r} is not supported (only 'silu')")
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise ValueError(f"{key}=True is not supported")
        sliding = d.get("sliding_window")
        if sliding is not None and sliding < d.get("max_position_embeddings", 2048):
            raise ValueError(f"sliding_window={sliding} is not supported (Mistral without sliding window only)")
        # transformers 5 moved rope_theta and rope_scaling into rope_parameters.
        rope = dict(d.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        num_heads = d["num_attention_heads"]
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
        )
