"""Rotary position embeddings: Llama 3's frequency scaling (from config.json's rope_scaling, or from a
GGUF's per-frequency divisors), linear scaling, LongRoPE, partial rotary, and Gemma 3's second table.

LongRoPE (Phi-3, Phi-4-mini) divides each frequency by a short or a long factor and multiplies cos
and sin by an attention factor. transformers switches between the two sets by the length a forward
call reaches (its largest position + 1 against original_max_position_embeddings), call by call, so
the keys of one sequence can be rotated by both sets. nanoserve decides once, as llama.cpp does by
its context size per sequence (llama_model::get_rope_factors): the long factors when the positions
the model serves (its table's length: Engine.from_pretrained's max_model_len, else the config's
max_position_embeddings) reach past original_max_position_embeddings, the short ones otherwise, so
a sequence's keys all share one set and a row's arithmetic does not depend on how its prompt was
chunked or batched. The two agree wherever transformers' choice does not change along a sequence:
every sequence within the original context on a model served within it, or every prompt already
past it on a model served past it (tests/test_families.py holds both).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from nanoserve.model.config import LlamaConfig


def inverse_frequencies(config: LlamaConfig, num_positions: int | None = None) -> torch.Tensor:
    """[Dr/2] float64 rotation speeds, scaled as config.rope_scaling asks (num_positions: the positions
    served, which choose LongRoPE's factors; None: the config's max_position_embeddings)."""
    D = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    if config.rope_freq_factors is not None:  # a GGUF's rope_freqs.weight: llama.cpp divides each frequency by its factor
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float64)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "longrope":
        served = config.max_position_embeddings if num_positions is None else num_positions
        key = "long_factor" if served > scaling["original_max_position_embeddings"] else "short_factor"
        return inv_freq / torch.tensor(scaling[key], dtype=torch.float64)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


def rope_table(config: LlamaConfig, max_positions: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_positions, Dr], in the rotate-half layout Hugging Face checkpoints use
    (Dr = config.rotary_dim: D unless rope is partial)."""
    inv_freq = inverse_frequencies(config, max_positions)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)  # [P, Dr/2]
    angles = torch.cat([angles, angles], dim=-1)  # [P, Dr]
    scale = (config.rope_scaling or {}).get("attention_factor", 1.0) if _is_longrope(config) else 1.0
    return (angles.cos() * scale).to(dtype=dtype, device=device), (angles.sin() * scale).to(dtype=dtype, device=device)


def local_rope_table(config: LlamaConfig, max_positions: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The windowed layers' own cos and sin [max_positions, Dr] (Gemma 3's local layers: base
    rope_local_theta, unscaled), or None where they share the one table."""
    if config.rope_local_theta is None:
        return None
    local = dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None, rope_freq_factors=None)
    return rope_table(local, max_positions, dtype, device)


def _is_longrope(config: LlamaConfig) -> bool:
    return (config.rope_scaling or {}).get("rope_type") == "longrope"


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos, sin [T, 1, Dr] -> [T, heads, D]: the first Dr dimensions of each head
    rotated, the rest passed through (Dr < D: partial rotary)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
