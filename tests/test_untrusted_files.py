"""A model file is untrusted input: every value its header claims is checked before it is used.

The named cases are the ones a new user hit with copies of a valid file altered one field at a time;
the fuzz tests mutate a small valid file's header fields, tensor infos and lengths (located by
gguf-py's own reader, an independent parser), truncate it, and alter a checkpoint directory's
config.json and safetensors header. Each load must end in a ValueError with a message, or in a model
whose logits equal the original's bit for bit (a mutation can be harmless: a key nanoserve does not
read). The loads here build the model as stored and run torch's forward (no C kernel reads what the
loader hands it), so no case can crash by a signal in this process; `nanoserve serve` on bad files
runs as a subprocess.
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import make_hf_llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_gguf import write_tiny_gguf

from nanoserve.instruments.accuracy import teacher_forced_logits
from nanoserve.model.config import LlamaConfig
from nanoserve.model.gguf import load_gguf
from nanoserve.model.llama import LlamaModel
from nanoserve.model.weights import load_model

IDS = [1, 5, 9, 3, 7]


def one_thread(logits_of):
    """logits_of run on one thread: the bits compared are summed in one order, in a module fixture
    (run before conftest's one-thread fixture) as in a test."""
    def run(path: Path) -> torch.Tensor:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return logits_of(path)
        finally:
            torch.set_num_threads(before)
    return run


@one_thread
def gguf_logits(path: Path) -> torch.Tensor:
    """The file loaded as stored and run by torch's forward: logits [len(IDS), V]."""
    config, tensors = load_gguf(path)
    return teacher_forced_logits(LlamaModel.from_state_dict(config, tensors, torch.float32, "cpu", 64), IDS)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[bytes, torch.Tensor]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path.read_bytes(), gguf_logits(path)


def reader_parts(raw: bytes, path: Path) -> list[tuple[str, int, np.dtype]]:
    """(what, byte offset, dtype) of every number in the header as gguf-py's reader finds it: the
    counts, each key's and name's length, value types, scalar values, array item types and lengths,
    tensor dimension counts, dimensions, types and offsets (string bytes left out)."""
    path.write_bytes(raw)
    reader = gguf.GGUFReader(path)
    base = reader.data.ctypes.data
    found = []
    for field in list(reader.fields.values()) + [t.field for t in reader.tensors]:
        for i, part in enumerate(field.parts):
            if part.dtype == np.uint8 and part.size > 1:
                continue  # a string's bytes
            for j in range(min(part.size, 4)):  # a numeric array's first items
                found.append((f"{field.name}[{i}][{j}]", part.ctypes.data - base + j * part.itemsize, part.dtype))
    return found


# Values a mutated number takes: the edges of its width, and floats no count, scale or rate can be.
INTS = [0, 1, 2, 3, 255, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**48, 2**63 - 1, 2**63, 2**64 - 1]
FLOATS = [math.nan, math.inf, -math.inf, 0.0, -1.0]


def mutated(raw: bytes, offset: int, dtype: np.dtype, choice: int) -> bytes:
    if dtype.kind == "f":
        value = np.array(FLOATS[choice % len(FLOATS)], dtype=dtype)
    else:
        bits = dtype.itemsize * 8
        value = np.array(INTS[choice % len(INTS)] % 2**bits, dtype=f"<u{dtype.itemsize}")
    return raw[:offset] + value.tobytes() + raw[offset + dtype.itemsize:]


def refused_or_unchanged(path: Path, original: torch.Tensor, load=gguf_logits) -> str:
    """'refused' (a ValueError with a message) or 'unchanged' (the original's logits, bit for bit)."""
    try:
        logits = load(path)
    except ValueError as e:
        assert str(e), "a ValueError with no message"
        return "refused"
    assert torch.equal(logits, original), "the file loaded and answers otherwise than the original"
    return "unchanged"


@settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_mutated_gguf_header_is_refused_or_harmless(tiny_gguf, tmp_path, data):
    raw, original = tiny_gguf
    parts = reader_parts(raw, tmp_path / "original.gguf")
    what, offset, dtype = data.draw(st.sampled_from(parts), label="field")
    bad = mutated(raw, offset, dtype, data.draw(st.integers(0, 99), label="value"))
    (tmp_path / "bad.gguf").write_bytes(bad)
    refused_or_unchanged(tmp_path / "bad.gguf", original)


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_truncated_gguf_is_refused(tiny_gguf, tmp_path, data):
    # (Bytes scribbled over the header's strings can rename a key nanoserve reads with a default, such
    # as the norm's epsilon: a file no reader can tell from a valid one. Numbers are mutated above.)
    raw, original = tiny_gguf
    bad = raw[:data.draw(st.integers(0, len(raw) - 1), label="length")]
    (tmp_path / "bad.gguf").write_bytes(bad)
    assert refused_or_unchanged(tmp_path / "bad.gguf", original) == "refused"


def with_value(raw: bytes, path: Path, key: str, value: int | float) -> bytes:
    """raw with metadata `key`'s scalar set to value (gguf-py's reader finds it)."""
    path.write_bytes(raw)
    reader = gguf.GGUFReader(path)
    field = reader.fields[key]
    part = field.parts[field.data[0]]
    offset = part.ctypes.data - reader.data.ctypes.data
    encoded = np.array(value, dtype=part.dtype).tobytes()
    return raw[:offset] + encoded + raw[offset + len(encoded):]


@pytest.mark.parametrize("key, value, message", [
    ("llama.block_count", 0, "num_hidden_layers=0 must be an integer from 1 to"),
    ("tokenizer.ggml.bos_token_id", 10**9, "tokenizer.ggml.bos_token_id=1000000000 is not a token id below"),
    ("llama.attention.layer_norm_rms_epsilon", math.nan, "rms_norm_eps=nan must be a number > 0"),
    ("llama.rope.freq_base", math.inf, "rope_theta=inf must be a finite number > 0"),
    ("llama.attention.head_count", 0, "num_attention_heads=0 must be an integer from 1 to"),
    ("llama.context_length", 0, "max_position_embeddings=0 must be an integer from 1 to"),
])
def test_the_named_cases_are_refused_by_name(tiny_gguf, tmp_path, key, value, message):
    raw, _ = tiny_gguf
    (tmp_path / "bad.gguf").write_bytes(with_value(raw, tmp_path / "o.gguf", key, value))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        gguf_logits(tmp_path / "bad.gguf")


def test_a_file_holding_only_the_magic_or_nothing_is_refused(tmp_path):
    for content, message in ((b"GGUF", "ends inside its header: the version needs 4 bytes at byte 4"),
                             (b"", "ends inside its header: the magic needs 4 bytes at byte 0")):
        (tmp_path / "x.gguf").write_bytes(content)
        with pytest.raises(ValueError, match=message):
            load_gguf(tmp_path / "x.gguf")


def test_rope_dimensions_and_misaligned_data_are_refused(tiny_gguf, tmp_path):
    raw, _ = tiny_gguf
    path = tmp_path / "rope.gguf"
    write_tiny_gguf(path, extra=lambda writer: writer.add_rope_dimension_count(1024))  # the head is 16 wide
    with pytest.raises(ValueError, match=r"rope.dimension_count=1024: nanoserve rotates 16 of each head's head_dim=16 "
                                         r"\(only phi3 files rotate part of a head\)"):
        load_gguf(path)
    # the last tensor's data moved off the alignment: its offset + 1
    path.write_bytes(raw)
    reader = gguf.GGUFReader(path)
    last = reader.tensors[-1]
    offset_part = last.field.parts[-1]
    at = offset_part.ctypes.data - reader.data.ctypes.data
    moved = int(offset_part[0]) + 1
    (tmp_path / "bad.gguf").write_bytes(raw[:at] + struct.pack("<Q", moved) + raw[at + 8:])
    with pytest.raises(ValueError, match=f"tensor {last.name!r} has data offset {moved}"):
        load_gguf(tmp_path / "bad.gguf")


# ---- checkpoint directories: config.json and safetensors headers ---------------------------------------


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    folder = tmp_path_factory.mktemp("checkpoint")
    make_hf_llama(seed=3).save_pretrained(folder)
    return folder, checkpoint_logits(folder)


@one_thread
def checkpoint_logits(folder: Path) -> torch.Tensor:
    return teacher_forced_logits(load_model(folder, torch.float32, "cpu", 64), IDS)


def copy_checkpoint(source: Path, into: Path) -> Path:
    into.mkdir(exist_ok=True)
    for file in source.iterdir():
        (into / file.name).write_bytes(file.read_bytes())
    return into


# Values no count, rate or switch nanoserve reads may take (or that leave it as it was: None and an
# empty value fall back to the default where there is one); a valid value of the right type, such as
# a larger rope_theta, makes another model, which no reader can tell from the file.
CONFIG_VALUES = [0, -1, -0.0, math.nan, math.inf, "7", None, [], {}, True]


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_mutated_config_json_is_refused_or_harmless(tiny_checkpoint, tmp_path, data):
    source, original = tiny_checkpoint
    folder = copy_checkpoint(source, tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    key = data.draw(st.sampled_from(sorted(config)), label="key")
    value = data.draw(st.sampled_from(CONFIG_VALUES), label="value")
    if (isinstance(config[key], bool) and isinstance(value, bool)) or (
            key in ("bos_token_id", "eos_token_id", "pad_token_id") and value == 0):
        return  # a switch flipped, or a token id that stays valid: another model, not a malformed file
    config[key] = value
    (folder / "config.json").write_text(json.dumps(config))  # NaN and Infinity as Python's json writes them
    refused_or_unchanged(folder, original, checkpoint_logits)


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_mutated_safetensors_header_is_refused_or_harmless(tiny_checkpoint, tmp_path, data):
    source, original = tiny_checkpoint
    folder = copy_checkpoint(source, tmp_path / "ckpt")
    file = folder / "model.safetensors"
    raw = file.read_bytes()
    (length,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8:8 + length])
    name = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")), label="tensor")
    field = data.draw(st.sampled_from(["shape", "data_offsets", "dtype", "length"]), label="field")
    if field == "length":
        raw = struct.pack("<Q", data.draw(st.sampled_from([0, 1, length - 1, length + 1, 2**40, 2**64 - 1]))) + raw[8:]
    else:
        entry = header[name]
        if field == "shape":
            entry["shape"] = data.draw(st.sampled_from([[], [0], [2**40, 2], entry["shape"][::-1] + [1], [-1, 3]]))
        elif field == "data_offsets":
            begin, end = entry["data_offsets"]
            entry["data_offsets"] = data.draw(st.sampled_from([[begin + 1, end + 1], [end, begin], [0, 2**62],
                                                               [begin, end + 4]]))
        else:
            entry["dtype"] = data.draw(st.sampled_from(["F16", "I64", "BOOL", "Q4", ""]))
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        raw = struct.pack("<Q", len(text)) + text + raw[8 + length:]
    file.write_bytes(raw)
    refused_or_unchanged(folder, original, checkpoint_logits)


def test_config_values_of_the_wrong_type_are_refused_by_name():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    for change, message in [({"num_attention_heads": "4"}, "num_attention_heads='4' must be an integer"),
                            ({"hidden_size": 2**30}, "hidden_size=1073741824 must be an integer from 1 to 1048576"),
                            ({"head_dim": 7}, "head_dim=7 must be even"),
                            ({"eos_token_id": [2, 97]}, "eos_token_id=97 is not a token id below vocab_size=97"),
                            ({"rope_theta": "x"}, "rope_theta='x' must be a finite number > 0"),
                            ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}},
                             r"rope_scaling\['factor'\]=-2.0 must be a finite number > 0")]:
        with pytest.raises(ValueError, match=message):
            LlamaConfig.from_hf_dict(base | change)
    with pytest.raises(ValueError, match="a config is a JSON object, not list"):
        LlamaConfig.from_hf_dict([1, 2])  # type: ignore[arg-type]


@pytest.mark.slow
def test_serve_on_a_bad_file_exits_2_with_one_line(tiny_gguf, tmp_path):
    raw, _ = tiny_gguf
    (tmp_path / "magic.gguf").write_bytes(b"GGUF")
    (tmp_path / "layers.gguf").write_bytes(with_value(raw, tmp_path / "o.gguf", "llama.block_count", 0))
    for name, message in (("magic.gguf", "ends inside its header"), ("layers.gguf", "num_hidden_layers=0")):
        proc = subprocess.run([sys.executable, "-m", "nanoserve", "serve", "--model", str(tmp_path / name),
                               "--port", "0"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("nanoserve serve: error: ") and message in lines[0], lines
