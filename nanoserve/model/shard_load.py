"""Reading one rank's slices of a checkpoint, and nothing else of its matrices.

safetensors: `safe_open(...).get_slice(name)[rows]` reads only the slice's bytes. GGUF: a matrix's
rows are contiguous in the file and its quantization blocks run along a row, so a row range is one
read of the memory map, and a column range is a range of whole blocks in every row (a column split
of a quantized matrix must fall on a block boundary (32 columns, 256 for K-quants and IQ4_XS); it is refused by name otherwise).
A llama-arch GGUF stores q/k rows interleaved within each head (nanoserve.model.gguf.qk_row_order):
the rank reads its heads' rows and puts them back in Hugging Face order, head by head.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from nanoserve.model.config import LlamaConfig, text_model_name
from nanoserve.model.ggml_blocks import BY_ID
from nanoserve.model.gguf import (
    ROPE_TENSORS,
    BlockQuantized,
    GGUFFile,
    architecture_of,
    config_from_gguf,
    decode_blocks,
    hf_name,
    read_gguf_config,
    read_gguf_file,
)
from nanoserve.model.shard import Shard, shard_of, slice_of
from nanoserve.model.weights import load_config, safetensors_files

Tensors = dict[str, torch.Tensor | BlockQuantized]


def check_split(source: Path, is_gguf: bool, world_size: int) -> LlamaConfig:
    """The checkpoint's config, once every rank's Shard of it is known to exist (read from the
    config alone, before any process starts).

    Raises:
        ValueError: shard_of's, naming the numbers that do not split.
    """
    config = read_gguf_config(source) if is_gguf else load_config(source)
    for rank in range(world_size):
        shard_of(config, rank, world_size)
    return config


def read_shard(source: Path, is_gguf: bool, rank: int, world_size: int) -> tuple[LlamaConfig, Shard, Tensors]:
    """The whole model's config, rank `rank`'s Shard, and its slices by Hugging Face name (dense
    tensors in their stored dtype, a GGUF's quantized matrices as BlockQuantized).

    Raises:
        ValueError: shard_of's, and for a quantized matrix whose column split falls inside a block.
    """
    if is_gguf:
        parsed = read_gguf_file(source)
        parsed.check_types()
        config = config_from_gguf(parsed)
        shard = shard_of(config, rank, world_size)
        return config, shard, _gguf_slices(parsed, config, shard)
    config = load_config(source)
    shard = shard_of(config, rank, world_size)
    tensors: Tensors = {}
    for file in safetensors_files(source):
        with safe_open(str(file), framework="pt") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = text_model_name(config, stored)
                if config.language_model_of is not None and name == stored:
                    continue  # a multimodal checkpoint's vision tower: unread
                cut = slice_of(name, config, shard)
                if cut is None:
                    tensors[name] = f.get_tensor(stored)
                else:
                    dim, start, end = cut
                    tensors[name] = f.get_slice(stored)[start:end] if dim == 0 else f.get_slice(stored)[:, start:end]
    return config, shard, tensors


def _gguf_slices(parsed: GGUFFile, config: LlamaConfig, shard: Shard) -> Tensors:
    _, spec = architecture_of(parsed)
    tensors: Tensors = {}
    for gguf_name in parsed.tensors:
        if gguf_name in ROPE_TENSORS:  # in the config
            continue
        name = hf_name(gguf_name, spec.names)
        cut = slice_of(name, config, shard)
        # The q/k interleaving is within each head, and a rank holds whole heads.
        tensors[name] = spec.as_hf(name, _gguf_read(parsed, gguf_name, cut), config.head_dim)
    return tensors


def _gguf_read(parsed: GGUFFile, name: str, cut: tuple[int, int, int] | None) -> torch.Tensor | BlockQuantized:
    """Tensor `name`, or its rows / columns start .. end, copied out of the map."""
    tensor = parsed.tensors[name]
    block = BY_ID.get(tensor.type_id)
    data = parsed.data(name)  # [N, K / weights a block * bytes a block] for a block type, else the tensor's shape
    if cut is not None:
        dim, start, end = cut
        if dim == 0:
            data = data[start:end]
        elif block is not None:
            if start % block.weights or end % block.weights:
                raise ValueError(f"tensor {name!r} is {block.name}, quantized in blocks of {block.weights} columns; this "
                                 f"rank's columns {start} .. {end} split a block (tensor_parallel_size too large for it)")
            data = data[:, start // block.weights * block.nbytes:end // block.weights * block.nbytes]
        else:
            data = data[:, start:end]
    if block is not None:
        return decode_blocks(np.ascontiguousarray(data), block.name)
    dense = torch.from_numpy(np.array(data))  # a copy the tensor owns, not the file's pages
    return dense.view(torch.bfloat16) if parsed.type_name(name) == "BF16" else dense
