"""GGUF files read onto nanoserve's loader: a LlamaConfig and Hugging Face-named tensors.

Block-quantized tensors stay quantized, so an int4/int8 kernel can consume them: a loaded model
holds them as `FileBlocks`, rows of the file's tensors still in the file's bytes (views of its
memory map), and `FileBlocks.decode()` unpacks one into a `BlockQuantized` (codes, per-block
scales and mins) when it is laid out (nanoserve.model.prepare) or called. Decoding one matrix at a
time, and handing each one's pages of the map back as it is decoded (`GGUFFile.release`), keeps a
load's peak resident memory near what the laid-out model holds: the codes take a byte a weight,
over twice a Q4_K file's bits (notes/realshapes.md has the figures). F32/F16/BF16 tensors are
copied out of the map, dense in their own dtype.
Dimension names: N output rows, K input columns, B = K // 32 quantization blocks per row.

The header is parsed here rather than by gguf.GGUFReader, which builds a memory-map view per
array element (2.2 s for the default model's 147k tokenizer entries, against 0.1 s here).
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from nanoserve.model.config import LlamaConfig, expected_shapes
from nanoserve.model.forms import STORED, Form, Regroup
from nanoserve.model.ggml_blocks import BLOCK_TYPES, BY_ID, parts, unpack_rows

BLOCK = 32  # weights per group in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL and the 32-weight K-quants
DENSE_TYPES = {0: ("F32", "<f4", 4), 1: ("F16", "<f2", 2), 30: ("BF16", "<i2", 2)}  # id -> (name, numpy dtype, bytes)
GGUF_TYPES_SERVED = tuple(name for name, _, _ in DENSE_TYPES.values()) + tuple(BLOCK_TYPES)


@dataclass
class BlockQuantized:
    """A GGUF block-quantized matrix kept as its codes (nanoserve.model.ggml_blocks): w[n, k] =
    scales[n, k // G] * codes[n, k] + mins[n, k // G], G = `group` (32, or 16 for Q2_K, Q3_K and
    Q6_K); for Q4_0 the code is offset, scales * (codes - 8), and there are no mins."""

    kind: str  # a key of ggml_blocks.BLOCK_TYPES
    codes: torch.Tensor  # [N, K]: uint8 for ggml_blocks.UNSIGNED kinds (0..15, Q2_K 0..3), int8 for the rest
    scales: torch.Tensor  # [N, K // G] float32: each group's scale, exact
    mins: torch.Tensor | None  # [N, K // G] float32 for kinds with mins (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K), else None
    # rows of several kinds stacked (quant.cat_rows): each run of rows' own kind and count, in order
    # (what blockdot.pack_int8 reads them back by); None for one kind, or where the runs are not known
    row_kinds: tuple[tuple[str, int], ...] | None = None

    def __post_init__(self) -> None:
        if any(kind not in BLOCK_TYPES for kind in parts(self.kind)):
            raise ValueError(f"BlockQuantized kind {self.kind!r} is not one of {tuple(BLOCK_TYPES)} (or several "
                             "joined by '+')")
        N, K = self.codes.shape
        G = self.group
        if K % G or self.scales.shape != (N, K // G):
            raise ValueError(f"{self.kind} codes {[N, K]} need K a multiple of {G} and scales "
                             f"{[N, K // G]}, got scales {list(self.scales.shape)}")
        if self.kind in BLOCK_TYPES and (self.mins is not None) != BLOCK_TYPES[self.kind].has_mins:
            raise ValueError(f"{self.kind} {'needs' if BLOCK_TYPES[self.kind].has_mins else 'takes no'} mins")
        if self.kind not in BLOCK_TYPES and self.codes.dtype != torch.int8:
            raise ValueError(f"{self.kind}: rows of several types are held as int8 codes")
        if self.row_kinds is not None and (sum(rows for _, rows in self.row_kinds) != N or any(
                kind not in parts(self.kind) for kind, _ in self.row_kinds)):
            raise ValueError(f"{self.kind} [{N}, {K}]: row_kinds {self.row_kinds} do not add up to its rows and kinds")

    @property
    def group(self) -> int:
        """Weights a scale covers: rows of several types, the smallest of theirs (a 32-weight group's
        scale and min given to both its halves where it stands beside a 16-weight type)."""
        return min(BLOCK_TYPES[part].group for part in parts(self.kind))

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K), the dense matrix's shape."""
        return tuple(self.codes.shape)

    @property
    def form(self) -> Form:
        return Form(STORED, "float32", stored=self.kind)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ w^T, dequantized for the call: the exact, slow reference."""
        return F.linear(x, self.dequantize(x.dtype))

    def nbytes_by_kind(self) -> dict[str, int]:
        parts = [self.codes, self.scales] + ([self.mins] if self.mins is not None else [])
        return {"stored": sum(t.nbytes for t in parts)}

    def c_form(self, regroup: Regroup) -> None:
        return None  # fused_decode.c reads a stored matrix once laid out (blockdot.pack)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense matrix [N, K] in dtype, computed in float32 with gguf.quants.dequantize's
        arithmetic (bit-exact), then rounded to dtype."""
        N, K = self.shape
        G = self.group
        codes = self.codes.view(N, K // G, G).float()  # [N, K / G, G]
        if self.kind == "Q4_0":
            codes = codes - 8
        w = self.scales.unsqueeze(-1) * codes
        if self.mins is not None:
            w = w + self.mins.unsqueeze(-1)
        return w.view(N, K).to(dtype)

    def row_range(self, start: int, stop: int) -> BlockQuantized:
        """Rows start .. stop - 1 as a BlockQuantized [stop - start, K] over the same memory (a view:
        one expert of a stacked [X N, K] tensor)."""
        return BlockQuantized(self.kind, self.codes[start:stop], self.scales[start:stop],
                              None if self.mins is None else self.mins[start:stop])

    def rows(self, index: torch.Tensor) -> BlockQuantized:
        """The rows index [M] int64 of this matrix, as a BlockQuantized [M, K]."""
        return BlockQuantized(self.kind, self.codes.index_select(0, index), self.scales.index_select(0, index),
                              None if self.mins is None else self.mins.index_select(0, index))


def decode_blocks(raw: np.ndarray, kind: str) -> BlockQuantized:
    """GGUF row bytes raw [N, K / weights a block * bytes a block] uint8 -> BlockQuantized [N, K]:
    always copies, never the file's pages."""
    codes, scales, mins = unpack_rows(raw, kind)
    return BlockQuantized(kind, torch.from_numpy(codes), torch.from_numpy(scales),
                          None if mins is None else torch.from_numpy(mins))


def stacked_kind(matrices: list[tuple[str, int, tuple[tuple[str, int], ...] | None]]) -> tuple[
        str, tuple[tuple[str, int], ...] | None]:
    """The kind and row_kinds of matrices stacked along N (stack_rows), from each one's kind, rows
    and row_kinds: one kind stays itself; several are joined by '+' with each matrix's runs in order
    (None where some matrix's runs are not known)."""
    kinds = {kind for kind, _, _ in matrices}
    if len(kinds) == 1:
        return matrices[0][0], None
    kind = "+".join(sorted({part for k in kinds for part in parts(k)}))
    if not all("+" not in k or runs for k, _, runs in matrices):
        return kind, None
    return kind, tuple(run for k, rows, runs in matrices for run in (runs or ((k, rows),)))


def stack_rows(matrices: list[BlockQuantized]) -> BlockQuantized:
    """Block-quantized matrices stacked along N (q, k, v into one qkv): of one kind, as they are; of
    several (a llama.cpp mix: Q5_0 q and k beside a Q8_0 v, Q4_K beside Q6_K), their codes widened
    to int8 (Q4_0's q - 8), scales and mins as they are, in groups of the smallest (a group of 32
    beside groups of 16 gives its scale and min to both its halves): the same weights, exactly."""
    first = matrices[0]
    kind, row_kinds = stacked_kind([(m.kind, m.shape[0], m.row_kinds) for m in matrices])
    if all(m.kind == first.kind for m in matrices):
        return BlockQuantized(first.kind, torch.cat([m.codes for m in matrices]), torch.cat([m.scales for m in matrices]),
                              None if first.mins is None else torch.cat([m.mins for m in matrices]))
    group = min(m.group for m in matrices)
    codes = [(m.codes.to(torch.int8) - 8 if m.kind == "Q4_0" else m.codes.to(torch.int8)) for m in matrices]
    scales = [m.scales.repeat_interleave(m.group // group, dim=1) for m in matrices]
    mins = [torch.zeros_like(s) if m.mins is None else m.mins.repeat_interleave(m.group // group, dim=1)
            for m, s in zip(matrices, scales, strict=True)]
    with_mins = any(m.mins is not None for m in matrices)
    return BlockQuantized(kind, torch.cat(codes), torch.cat(scales), torch.cat(mins) if with_mins else None, row_kinds)


@dataclass(frozen=True)
class FileRows:
    """Rows of one block-quantized tensor, still in its file's bytes."""

    kind: str  # a key of ggml_blocks.BLOCK_TYPES
    raw: np.ndarray = field(repr=False)  # [n, bytes a row] uint8: rows of `file`'s map, or a copy of them (file None)
    file: GGUFFile | None = field(repr=False)
    order: torch.Tensor | None = None  # [N] int64: the row of raw each row is (None: raw's rows, in order)

    @property
    def num_rows(self) -> int:
        return self.raw.shape[0] if self.order is None else self.order.shape[0]

    @property
    def width(self) -> int:
        """K, the weights a row holds."""
        block = BLOCK_TYPES[self.kind]
        return self.raw.shape[1] // block.nbytes * block.weights

    def decode(self) -> BlockQuantized:
        """The rows unpacked (a copy), their pages of the map handed back (GGUFFile.release)."""
        raw = self.raw if self.order is None else self.raw[self.order.numpy()]
        decoded = decode_blocks(raw, self.kind)
        if self.file is not None:
            self.file.release(self.raw)
        return decoded


@dataclass(frozen=True)
class FileBlocks:
    """A block-quantized matrix [N, K] still in its GGUF file: rows of one or more of the file's
    tensors stacked along N (q, k and v as one qkv; one expert's gate and up, cut from the stacked
    experts), each a view of the file's memory map. It answers the weight protocol
    (nanoserve.model.forms) as the BlockQuantized it decodes to, decoding for each call; a layout
    decodes it once (`decode`), so a model holds one matrix's codes at a time on its way to its
    kernels' forms. The file stays mapped while one is alive (`in_memory`: a copy of its bytes)."""

    pieces: tuple[FileRows, ...]

    def __post_init__(self) -> None:
        widths = {piece.width for piece in self.pieces}
        if len(widths) != 1:
            raise ValueError(f"stacked rows need one width K; got {sorted(widths)}")

    @property
    def kind(self) -> str:
        return stacked_kind([(p.kind, p.num_rows, None) for p in self.pieces])[0]

    @property
    def row_kinds(self) -> tuple[tuple[str, int], ...] | None:
        return stacked_kind([(p.kind, p.num_rows, None) for p in self.pieces])[1]

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K), the dense matrix's shape."""
        return sum(p.num_rows for p in self.pieces), self.pieces[0].width

    @property
    def form(self) -> Form:
        return Form(STORED, "float32", stored=self.kind)

    def decode(self) -> BlockQuantized:
        """The matrix unpacked (nanoserve.model.ggml_blocks), a copy; the map's pages handed back."""
        decoded = [piece.decode() for piece in self.pieces]
        return decoded[0] if len(decoded) == 1 else stack_rows(decoded)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode()(x)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.decode().dequantize(dtype)

    def nbytes_by_kind(self) -> dict[str, int]:
        return {"stored": sum(p.num_rows * p.raw.shape[1] for p in self.pieces)}

    def c_form(self, regroup: Regroup) -> None:
        return None

    def rows(self, index: torch.Tensor) -> FileBlocks | BlockQuantized:
        """The rows index [M] int64, still in the file (one tensor's rows; stacked ones are decoded)."""
        if len(self.pieces) > 1:
            return self.decode().rows(index)
        (piece,) = self.pieces
        order = index if piece.order is None else piece.order.index_select(0, index)
        return FileBlocks((replace(piece, order=order),))

    def row_range(self, start: int, stop: int) -> FileBlocks | BlockQuantized:
        """Rows start .. stop - 1 (one expert of a stacked [X N, K] tensor), a view of the same bytes."""
        (piece,) = self.pieces
        if piece.order is not None:
            return self.rows(torch.arange(start, stop))
        return FileBlocks((replace(piece, raw=piece.raw[start:stop]),))

    def in_memory(self) -> FileBlocks:
        """The same rows with their bytes copied out of the map (the file may change or go)."""
        return FileBlocks(tuple(FileRows(p.kind, np.array(p.raw if p.order is None else p.raw[p.order.numpy()]),
                                         None) for p in self.pieces))


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_id: int  # the ggml type: a key of DENSE_TYPES or ggml_blocks.BY_ID when served
    shape: tuple[int, ...]  # torch order, (N, K) for a matrix: GGUF lists it reversed, K first
    start: int  # byte offset of its data in the file


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata and tensor directory, over a read-only memory map of the whole file."""

    metadata: dict[str, Any]  # key -> int, float, bool, str or a list of them
    tensors: dict[str, GGUFTensor]  # in file order
    mapped: np.ndarray  # [file bytes] uint8, read-only, over `mapping`
    mapping: mmap.mmap | None  # the map itself (None for an empty file)

    def release(self, raw: np.ndarray) -> None:
        """Takes the pages under `raw` (contiguous bytes of `mapped`) out of this process's resident
        memory once they have been read: madvise(MADV_DONTNEED) on a read-only file mapping drops the
        process's page-table entries only, so the file stays mapped and a later read faults the same
        bytes back in from the page cache."""
        if self.mapping is None or raw.size == 0 or not hasattr(self.mapping, "madvise"):
            return
        start = raw.__array_interface__["data"][0] - self.mapped.__array_interface__["data"][0]
        first = start - start % mmap.PAGESIZE
        self.mapping.madvise(mmap.MADV_DONTNEED, first, start + raw.nbytes - first)

    def type_name(self, name: str) -> str:
        type_id = self.tensors[name].type_id
        if type_id in DENSE_TYPES:
            return DENSE_TYPES[type_id][0]
        if type_id in BY_ID:
            return BY_ID[type_id].name
        try:
            from gguf import GGMLQuantizationType  # only to name a type nanoserve does not read
        except ImportError:
            return f"ggml type {type_id}"
        return GGMLQuantizationType(type_id).name

    def data(self, name: str) -> np.ndarray:
        """A served tensor's stored items, read-only: [N, K / weights a block * bytes a block] uint8
        for a block type (ggml_blocks.BLOCK_TYPES), else `shape` in its own dtype."""
        tensor = self.tensors[name]
        rows, cols = math.prod(tensor.shape[:-1]), tensor.shape[-1]
        block = BY_ID.get(tensor.type_id)
        if block is not None:
            if cols % block.weights:
                raise ValueError(f"tensor {name!r} is {block.name} with rows of {cols} weights, not a whole number "
                                 f"of its {block.weights}-weight blocks")
            row_bytes = cols // block.weights * block.nbytes
        else:
            row_bytes = cols * DENSE_TYPES[tensor.type_id][2]
        raw = self.mapped[tensor.start:tensor.start + rows * row_bytes]
        if raw.size != rows * row_bytes:
            raise ValueError(f"tensor {name!r} needs {rows * row_bytes} bytes at offset {tensor.start}; the file "
                             f"has {self.mapped.size} bytes (truncated?)")
        if block is not None:
            return raw.reshape(rows, row_bytes)
        return raw.view(DENSE_TYPES[tensor.type_id][1]).reshape(tensor.shape)

    def check_types(self) -> None:
        """Raises ValueError naming every tensor type nanoserve does not read, with how many tensors
        have it and the first of them, before anything is loaded."""
        unread: dict[str, list[str]] = {}
        for name, tensor in self.tensors.items():
            if tensor.type_id not in DENSE_TYPES and tensor.type_id not in BY_ID:
                unread.setdefault(self.type_name(name), []).append(name)
        if unread:
            listed = "; ".join(f"{kind} ({len(names)} tensor{'s' if len(names) > 1 else ''}, {names[0]!r} first)"
                               for kind, names in unread.items())
            raise ValueError(f"GGUF tensor types nanoserve does not read: {listed}. nanoserve reads "
                             f"{', '.join(GGUF_TYPES_SERVED)}")


SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2  # arrays of arrays (llama.cpp's merges are strings; nothing nests deeper)
MAX_ALIGNMENT = 2**20


def read_gguf_file(path: str | Path) -> GGUFFile:
    """Parses the header of GGUF version 2 or 3 (little-endian), checks it as untrusted input and
    maps the file.

    Every length and count is checked against the bytes left before it is used; tensor names and
    keys are unique; a tensor has 1 to MAX_DIMS dimensions of at least 1; `general.alignment` is a
    power of two; each tensor of a type nanoserve reads starts where the one before it ends, padded
    to the alignment, as llama.cpp's writer lays them out and its reader requires, and its bytes lie
    inside the file (a type nanoserve does not read is refused by check_types).

    Raises:
        ValueError: for a file that is not GGUF, a version other than 2 or 3, or a header that
            breaks any of the above, naming the file, the field, the value and the limit.
    """
    file = find_gguf(path)
    mapping = None
    if file.stat().st_size:
        with open(file, "rb") as f:  # the map keeps its own reference to the file
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mapped = np.frombuffer(mapping, dtype=np.uint8) if mapping is not None else np.zeros(0, np.uint8)
    buf = memoryview(mapped)
    size = len(buf)
    pos = 0

    def need(nbytes: int, what: str) -> None:
        if nbytes > size - pos:
            raise ValueError(f"{file} ends inside its header: {what} needs {nbytes} bytes at byte {pos}, the file "
                             f"ends at byte {size}")

    def take(fmt: str, what: str = "a number") -> Any:
        nonlocal pos
        need(struct.calcsize(fmt), what)
        (value,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value

    def take_string(what: str) -> str:
        nonlocal pos
        n = take("<Q", f"the length of {what}")
        need(n, what)
        pos += n
        return bytes(buf[pos - n:pos]).decode("utf-8", errors="replace")

    def take_value(value_type: int, key: str, depth: int = 0) -> Any:
        nonlocal pos
        if value_type == STRING:
            return take_string(f"the value of {key!r}")
        if value_type in SCALARS:
            return take(SCALARS[value_type], f"the value of {key!r}")
        if value_type != ARRAY:
            raise ValueError(f"{file}: metadata {key!r} has value type {value_type}, not a GGUF type (0..12)")
        if depth >= MAX_ARRAY_DEPTH:
            raise ValueError(f"{file}: metadata {key!r} nests arrays deeper than {MAX_ARRAY_DEPTH}")
        item_type, count = take("<I", f"the item type of {key!r}"), take("<Q", f"the length of {key!r}")
        if item_type in SCALARS:  # numbers in one read
            itemsize = struct.calcsize(SCALARS[item_type])
            need(count * itemsize, f"{count} items of {key!r}")
            items = np.frombuffer(buf, SCALARS[item_type], count, pos)
            pos += items.nbytes
            return items.tolist()
        need(count * 8, f"{count} items of {key!r}")  # a string or an array takes 8 bytes at least
        return [take_value(item_type, key, depth + 1) for _ in range(count)]

    need(4, "the magic")
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{file} is not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
    pos = 4
    version = take("<I", "the version")
    if version not in (2, 3):
        raise ValueError(f"{file} is GGUF version {version}: nanoserve reads versions 2 and 3 (little-endian)")
    num_tensors, num_keys = take("<Q", "the tensor count"), take("<Q", "the key count")
    metadata, infos = {}, {}
    for _ in range(num_keys):
        key = take_string("a metadata key")
        if key in metadata:
            raise ValueError(f"{file}: metadata key {key!r} appears twice")
        metadata[key] = take_value(take("<I", f"the value type of {key!r}"), key)
    for _ in range(num_tensors):
        name = take_string("a tensor name")
        if name in infos:
            raise ValueError(f"{file}: tensor {name!r} appears twice")
        num_dims = take("<I", f"the dimension count of {name!r}")
        if not 1 <= num_dims <= MAX_DIMS:
            raise ValueError(f"{file}: tensor {name!r} has {num_dims} dimensions; GGUF's are 1 to {MAX_DIMS}")
        dims = [take("<Q", f"a dimension of {name!r}") for _ in range(num_dims)]  # ne0 (K) first
        if not all(dims) or math.prod(dims) >= 2**48:
            raise ValueError(f"{file}: tensor {name!r} has dimensions {dims}: each must be >= 1, their product "
                             f"below 2**48")
        infos[name] = (take("<I", f"the type of {name!r}"), tuple(reversed(dims)), take("<Q", f"the offset of {name!r}"))
    alignment = metadata.get("general.alignment", 32)
    if (not isinstance(alignment, int) or isinstance(alignment, bool) or not 1 <= alignment <= MAX_ALIGNMENT
            or alignment & (alignment - 1)):
        raise ValueError(f"{file}: general.alignment={alignment!r} must be a power of two from 1 to {MAX_ALIGNMENT}")
    data_start = -(-pos // alignment) * alignment
    tensors = {name: GGUFTensor(name, type_id, shape, data_start + offset) for name, (type_id, shape, offset) in infos.items()}
    expected = 0  # where the next tensor's data starts, relative to data_start
    for name, (type_id, shape, offset) in infos.items():
        try:
            nbytes = _nbytes(type_id, shape)
        except ValueError as e:
            raise ValueError(f"{file}: tensor {name!r} is {e}") from None
        if nbytes is None:
            break  # a type nanoserve does not read: check_types names it
        if offset != expected:
            raise ValueError(f"{file}: tensor {name!r} has data offset {offset}; the tensors before it end at "
                             f"{expected} (offsets follow one another, each padded to general.alignment={alignment})")
        if data_start + offset + nbytes > size:
            raise ValueError(f"{file}: tensor {name!r} needs {nbytes} bytes at byte {data_start + offset}; the file "
                             f"ends at byte {size} (truncated?)")
        expected = -(-(offset + nbytes) // alignment) * alignment
    return GGUFFile(metadata, tensors, mapped, mapping)


def _nbytes(type_id: int, shape: tuple[int, ...]) -> int | None:
    """The bytes a tensor of a type nanoserve reads takes (None: a type it does not read).

    Raises:
        ValueError: a block type whose rows are not whole blocks.
    """
    rows, cols = math.prod(shape[:-1]), shape[-1]
    block = BY_ID.get(type_id)
    if block is not None:
        if cols % block.weights:
            raise ValueError(f"{block.name} with rows of {cols} weights, not a whole number of its "
                             f"{block.weights}-weight blocks")
        return rows * (cols // block.weights) * block.nbytes
    if type_id in DENSE_TYPES:
        return rows * cols * DENSE_TYPES[type_id][2]
    return None


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one GGUF `general.architecture` maps onto a Hugging Face checkpoint."""

    hf_architecture: str  # the config.json "architectures" entry
    permutes_qk: bool  # llama.cpp's converter interleaves the rotary halves of q/k rows; undone on load
    names: dict[str, str]  # GGUF tensor stem -> HF module name ("{i}" is the layer)
    # llama.cpp's converter stores Gemma's norm weights as 1 + w (its forward multiplies by them as
    # they are); the loader subtracts the 1 again, as transformers' GGUF loader does, and the model
    # adds it back (LlamaConfig.norm_offset).
    norm_shift: float = 0.0

    def as_hf(self, name: str, value: torch.Tensor | BlockQuantized | FileBlocks,
              head_dim: int) -> torch.Tensor | BlockQuantized | FileBlocks:
        """A tensor read from the file (`name`: its HF name) in Hugging Face's convention."""
        if self.permutes_qk and name.split(".")[-2] in ("q_proj", "k_proj"):
            # rows are output channels (blocks run along K); the interleaving is within each head
            order = qk_row_order(value.shape[0], value.shape[0] // head_dim)
            value = value.index_select(0, order) if isinstance(value, torch.Tensor) else value.rows(order)
        if self.norm_shift and name.endswith("norm.weight"):
            value = value.float() - self.norm_shift
        return value


LLAMA_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
}
QWEN3_NAMES = LLAMA_NAMES | {
    "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
    "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
}
# A sparse layer's tensors ("{{j}}": one per expert, stacked [X, N, K] in the file as llama.cpp's
# converter writes them, cut into per-expert views on load); Mixtral's under its own names.
MOE_NAMES = {
    "blk.{i}.ffn_gate_inp": "model.layers.{i}.mlp.gate",
    "blk.{i}.ffn_gate_exps": "model.layers.{i}.mlp.experts.{{j}}.gate_proj",
    "blk.{i}.ffn_up_exps": "model.layers.{i}.mlp.experts.{{j}}.up_proj",
    "blk.{i}.ffn_down_exps": "model.layers.{i}.mlp.experts.{{j}}.down_proj",
    "blk.{i}.ffn_gate_shexp": "model.layers.{i}.mlp.shared_expert.gate_proj",
    "blk.{i}.ffn_up_shexp": "model.layers.{i}.mlp.shared_expert.up_proj",
    "blk.{i}.ffn_down_shexp": "model.layers.{i}.mlp.shared_expert.down_proj",
    "blk.{i}.ffn_gate_inp_shexp": "model.layers.{i}.mlp.shared_expert_gate",
}
MIXTRAL_NAMES = {
    "blk.{i}.ffn_gate_inp": "model.layers.{i}.block_sparse_moe.gate",
    "blk.{i}.ffn_gate_exps": "model.layers.{i}.block_sparse_moe.experts.{{j}}.w1",
    "blk.{i}.ffn_up_exps": "model.layers.{i}.block_sparse_moe.experts.{{j}}.w3",
    "blk.{i}.ffn_down_exps": "model.layers.{i}.block_sparse_moe.experts.{{j}}.w2",
}
GEMMA2_NAMES = LLAMA_NAMES | {
    "blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.ffn_norm": "model.layers.{i}.pre_feedforward_layernorm",
    "blk.{i}.post_ffw_norm": "model.layers.{i}.post_feedforward_layernorm",
}
GEMMA3_NAMES = GEMMA2_NAMES | {
    "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
    "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
}
PHI3_NAMES = LLAMA_NAMES | {  # Phi-3's fused matrices keep their fusion in the file: attn_qkv, and gate/up as ffn_up
    "blk.{i}.attn_qkv": "model.layers.{i}.self_attn.qkv_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.gate_up_proj",
}
# Mistral's files are written as "llama" (with no sliding window: llama.cpp's converter drops it).
# Qwen's and Gemma's rope is HF's rotate-half layout already, so llama.cpp stores their q/k rows as
# they are; a bias (blk.N.attn_q.bias) takes its weight's name.
ARCHITECTURES = {
    "llama": GGUFArchitecture("LlamaForCausalLM", permutes_qk=True, names=LLAMA_NAMES),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", permutes_qk=False, names=LLAMA_NAMES),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", permutes_qk=False, names=QWEN3_NAMES),
    "gemma": GGUFArchitecture("GemmaForCausalLM", permutes_qk=False, names=LLAMA_NAMES, norm_shift=1.0),
    "gemma2": GGUFArchitecture("Gemma2ForCausalLM", permutes_qk=False, names=GEMMA2_NAMES, norm_shift=1.0),
    "gemma3": GGUFArchitecture("Gemma3ForCausalLM", permutes_qk=False, names=GEMMA3_NAMES, norm_shift=1.0),
    "phi3": GGUFArchitecture("Phi3ForCausalLM", permutes_qk=False, names=PHI3_NAMES),
    "smollm3": GGUFArchitecture("SmolLM3ForCausalLM", permutes_qk=True, names=LLAMA_NAMES),
    # Mixtral's files are "llama" with {arch}.expert_count (config_from_gguf reads them as Mixtral).
    "qwen3moe": GGUFArchitecture("Qwen3MoeForCausalLM", permutes_qk=False, names=QWEN3_NAMES | MOE_NAMES),
    "qwen2moe": GGUFArchitecture("Qwen2MoeForCausalLM", permutes_qk=False, names=LLAMA_NAMES | MOE_NAMES),
    "olmoe": GGUFArchitecture("OlmoeForCausalLM", permutes_qk=False, names=QWEN3_NAMES | MOE_NAMES),
}
# Tensors that hold rope's numbers, read into the config rather than the model: [Dr / 2] each.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
EXPERTS = "{j}"  # in an HF name: a stacked tensor's expert index


def names_of(spec: GGUFArchitecture, config: LlamaConfig) -> dict[str, str]:
    """The file's tensor stems -> HF names, for this architecture and config (Mixtral's names where
    a "llama" file has experts)."""
    return spec.names | MIXTRAL_NAMES if config.architecture == "MixtralForCausalLM" else spec.names


def find_gguf(path: str | Path) -> Path:
    """A .gguf file itself, or the one .gguf file in a directory.

    Raises:
        FileNotFoundError: when path does not exist.
        ValueError: for a file not named *.gguf, or a directory holding no or several .gguf files.
    """
    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) != 1:
            raise ValueError(f"{path} holds {len(found)} .gguf files {[f.name for f in found]}; expected exactly 1")
        return found[0]
    if not path.exists():
        raise FileNotFoundError(f"{path} not found")
    if path.suffix != ".gguf":
        raise ValueError(f"{path} is not a .gguf file")
    return path


def architecture_of(parsed: GGUFFile) -> tuple[str, GGUFArchitecture]:
    arch = parsed.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported: nanoserve reads {tuple(ARCHITECTURES)}")
    return arch, ARCHITECTURES[arch]


def config_from_gguf(parsed: GGUFFile) -> LlamaConfig:
    """The LlamaConfig of a parsed file (read_gguf_config's work, without re-reading the header).

    Raises:
        ValueError: metadata nanoserve does not run, outside its limits (LlamaConfig's checks), or of
            the wrong type, naming the key.
    """
    try:
        return _config_from_gguf(parsed)
    except (TypeError, KeyError, AttributeError, ZeroDivisionError, OverflowError) as e:
        raise ValueError(f"GGUF metadata nanoserve reads is missing or of the wrong type ({e!r})") from None


def _config_from_gguf(parsed: GGUFFile) -> LlamaConfig:
    arch, spec = architecture_of(parsed)
    meta = parsed.metadata

    def arch_key(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    num_heads = arch_key("attention.head_count")
    num_kv_heads = arch_key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        raise ValueError(f"{arch}.attention.head_count_kv={num_kv_heads} varies by layer: not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and (not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens)):
        raise ValueError("tokenizer.ggml.tokens must be a list of strings")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        if key in meta and (not isinstance(meta[key], list) or tokens is None or len(meta[key]) != len(tokens)):
            raise ValueError(f"{key} must be a list as long as tokenizer.ggml.tokens ({len(tokens or ())} entries)")
    for key, value in meta.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and tokens is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < len(tokens)):
            raise ValueError(f"{key}={value!r} is not a token id below the {len(tokens)} tokens")
    key_length, value_length = arch_key("attention.key_length"), arch_key("attention.value_length")
    if value_length is not None and value_length != key_length:
        raise ValueError(f"{arch}.attention.value_length={value_length!r} differs from attention.key_length="
                         f"{key_length!r}: nanoserve's heads have one width")
    d = {
        "architectures": [spec.hf_architecture],
        "vocab_size": len(tokens) if tokens is not None else arch_key("vocab_size"),
        "hidden_size": arch_key("embedding_length"),
        "intermediate_size": arch_key("feed_forward_length"),
        "num_hidden_layers": arch_key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": arch_key("attention.key_length"),
        "rms_norm_eps": arch_key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": arch_key("rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling(arch_key),
        "max_position_embeddings": arch_key("context_length", 2048),
        # llama.cpp drops output.weight when the head shares the embedding.
        "tie_word_embeddings": "output.weight" not in parsed.tensors,
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "rope_freq_factors": rope_freq_factors(parsed),
    }
    if arch == "gemma2":
        d |= gemma2_keys(arch_key, d)
    if arch == "gemma3":
        d |= gemma3_keys(arch_key, d)
    if arch == "phi3":
        d |= phi3_keys(parsed, arch_key, d)
    if arch == "smollm3":
        d["no_rope_layer_interval"] = 4  # llama.cpp's: every fourth layer without rope (the file says nothing)
    if arch_key("expert_count"):
        d |= moe_keys(parsed, arch, arch_key, d)
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if d[k] is None]
    if missing:
        raise ValueError(f"GGUF metadata gives no value for {missing} (architecture {arch!r})")
    config = LlamaConfig.from_hf_dict(d)
    rotated = arch_key("rope.dimension_count")
    if rotated is not None and rotated != config.rotary_dim:
        raise ValueError(f"{arch}.rope.dimension_count={rotated!r}: nanoserve rotates {config.rotary_dim} of each "
                         f"head's head_dim={config.head_dim} (only phi3 files rotate part of a head)")
    return config


def moe_keys(parsed: GGUFFile, arch: str, arch_key, d: dict[str, Any]) -> dict[str, Any]:
    """A mixture of experts' config.json keys from {arch}.expert_* and the tensors: a layer is sparse
    where the file has its router (blk.N.ffn_gate_inp). Whether the top k weights are renormalised
    is llama.cpp's choice for the architecture (Mixtral's and Qwen3-MoE's are, Qwen2-MoE's and
    OLMoE's are not) unless {arch}.expert_weights_norm says."""
    num_layers = d["num_hidden_layers"]
    sparse = [i for i in range(num_layers or 0) if f"blk.{i}.ffn_gate_inp.weight" in parsed.tensors]
    keys = {"num_experts": arch_key("expert_count"), "num_experts_per_tok": arch_key("expert_used_count"),
            "moe_intermediate_size": arch_key("expert_feed_forward_length", d["intermediate_size"]),
            "norm_topk_prob": arch_key("expert_weights_norm", arch in ("llama", "qwen3moe")),
            "mlp_only_layers": [i for i in range(num_layers or 0) if i not in sparse]}
    if arch == "llama":
        keys["architectures"] = ["MixtralForCausalLM"]
        keys["intermediate_size"] = keys["moe_intermediate_size"]
    if arch_key("expert_shared_feed_forward_length") is not None:
        keys["shared_expert_intermediate_size"] = arch_key("expert_shared_feed_forward_length")
    if d["intermediate_size"] is None:  # every layer sparse: no dense MLP width in the file
        keys["intermediate_size"] = keys["moe_intermediate_size"]
    return keys


def check_tensor_infos(parsed: GGUFFile, config: LlamaConfig, names: dict[str, str]) -> None:
    """Holds the file's tensor directory to what the config implies, before any tensor is read: each
    tensor one the model reads, in the shape it reads, and none missing.

    Raises:
        ValueError: naming the tensor, its shape and the expected one.
    """
    expected = expected_shapes(config)
    found = set()
    for gguf_name, tensor in parsed.tensors.items():
        if gguf_name in ROPE_TENSORS:
            want = (config.rotary_dim // 2,)
        else:
            name = hf_name(gguf_name, names)
            each = [name.format(j=j) for j in range(config.num_experts or 0)] if EXPERTS in name else [name]
            if not all(n in expected for n in each):
                raise ValueError(f"GGUF tensor {gguf_name!r} ({name}) is not one a {config.architecture} with this "
                                 "config reads")
            found.update(each)
            want = (len(each),) + expected[each[0]] if EXPERTS in name else expected[name]
            if name.endswith("shared_expert_gate.weight") and tensor.shape == want[1:]:
                want = want[1:]  # a [1, E] row the converter may write as [E]
        if tensor.shape != want:
            raise ValueError(f"GGUF tensor {gguf_name!r} has shape {list(tensor.shape)}, expected "
                             f"{list(want)} (the config's)")
    missing = sorted(expected.keys() - found)
    if missing:
        raise ValueError(f"GGUF file lacks {len(missing)} tensor(s) the config implies: {missing[:4]}")


def gemma2_keys(arch_key, d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's soft-capping, window and attention scale as llama.cpp reads them: a key the file
    lacks takes llama.cpp's default (transformers' too: caps 50 and 30, window 4096). The file has no
    query_pre_attn_scalar; llama.cpp scales queries by 1 / sqrt(head_dim), or by 1 / sqrt(E / H) for the
    46-layer (27B) model, and so does this config."""
    keys = {"attn_logit_softcapping": arch_key("attn_logit_softcapping"),
            "final_logit_softcapping": arch_key("final_logit_softcapping"),
            "sliding_window": arch_key("attention.sliding_window", 4096)}
    head_dim = d["head_dim"] or d["hidden_size"] // d["num_attention_heads"]
    keys["query_pre_attn_scalar"] = (d["hidden_size"] // d["num_attention_heads"] if d["num_hidden_layers"] == 46
                                     else head_dim)
    return {k: v for k, v in keys.items() if v is not None}


def gemma3_keys(arch_key, d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's windowed layers and their rope as llama.cpp reads them: a window only where the file
    has attention.sliding_window > 0; the windowed layers from attention.sliding_window_pattern (a
    flag a layer, or n: every n-th layer global), 6 where absent; the local layers' base from
    rope.freq_base_swa (10000 where absent). The query scale is llama.cpp's, 1 / sqrt(head_dim) (or
    1 / sqrt(E / H) for the 62-layer 27B model), as for Gemma 2; no attention soft-cap."""
    head_dim = d["head_dim"] or d["hidden_size"] // d["num_attention_heads"]
    keys = {"rope_local_base_freq": arch_key("rope.freq_base_swa", 10000.0),
            "query_pre_attn_scalar": (d["hidden_size"] // d["num_attention_heads"] if d["num_hidden_layers"] == 62
                                      else head_dim),
            "final_logit_softcapping": arch_key("final_logit_softcapping")}
    window = arch_key("attention.sliding_window")
    if window:
        pattern = arch_key("attention.sliding_window_pattern", 6)
        num_layers = d["num_hidden_layers"]
        if isinstance(pattern, list):
            if len(pattern) != num_layers:
                raise ValueError(f"gemma3.attention.sliding_window_pattern has {len(pattern)} flags for {num_layers} layers")
            windowed = [bool(flag) for flag in pattern]
        else:
            if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
                raise ValueError(f"gemma3.attention.sliding_window_pattern={pattern!r} must be an integer >= 1")
            windowed = [i % pattern < pattern - 1 for i in range(num_layers)]
        keys |= {"sliding_window": window,
                 "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed]}
    else:
        keys["sliding_window"] = None
    return {k: v for k, v in keys.items() if v is not None or k == "sliding_window"}


def phi3_keys(parsed: GGUFFile, arch_key, d: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's partial rotary (rope.dimension_count of each head's D), its window (attention.sliding_window,
    0 for none; llama.cpp's own Phi-3 graph ignores it, transformers does not) and LongRoPE: the
    factors as the tensors rope_factors_long / rope_factors_short, rope.scaling.attn_factor and
    rope.scaling.original_context_length."""
    head_dim = d["head_dim"] or d["hidden_size"] // d["num_attention_heads"]
    keys: dict[str, Any] = {"partial_rotary_factor": arch_key("rope.dimension_count", head_dim) / head_dim,
                            "sliding_window": arch_key("attention.sliding_window") or None}
    factors = {}
    for which in ("long", "short"):
        name = f"rope_factors_{which}.weight"
        if name in parsed.tensors:
            if parsed.tensors[name].type_id != 0:
                raise ValueError(f"tensor {name!r} is {parsed.type_name(name)}: nanoserve reads it as F32")
            factors[f"{which}_factor"] = np.asarray(parsed.data(name), dtype=np.float64).tolist()
    if factors:
        if len(factors) != 2:
            raise ValueError(f"the file has {sorted(factors)} of LongRoPE's long_factor and short_factor; both or neither")
        keys["original_max_position_embeddings"] = arch_key("rope.scaling.original_context_length")
        keys["rope_scaling"] = {"rope_type": "longrope", **factors, "attention_factor": arch_key("rope.scaling.attn_factor")}
        keys["rope_scaling"] = {k: v for k, v in keys["rope_scaling"].items() if v is not None}
    return keys


def rope_scaling(arch_key) -> dict[str, Any] | None:
    """{arch}.rope.scaling.* as an HF rope_scaling dict; LlamaConfig refuses the types it does not run."""
    kind, factor = arch_key("rope.scaling.type"), arch_key("rope.scaling.factor")
    if kind is None and arch_key("rope.scale_linear") is not None:  # the key older converters wrote
        kind, factor = "linear", arch_key("rope.scale_linear")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": factor}
    if arch_key("rope.scaling.original_context_length") is not None:
        scaling["original_max_position_embeddings"] = arch_key("rope.scaling.original_context_length")
    return scaling


def rope_freq_factors(parsed: GGUFFile) -> list[float] | None:
    """rope_freqs.weight, the [D / 2] divisors llama.cpp applies to each rotary frequency (Llama 3.x
    files keep their rope scaling there, not in the metadata), or None."""
    if ROPE_FREQS not in parsed.tensors:
        return None
    if parsed.tensors[ROPE_FREQS].type_id != 0:
        raise ValueError(f"tensor {ROPE_FREQS!r} is {parsed.type_name(ROPE_FREQS)}: nanoserve reads it as F32")
    return np.asarray(parsed.data(ROPE_FREQS), dtype=np.float64).tolist()


def read_gguf_config(path: str | Path) -> LlamaConfig:
    """The LlamaConfig a GGUF file's metadata describes (path: the file or its directory).

    Raises:
        ValueError: for an architecture not in ARCHITECTURES (naming it), missing metadata, or rope
            scaling nanoserve does not run.
    """
    return config_from_gguf(read_gguf_file(path))


def qk_row_order(num_rows: int, num_heads: int) -> torch.Tensor:
    """[num_rows] int64: the GGUF row holding each HF row of a q/k projection.

    llama.cpp stores each head's D rows as (D/2 pairs, 2), interleaving the two rotary halves that
    HF keeps as (2, D/2): HF row h D + j D/2 + i is GGUF row h D + 2 i + j.
    """
    half = num_rows // num_heads // 2
    return torch.arange(num_rows).view(num_heads, half, 2).transpose(1, 2).reshape(num_rows)


def hf_name(gguf_name: str, names: dict[str, str]) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    key = f"blk.{{i}}.{layer.group(2)}" if layer else stem
    if key not in names or suffix not in ("weight", "bias"):
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face name in nanoserve's table")
    return names[key].format(i=layer.group(1) if layer else "") + "." + suffix


def load_tensor(parsed: GGUFFile, name: str) -> torch.Tensor | BlockQuantized:
    """One tensor in GGUF row order: BlockQuantized [N, K] (decoded), or dense (copied out of the
    map, own dtype).

    Raises:
        ValueError: file_tensor's.
    """
    value = file_tensor(parsed, name)
    return value.decode() if isinstance(value, FileBlocks) else value


def file_tensor(parsed: GGUFFile, name: str) -> torch.Tensor | FileBlocks:
    """One tensor in GGUF row order: FileBlocks [N, K], still in the file, or dense (copied out of
    the map, own dtype, its pages handed back).

    Raises:
        ValueError: naming the tensor and its GGUF type when that type is not in GGUF_TYPES_SERVED.
    """
    tensor = parsed.tensors[name]
    if tensor.type_id not in DENSE_TYPES and tensor.type_id not in BY_ID:
        raise ValueError(f"tensor {name!r} has GGUF type {parsed.type_name(name)}: "
                         f"nanoserve reads {', '.join(GGUF_TYPES_SERVED)}")
    kind, data = parsed.type_name(name), parsed.data(name)
    if kind in BLOCK_TYPES:
        if len(tensor.shape) not in (2, 3):
            raise ValueError(f"tensor {name!r} is {kind} of shape {tensor.shape}: only matrices and stacks of them "
                             "are read")
        return FileBlocks((FileRows(kind, data, parsed),))  # a stack [X, N, K] as its [X N, K] rows
    dense = torch.from_numpy(np.array(data))  # a copy: writable memory the tensor owns, not the file's pages
    parsed.release(data)
    return dense.view(torch.bfloat16) if kind == "BF16" else dense


ROPE_FREQS = "rope_freqs.weight"  # Llama 3.x's rope scaling as llama.cpp's converter writes it: [D / 2] divisors


def load_gguf(path: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor | FileBlocks]]:
    """The config and Hugging Face-named tensors of a GGUF file (path: the file or its directory).

    Quantized matrices (every type in ggml_blocks.BLOCK_TYPES) come back as FileBlocks [N, K], still
    in the file (a stacked tensor's experts each a view of its rows); F32/F16/BF16 as dense tensors
    in their own dtype. q_proj/k_proj rows come back in HF order.
    lm_head.weight is present only when the file has its own output.weight
    (config.tie_word_embeddings is False). rope_freqs.weight goes into the config.

    Raises:
        ValueError: naming every tensor type not in GGUF_TYPES_SERVED (before anything is read),
            a tensor whose name has no HF equivalent; and read_gguf_config's errors.
    """
    parsed = read_gguf_file(path)
    parsed.check_types()
    config = config_from_gguf(parsed)
    _, spec = architecture_of(parsed)
    names = names_of(spec, config)
    check_tensor_infos(parsed, config, names)
    tensors: dict[str, torch.Tensor | FileBlocks] = {}
    for gguf_name in parsed.tensors:
        if gguf_name in ROPE_TENSORS:
            continue
        name = hf_name(gguf_name, names)
        value = file_tensor(parsed, gguf_name)
        if EXPERTS in name:  # [X, N, K] stacked: expert j is a view of its rows, decoded on its own
            X, N = parsed.tensors[gguf_name].shape[:2]
            for j in range(X):
                tensors[name.format(j=j)] = (value.row_range(j * N, (j + 1) * N) if isinstance(value, FileBlocks)
                                             else value[j])
            continue
        if name.endswith("shared_expert_gate.weight"):
            value = value.reshape(1, -1)
        tensors[name] = spec.as_hf(name, value, config.head_dim)
    return config, tensors


def load_gguf_tokenizer(path: str | Path, cache: Path | None = None):
    """A Hugging Face tokenizer that transformers builds from the GGUF's tokenizer.ggml.* metadata,
    saved the first time (tokenizer.json, its config, the chat template) under `cache` (default:
    the nanoserve cache folder), keyed by the file's path, size and modification time, and read
    from there later: the same tokenizer (test_gguf), 45 MiB resident where the conversion left 78
    (the default model, measured on a Zen 3). Where the folder cannot be written it converts each time."""
    from transformers import AutoTokenizer

    from nanoserve.model.default import cache_dir

    file = find_gguf(path)
    stat = file.stat()
    key = hashlib.sha256(f"{file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    saved = (cache or cache_dir().parent) / f"tokenizer-{key}"
    if (saved / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(saved)
    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except Exception as e:  # transformers' reading of untrusted metadata: whatever it raised, named
        raise ValueError(f"{file}: transformers could not build a tokenizer from its tokenizer.ggml.* metadata "
                         f"({e!r})") from None
    built = None
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        built = tempfile.mkdtemp(dir=saved.parent)  # written aside, then renamed: concurrent starts are safe
        tokenizer.save_pretrained(built)
        os.rename(built, saved)
    except OSError:  # unwritable, or another process saved the same tokenizer first
        if built is not None:
            shutil.rmtree(built, ignore_errors=True)
    return tokenizer
