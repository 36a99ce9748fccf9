"""nanoserve/config.py: EngineConfig is frozen, and refuses a bad value by name with its limit."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import config_of

from nanoserve import EngineConfig


@pytest.mark.parametrize("overrides, message", [
    ({"block_size": 0}, "block_size=0 must be an integer >= 1"),
    ({"max_num_seqs": 0}, "max_num_seqs=0 must be an integer >= 1"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens=0 must be an integer >= 1"),
    ({"num_kv_blocks": 0}, "num_kv_blocks=0 must be None or an integer >= 1"),
    ({"max_model_len": 1}, "max_model_len=1 must be None or an integer >= 2"),
    ({"dtype": "float8"}, r"dtype='float8' is not one of \['auto', 'float32', 'bfloat16', 'float16'\]"),
    ({"device": "nonsense"}, "device='nonsense' is not a torch device"),
    ({"decode_group_min_rows": 1}, "decode_group_min_rows=1 must be None or an integer >= 2"),
    ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes=0 must be >= 1"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 8, "max_model_len": 16},
     "max_num_batched_tokens=8 is below max_model_len=16"),
])
def test_invalid_engine_config_is_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        config_of(**overrides)


@pytest.mark.parametrize("overrides, message", [
    ({"block_size": 2.5}, "block_size=2.5 must be an integer >= 1"),
    ({"max_num_seqs": "4"}, "max_num_seqs='4' must be an integer >= 1"),
    ({"max_num_batched_tokens": -3}, "max_num_batched_tokens=-3 must be an integer >= 1"),
    ({"num_kv_blocks": 1.5}, "num_kv_blocks=1.5 must be None or an integer >= 1"),
    ({"max_model_len": 8.0}, "max_model_len=8.0 must be None or an integer >= 2"),
    ({"decode_group_min_rows": 4.0}, "decode_group_min_rows=4.0 must be None or an integer >= 2"),
    ({"kv_cache_memory_bytes": -1}, "kv_cache_memory_bytes=-1 must be >= 1"),
    ({"dtype": "fp32"}, r"dtype='fp32' is not one of \['auto', 'float32', 'bfloat16', 'float16'\]"),
    ({"quantization": "int3"}, r"quantization='int3' is not one of \['auto', 'int8', 'int4', None\]"),
    ({"max_kernel_rows": 0}, "max_kernel_rows=0 must be None, 'auto' or an integer >= 1"),
    ({"kernels": "mkl"}, r"kernels='mkl' is not one of \['auto', 'torch', 'blockdot'\]"),
    ({"dense_kernel": "onednn"}, r"dense_kernel='onednn' is not one of \['auto', 'torch', 'blockdot'\]"),
    ({"kv_cache_dtype": "fp8"}, r"kv_cache_dtype='fp8' is not one of \['auto', 'float32', 'bfloat16', 'float16', 'q8_0', "
     r"'q4_0'\]"),
    ({"kv_cache_dtype": "float16", "tensor_parallel_size": 2}, "kv_cache_dtype='float16' with tensor_parallel_size=2"),
    ({"kernels": "blockdot", "tensor_parallel_size": 2}, "kernels='blockdot' with tensor_parallel_size=2"),
])
def test_wrong_types_and_negatives_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        config_of(**overrides)


@pytest.mark.parametrize("overrides", [
    {"block_size": 1, "max_num_seqs": 1, "max_num_batched_tokens": 1},  # every lower limit, inclusive
    {"num_kv_blocks": 1, "max_model_len": 2, "decode_group_min_rows": 2, "kv_cache_memory_bytes": 1},
    {"num_kv_blocks": None, "max_model_len": None, "decode_group_min_rows": None},
    # Without chunked prefill a budget equal to max_model_len is enough.
    {"enable_chunked_prefill": False, "max_num_batched_tokens": 16, "max_model_len": 16},
    {"enable_chunked_prefill": False, "max_num_batched_tokens": 8, "max_model_len": None},  # checked by the engine
])
def test_values_at_the_limits_are_accepted(overrides):
    config = config_of(**overrides)
    assert all(getattr(config, name) == value for name, value in overrides.items())


def test_defaults():
    config = EngineConfig()
    assert (config.block_size, config.num_kv_blocks, config.kv_cache_memory_bytes) == (16, None, 512 * 2**20)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len) == (16, 2048, None)
    assert (config.enable_chunked_prefill, config.enable_prefix_caching, config.deferred_output) == (True, True, False)
    assert (config.overrides.pack_weights, config.decode_group_min_rows, config.compile) == (True, 8, False)
    assert (config.dtype, config.device, config.seed) == ("auto", "cpu", 0)
    assert (config.quantization, config.overrides.max_kernel_rows) == ("auto", "auto")


def test_frozen():
    config = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 8
    assert dataclasses.replace(config, block_size=8).block_size == 8
    with pytest.raises(ValueError, match="block_size=0 must be an integer >= 1"):
        dataclasses.replace(config, block_size=0)  # replace validates again
