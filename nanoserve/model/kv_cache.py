"""The paged KV cache: per layer, one K and one V tensor of [num_blocks * block_size, Hkv, D].

A token's K/V live at slot `block_id * block_size + offset`; the scheduler decides the block
ids, the model only ever sees slots (writes) and slot tables (reads).
"""

from __future__ import annotations

import torch

from nanoserve.model.config import LlamaConfig


def bytes_per_block(config: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


class KVCache:
    def __init__(self, config: LlamaConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.num_layers, num_blocks * block_size, config.num_kv_heads, config.head_dim)
        # Allocated once; zeros so a padded read of an unwritten slot is finite (it is masked anyway).
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, Hkv, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
