"""The paged KV cache: per layer, one K and one V tensor of [num_blocks * block_size, Hkv, D].

A token's K/V live at slot `block_id * block_size + offset`; the scheduler decides the block
ids, the model only ever sees slots (writes) and slot tables (reads). A cache of llama.cpp's blocks
("q8_0", "q4_0": nanoserve.model.kv_quant) holds each head as its bytes instead, [slots, Hkv, W]
uint8, W = (D / 32) * 34 or * 18: 8.5 or 4.5 bits a value against float16's 16.
"""

from __future__ import annotations

import math
import mmap

import torch

from nanoserve.model import kv_quant
from nanoserve.model.config import LlamaConfig


def head_bytes(head_dim: int, dtype: torch.dtype | str) -> int:
    """The bytes one head of a token takes in a cache of `dtype` (a torch dtype, or a block kind of kv_quant)."""
    return kv_quant.head_bytes(head_dim, dtype) if isinstance(dtype, str) else head_dim * dtype.itemsize


def bytes_per_block(config: LlamaConfig, block_size: int, dtype: torch.dtype | str) -> int:
    return 2 * config.num_layers * block_size * config.num_kv_heads * head_bytes(config.head_dim, dtype)


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
    """K and V of every layer: [L, slots, Hkv, D] in a torch dtype, or [L, slots, Hkv, W] uint8 in a
    block kind (`dtype` "q8_0" or "q4_0", kept in `dtype` as given).

    Raises:
        ValueError: a name that is no block kind, or a block kind and a head_dim that is not a multiple of
            its 32 values.
    """

    def __init__(self, config: LlamaConfig, num_blocks: int, block_size: int, dtype: torch.dtype | str,
                 device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        blocks = isinstance(dtype, str)
        if blocks:
            kv_quant.check(dtype, config.head_dim)
        width = head_bytes(config.head_dim, dtype) if blocks else config.head_dim
        shape = (config.num_layers, num_blocks * block_size, config.num_kv_heads, width)
        # Allocated once; zeros so a padded read of an unwritten slot is finite (it is masked anyway).
        self.k = zeros(shape, torch.uint8 if blocks else dtype, device)  # [L, slots, Hkv, D or W]
        self.v = zeros(shape, torch.uint8 if blocks else dtype, device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
