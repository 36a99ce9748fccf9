"""model/kv_cache.py: byte counts worked out by hand, the slot layout, and the engine's sizing from a budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY, make_hf_llama, make_tiny_engine

from nanoserve.model.config import LlamaConfig
from nanoserve.model.kv_cache import KVCache, bytes_per_block

TINY_CONFIG = LlamaConfig.from_hf_dict(make_hf_llama().config.to_dict())  # 2 layers, Hkv 2, D 8

# Llama 3 8B's attention: 32 layers, 8 KV heads of 128 dims.
LLAMA3_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128)


@pytest.mark.parametrize("config, block_size, dtype, expected", [
    # K and V x 2 layers x 4 tokens x 2 heads x 8 dims x 4 bytes
    (TINY_CONFIG, 4, torch.float32, 2 * 2 * 4 * 2 * 8 * 4),  # 1024
    (TINY_CONFIG, 4, torch.bfloat16, 512),
    (TINY_CONFIG, 4, torch.float16, 512),
    (TINY_CONFIG, 1, torch.float32, 256),
    # 128 KiB per token in bf16 (2 x 32 x 8 x 128 x 2 bytes), 16 tokens a block: 2 MiB.
    (LLAMA3_8B, 16, torch.bfloat16, 2 * 2**20),
])
def test_bytes_per_block_by_hand(config, block_size, dtype, expected):
    assert bytes_per_block(config, block_size, dtype) == expected


def test_cache_shape_dtype_and_bytes():
    cache = KVCache(TINY_CONFIG, num_blocks=6, block_size=4, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert (cache.num_blocks, cache.block_size) == (6, 4)
    # [layers, blocks x block_size slots, Hkv, D]
    assert cache.k.shape == cache.v.shape == (TINY["num_hidden_layers"], 24, TINY["num_key_value_heads"], 8)
    assert cache.k.dtype == cache.v.dtype == torch.bfloat16
    assert cache.nbytes == 6 * 512 == 2 * (2 * 24 * 2 * 8 * 2)
    assert not cache.k.any() and not cache.v.any()  # zeros: an unwritten slot reads as finite
    assert cache.k.data_ptr() != cache.v.data_ptr()


STATUS = Path("/proc/self/status")


def resident_mib() -> float:
    line = next(line for line in STATUS.read_text().splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.mark.skipif(not STATUS.exists(), reason="reads Linux's /proc/self/status")
def test_a_pools_pages_are_committed_as_blocks_are_written():
    # 256 MiB of pool (K and V): the system commits a page when it is first written, not at start
    config = LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=1, num_kv_heads=1,
                         head_dim=64)
    before = resident_mib()
    cache = KVCache(config, num_blocks=4096, block_size=64, dtype=torch.float32, device=torch.device("cpu"))
    assert cache.nbytes == 256 * 2**20
    assert resident_mib() - before < 32
    cache.k[0, :4096 * 16] = 1.0  # a quarter of one layer's K: 16 MiB written
    grown = resident_mib() - before
    assert 16 <= grown < 48
    assert cache.k[0, 4096 * 16:].abs().sum() == 0 and cache.v[1, -1].abs().sum() == 0  # the rest reads as zeros


def test_slot_of_a_token_is_block_id_times_block_size_plus_offset():
    # Attention reads a block as block_size consecutive slots: slot b * bs + o is block b's o-th token.
    cache = KVCache(TINY_CONFIG, num_blocks=5, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    cache.k[1, 3 * 4 + 2] = 7.0
    blocks = cache.k[1].view(5, 4, 2, 8)  # [blocks, block_size, Hkv, D]
    assert torch.equal(blocks[3, 2], torch.full((2, 8), 7.0))
    assert blocks.count_nonzero().item() == 16 and cache.k[0].count_nonzero().item() == 0


@pytest.mark.parametrize("budget, expected_blocks", [
    (10_000, 9),  # 10000 // 1024 bytes a block (block_size 4, float32)
    (1024, 1),
])
def test_the_engine_sizes_its_pool_from_the_memory_budget(budget, expected_blocks):
    engine = make_tiny_engine(num_kv_blocks=None, kv_cache_memory_bytes=budget)
    assert engine.allocator.num_blocks == expected_blocks
    assert engine.kv.num_blocks == expected_blocks
    assert engine.kv.nbytes == expected_blocks * 1024


def test_a_float16_cache_holds_twice_the_blocks_of_float32_in_the_same_budget():
    # block_size 4 of the tiny config: 1024 bytes a block in float32 (above), 512 in float16
    engine = make_tiny_engine(num_kv_blocks=None, kv_cache_memory_bytes=10_000, kv_cache_dtype="float16")
    assert engine.kv.k.dtype == engine.kv.v.dtype == torch.float16 and engine.model.dtype == torch.float32
    assert engine.allocator.num_blocks == 10_000 // 512 and engine.kv.nbytes == 19 * 512
