"""The paged KV cache: per layer, one K and one V tensor of [num_blocks * block_size, Hkv, D].

A token's K/V live at slot `block_id * block_size + offset`; the scheduler decides the block
ids, the model only ever sees slots (writes) and slot tables (reads).
"""

from __future__ import annotations

import math
import mmap

import torch

from nanoserve.model.config import LlamaConfig


def bytes_per_block(config: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on a CPU in a private anonymous mapping, whose pages the system commits one
    by one as they are first written: the blocks no request has used take no memory, so the pool's
    size is a ceiling, not a cost paid at start (torch.zeros writes every page). A first read
    commits a page too (seen on Linux), but attention reads only the blocks in a request's table,
    which the request has written (but for its last block's tail)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled; the tensor keeps it
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


class KVCache:
    def __init__(self, config: LlamaConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.num_layers, num_blocks * block_size, config.num_kv_heads, config.head_dim)
        # Allocated once; zeros so a padded read of an unwritten slot is finite (it is masked anyway).
        self.k = zeros(shape, dtype, device)  # [L, slots, Hkv, D]
        self.v = zeros(shape, dtype, device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
