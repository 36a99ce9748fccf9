"""Rotary position embeddings, including Llama 3's frequency scaling (from config.json's rope_scaling, or
from a GGUF's per-frequency divisors)."""

from __future__ import annotations

import math

import torch

from nanoserve.model.config import LlamaConfig


def inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """[D/2] float64 rotation speeds, scaled as config.rope_scaling asks."""
    D = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    if config.rope_freq_factors is not None:  # a GGUF's rope_freqs.weight: llama.cpp divides each frequency by its factor
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float64)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
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
    """cos and sin, each [max_positions, D], in the rotate-half layout Hugging Face checkpoints use."""
    inv_freq = inverse_frequencies(config)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)  # [P, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [P, D]
    return angles.cos().to(dtype=dtype, device=device), angles.sin().to(dtype=dtype, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos, sin [T, 1, D] -> [T, heads, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
