"""Checkpoints: directories of config.json, safetensors (single or sharded) and
generation_config.json, or GGUF files (nanoserve.model.gguf).

Weights are read with safetensors or the GGUF reader only: nothing here unpickles.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from nanoserve.model.config import LlamaConfig, expected_shapes, text_model_name
from nanoserve.model.llama import LlamaModel


def load_config(path: str | Path) -> LlamaConfig:
    """Reads config.json, taking EOS ids from generation_config.json where it has them."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: a checkpoint directory needs config.json")
    d = read_json(config_file)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        gen = read_json(gen_file)
        if isinstance(gen, dict) and gen.get("eos_token_id") is not None:
            d["eos_token_id"] = gen["eos_token_id"]
    try:
        return LlamaConfig.from_hf_dict(d)
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from None


def read_json(file: Path) -> Any:
    """A JSON file's value.

    Raises:
        ValueError: naming the file, where it is not UTF-8 JSON.
    """
    try:
        return json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{file} is not JSON: {e}") from None


def safetensors_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        value = read_json(index)
        weight_map = value.get("weight_map") if isinstance(value, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and "/" not in v and v.endswith(".safetensors")
                                                       for v in weight_map.values()):
            raise ValueError(f"{index}: weight_map must map tensor names to .safetensors files in {path}")
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path} (nanoserve never loads pickled checkpoints)")
    return files


def load_tensors(path: str | Path, shapes: dict[str, tuple[int, ...]] | None = None,
                 config: LlamaConfig | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's safetensors files. shapes: the tensors the model reads and their
    shapes (expected_shapes), held to the files' headers before any tensor is read; tensors the
    model does not read are left unread. config: names the tensors as the model reads them
    (text_model_name: a multimodal checkpoint's language model).

    Raises:
        ValueError: a file whose header safetensors refuses, or a tensor of another shape than the
            config implies, named.
    """
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                names = {name: text_model_name(config, name) if config is not None else name
                         for name in f.keys()}  # noqa: SIM118
                names = {stored: name for stored, name in names.items() if shapes is None or name in shapes}
                for stored, name in names.items():
                    got = tuple(f.get_slice(stored).get_shape())
                    if shapes is not None and got != shapes[name]:
                        raise ValueError(f"{file}: tensor {stored!r} has shape {list(got)}, expected "
                                         f"{list(shapes[name])} (the config's)")
                for stored, name in names.items():
                    tensors[name] = f.get_tensor(stored)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file} is not a safetensors file nanoserve reads: {e}") from None
    return tensors  # one the config implies and no file holds: LlamaModel.from_state_dict names it


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device | str,
               max_positions: int | None = None) -> LlamaModel:
    config = load_config(path)
    return LlamaModel.from_state_dict(config, load_tensors(path, expected_shapes(config), config), dtype, device,
                                      max_positions)


def checkpoint_source(path: str | Path | None) -> tuple[Path, bool]:
    """(what to read, whether it is GGUF): a .gguf file, the one .gguf in a directory holding no
    config.json, or a checkpoint directory; None: the embedded default model's own GGUF file."""
    from nanoserve.model.default import gguf_path
    from nanoserve.model.gguf import find_gguf

    path = Path(path) if path is not None else gguf_path()
    if path.suffix == ".gguf" or (path.is_dir() and not (path / "config.json").is_file()):
        return find_gguf(path), True
    return path, False


def load_tokenizer(source: Path, is_gguf: bool) -> Any:
    """The Hugging Face tokenizer of a checkpoint_source."""
    if is_gguf:
        from nanoserve.model.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(source)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def load_checkpoint(path: str | Path | None, device: torch.device | str,
                    max_positions: int | None = None) -> tuple[LlamaModel, Any]:
    """The model as stored (dense weights in float32, a GGUF's quantized matrices as stored) and its
    tokenizer, from a checkpoint directory, a .gguf file or a directory holding one and no
    config.json; None: the embedded default model's own GGUF file."""
    source, is_gguf = checkpoint_source(path)
    return load_stored(source, is_gguf, device, max_positions), load_tokenizer(source, is_gguf)


def load_stored(source: Path, is_gguf: bool, device: torch.device | str,
                max_positions: int | None = None) -> LlamaModel:
    """The model of a checkpoint_source as stored: dense weights in float32, a GGUF's quantized
    matrices as stored."""
    from nanoserve.model.gguf import load_gguf

    if is_gguf:
        config, tensors = load_gguf(source)
        return LlamaModel.from_state_dict(config, tensors, torch.float32, device, max_positions)
    return load_model(source, torch.float32, device, max_positions)


def return_freed_memory() -> None:
    """Hands the heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing).

    Loading and laying out a model allocates and frees a few hundred MB of temporaries (a GGUF's
    codes unpacked a byte per weight, float32 matrices on their way to bf16 copies). glibc keeps
    freed memory for reuse, and after large frees its mmap threshold rises, so those pages stay
    resident: 222 of the default engine's 1,203 MiB, measured with psutil.
    """
    libc_name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(libc_name), "malloc_trim", None) if libc_name else None
    if trim is not None:
        gc.collect()
        trim(0)
