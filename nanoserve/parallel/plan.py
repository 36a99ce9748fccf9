"""A step's plan as bytes: ModelInputs, with its attention metadata, packed into one uint8 tensor
that a torch.distributed broadcast carries from rank 0 to the workers, and unpacked there.

No pickle crosses the wire: the buffer is an int64 description of the value (its dataclasses, lists,
ints and tensor shapes, walked field by field) followed by the tensors' bytes, each padded to 8.
Both ends run the same code, so a dataclass is named by its index in CLASSES and its fields come
in dataclasses.fields order; a field added to ModelInputs or AttentionMetadata travels unchanged.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import torch

from nanoserve.model.attention import AttentionMetadata, DecodeGroup, PrefillRun
from nanoserve.model.llama import ModelInputs

CLASSES = (ModelInputs, AttentionMetadata, DecodeGroup, PrefillRun)
DTYPES = (torch.int64, torch.int32, torch.bool, torch.uint8, torch.float32, torch.float16, torch.bfloat16)
NONE, BOOL, INT, FLOAT, TENSOR, LIST, OBJECT = range(7)
ALIGN = 8  # bytes: every part starts on a multiple, so an int64 view of it is legal


def encode(value: Any) -> torch.Tensor:
    """value (a ModelInputs, or any nesting of CLASSES, lists, ints, floats, bools, None and
    tensors) -> uint8 [bytes] on the CPU: [number of codes] int64, the codes, then each tensor."""
    codes: list[int] = []
    tensors: list[torch.Tensor] = []
    _describe(value, codes, tensors)
    parts = [torch.tensor([len(codes)] + codes, dtype=torch.int64).view(torch.uint8)]
    for t in tensors:
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        parts.append(raw)
        if raw.numel() % ALIGN:
            parts.append(torch.zeros(ALIGN - raw.numel() % ALIGN, dtype=torch.uint8))
    return torch.cat(parts)


def decode(buffer: torch.Tensor, device: torch.device | str) -> Any:
    """The value `encode` packed, its tensors on `device` (views of `buffer` on a CPU)."""
    num_codes = int(buffer[:8].view(torch.int64)[0])
    end = 8 * (1 + num_codes)
    codes = buffer[8:end].view(torch.int64).tolist()
    value, position, _ = _build(codes, 0, buffer, end, torch.device(device))
    assert position == num_codes, "a plan's codes were not all read"
    return value


def _describe(value: Any, codes: list[int], tensors: list[torch.Tensor]) -> None:
    if value is None:
        codes.append(NONE)
    elif isinstance(value, bool):
        codes += [BOOL, int(value)]
    elif isinstance(value, int):
        codes += [INT, value]
    elif isinstance(value, float):
        codes += [FLOAT, struct.unpack("<q", struct.pack("<d", value))[0]]
    elif isinstance(value, torch.Tensor):
        if value.dtype not in DTYPES:
            raise TypeError(f"a plan tensor of dtype {value.dtype} is not one of {DTYPES}")
        codes += [TENSOR, DTYPES.index(value.dtype), value.dim(), *value.shape]
        tensors.append(value)
    elif isinstance(value, list):
        codes += [LIST, len(value)]
        for item in value:
            _describe(item, codes, tensors)
    elif type(value) in CLASSES:
        codes += [OBJECT, CLASSES.index(type(value))]
        for field in dataclasses.fields(value):
            _describe(getattr(value, field.name), codes, tensors)
    else:
        raise TypeError(f"a plan cannot carry {type(value).__name__}")


def _build(codes: list[int], i: int, buffer: torch.Tensor, offset: int, device: torch.device) -> tuple[Any, int, int]:
    """The value whose description starts at codes[i] and whose first tensor's bytes start at
    buffer[offset]; returns it with the next code's index and the next tensor's offset."""
    kind = codes[i]
    if kind == NONE:
        return None, i + 1, offset
    if kind == BOOL:
        return bool(codes[i + 1]), i + 2, offset
    if kind == INT:
        return codes[i + 1], i + 2, offset
    if kind == FLOAT:
        return struct.unpack("<d", struct.pack("<q", codes[i + 1]))[0], i + 2, offset
    if kind == TENSOR:
        dtype, ndim = DTYPES[codes[i + 1]], codes[i + 2]
        shape = codes[i + 3:i + 3 + ndim]
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        tensor = buffer[offset:offset + nbytes].view(dtype).view(shape).to(device)
        return tensor, i + 3 + ndim, offset + -(-nbytes // ALIGN) * ALIGN
    if kind == LIST:
        items, i = [], i + 2
        for _ in range(codes[i - 1]):
            item, i, offset = _build(codes, i, buffer, offset, device)
            items.append(item)
        return items, i, offset
    if kind == OBJECT:
        cls, i = CLASSES[codes[i + 1]], i + 2
        values = {}
        for field in dataclasses.fields(cls):
            values[field.name], i, offset = _build(codes, i, buffer, offset, device)
        return cls(**values), i, offset
    raise ValueError(f"plan code {kind} at {i} is not a kind of value (0 .. {OBJECT})")
