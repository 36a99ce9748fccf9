"""Batch invariance: a request's tokens and logprobs depend on its prompt, its parameters and its
seed, never on what else the engine runs.

The reference is each request run alone in a quiet engine (the whole prompt in one step, no prefix
cache, a pool that never preempts). Against it, hypothesis draws what a serving engine meets: which
requests arrive, in what order and at which step, how many run at once, the token budget that cuts
prompts into chunks, the prefix cache, a pool small enough to preempt, deferred output; greedy and
seeded sampling. Every token and every logprob (the logits row's bits, through log_softmax) must
equal the quiet run's, on every invariant path the plan can choose.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CharTokenizer, config_of, make_hf_model, nanoserve_model_from_hf
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.model import blockdot
from nanoserve.model.plan import resolve_plan

needs_build = pytest.mark.skipif(blockdot.library() is None, reason=f"blockdot not built here: {blockdot.failure()}")

BLOCK = 4
SYSTEM = [5, 9, 13, 22, 7, 41, 3, 8]  # two full blocks every prompt but the last starts with: prefix-cache hits
PROMPTS = [SYSTEM + [60, 33, 21], SYSTEM + [17, 4, 4, 90, 12, 6], SYSTEM + [30 + i % 50 for i in range(40)],
           SYSTEM + [11], SYSTEM + [70 - i for i in range(20)],
           [20 + (7 * i) % 70 for i in range(150)]]  # many of attention's parts (PART keys) merged, and more keys than a part's scratch
MAX_TOKENS = [10, 7, 12, 9, 8, 10]
POOL = {"small": 48, "large": 400}  # small: the long prompt alone takes 41 blocks, so others are preempted

# Every invariant path the plan can choose for a Llama: float32 or bf16, dense panels or blockdot's
# int4 (x in float32, or rounded to int16 from one row), a float16 K/V cache or one of llama.cpp's blocks.
PATHS = {
    "float32-dense": {"dtype": "float32", "quantization": None, "batch_invariant": True},
    "bf16-dense": {"dtype": "bfloat16", "quantization": None},
    "float32-int4": {"dtype": "float32", "quantization": "int4", "blockdot_int16_rows": None},
    "bf16-int4-int16": {"dtype": "bfloat16", "quantization": "int4"},
    "float32-int4-f16-cache": {"dtype": "float32", "quantization": "int4", "kv_cache_dtype": "float16"},
    "float32-int4-q8_0-cache": {"dtype": "float32", "quantization": "int4", "kv_cache_dtype": "q8_0"},
    "bf16-dense-q4_0-cache": {"dtype": "bfloat16", "quantization": None, "kv_cache_dtype": "q4_0"},
}
_MODELS: dict[tuple[str, int], object] = {}


def tiny_model(family: str = "llama", seed: int = 41, **hf_overrides):
    key = (family + repr(sorted(hf_overrides.items())), seed)
    if key not in _MODELS:
        _MODELS[key] = make_hf_model(family, seed, **hf_overrides)
    return _MODELS[key]


def path_model(path: dict):
    """The tiny Llama a path runs: heads of 64 values (two of llama.cpp's blocks of 32, turned by a
    Walsh-Hadamard matrix before the store: nanoserve.model.kv_quant) where its K/V cache is in those blocks."""
    return tiny_model(head_dim=64) if path.get("kv_cache_dtype") in ("q8_0", "q4_0") else tiny_model()


def engine(hf, path: dict, **fields) -> Engine:
    config = config_of(**({"block_size": BLOCK, "num_kv_blocks": POOL["large"], "max_num_seqs": 8,
                           "max_num_batched_tokens": 512} | path | fields))
    built = Engine(nanoserve_model_from_hf(hf), CharTokenizer(hf.config.vocab_size), config)
    assert built.plan.is_batch_invariant, built.plan.render()
    return built


def params(index: int, sampled: bool) -> SamplingParams:
    common = {"max_tokens": MAX_TOKENS[index], "ignore_eos": True, "logprobs": 2}
    if not sampled:
        return SamplingParams(temperature=0.0, **common)
    return SamplingParams(temperature=0.9, top_k=30, top_p=0.95, seed=1000 + index, **common)


def answer(output) -> tuple[list[int], list[dict[int, float]]]:
    return list(output.token_ids), [dict(d) for d in output.logprobs]


_QUIET: dict[tuple, tuple] = {}


def quiet(hf, path_name: str, path: dict, index: int, sampled: bool) -> tuple:
    """The request alone in a quiet engine: its whole prompt in one step, nothing cached, no preemption."""
    key = (id(hf), path_name, index, sampled)
    if key not in _QUIET:
        alone = engine(hf, path, max_num_seqs=1, enable_prefix_caching=False)
        _QUIET[key] = answer(alone.generate([PROMPTS[index]], params(index, sampled))[0])
    return _QUIET[key]


@st.composite
def loads(draw):
    requests = draw(st.lists(st.tuples(st.integers(0, len(PROMPTS) - 1), st.booleans(), st.integers(0, 6)),
                             min_size=1, max_size=8))
    return {
        "requests": requests,  # (prompt, sampled, the step it arrives at)
        "max_num_seqs": draw(st.integers(1, 8)),
        "max_num_batched_tokens": draw(st.sampled_from([3, 5, 8, 13, 32, 512])),
        "enable_prefix_caching": draw(st.booleans()),
        "num_kv_blocks": POOL[draw(st.sampled_from(sorted(POOL)))],
        "deferred_output": draw(st.booleans()),
    }


def run_load(busy: Engine, requests: list[tuple[int, bool, int]]) -> dict[str, tuple]:
    """Runs the requests, each added at its arrival step; returns each one's final output by its id."""
    pending = sorted(enumerate(requests), key=lambda item: item[1][2])
    ids, finals, step = {}, {}, 0
    while pending or busy.has_unfinished():
        while pending and pending[0][1][2] <= step:
            n, (index, sampled, _) = pending.pop(0)
            ids[busy.add_request(PROMPTS[index], params(index, sampled))] = n
        for out in busy.step():
            if out.finished:
                finals[ids[out.request_id]] = out
        step += 1
        assert step < 5000
    busy.check_invariants()
    return finals


def assert_as_quiet(hf, path_name: str, path: dict, requests, finals) -> None:
    for n, (index, sampled, _) in enumerate(requests):
        tokens, logprobs = answer(finals[n])
        expected_tokens, expected_logprobs = quiet(hf, path_name, path, index, sampled)
        assert tokens == expected_tokens, (n, index, sampled)
        assert logprobs == expected_logprobs, (n, index, sampled)  # exact floats: the logits rows' bits


@needs_build
@pytest.mark.parametrize("path_name", sorted(PATHS))
@settings(max_examples=10, deadline=None, database=None)
@given(load=loads())
def test_a_requests_answer_is_the_same_under_any_load(path_name, load):
    path = PATHS[path_name]
    hf = path_model(path)
    requests = load.pop("requests")
    finals = run_load(engine(hf, path, **load), requests)
    assert_as_quiet(hf, path_name, path, requests, finals)


# One load that certainly meets every mechanism: chunks of 5 tokens, prefix-cache hits, preemption of
# the running by a small pool, deferred output, arrivals spread over steps, greedy and seeded rows.
HARD_LOAD = [(2, False, 0), (5, True, 0), (0, False, 1), (1, True, 1), (3, False, 2), (4, True, 2), (0, True, 3),
             (5, False, 4), (2, True, 5)]


@needs_build
@pytest.mark.parametrize("path_name", sorted(PATHS))
def test_chunks_prefix_hits_and_preemption_all_happen_and_change_nothing(path_name):
    path = PATHS[path_name]
    hf = path_model(path)
    busy = engine(hf, path, max_num_seqs=6, max_num_batched_tokens=5, num_kv_blocks=POOL["small"],
                  deferred_output=True)
    finals = run_load(busy, HARD_LOAD)
    assert sum(f.num_preemptions for f in finals.values()) > 0
    assert sum(f.num_cached_tokens for f in finals.values()) > 0
    assert_as_quiet(hf, path_name, path, HARD_LOAD, finals)


# The families fused_decode.c runs, each switch on: a qkv bias, per-head q/k norms, sliding windows
# (shorter than the prompts, on some layers or all); Gemma 3's sandwich norms, GELU gate, query scale
# and its windowed layers' own rope table.
FAMILIES = {
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 16}),
    "mistral-window": ("mistral", {"sliding_window": 6}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 1}),
    "gemma3": ("gemma3", {"sliding_window": 6, "sliding_window_pattern": 2, "query_pre_attn_scalar": 12,
                          "rope_local_base_freq": 100.0}),
}


@needs_build
@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("path_name", ["float32-dense", "bf16-int4-int16"])
def test_every_family_the_invariant_plan_runs_answers_the_same_under_load(name, path_name):
    family, overrides = FAMILIES[name]
    hf, path = tiny_model(family, 43, **overrides), PATHS[path_name]
    busy = engine(hf, path, max_num_seqs=6, max_num_batched_tokens=5, num_kv_blocks=POOL["small"])
    assert_as_quiet(hf, path_name, path, HARD_LOAD, run_load(busy, HARD_LOAD))


def test_the_plan_says_which_choices_rule_invariance_out():
    hf = tiny_model()
    model = nanoserve_model_from_hf(hf)
    exact = resolve_plan(config_of(dtype="float32", quantization=None), model)
    assert exact.exact and not exact.is_batch_invariant  # "auto" leaves the exact path its torch ops
    assert any("the exact path" in choice and not ok for choice, ok, _ in exact.batch_invariant)
    with pytest.raises(ValueError, match=r"batch_invariant=True, but torch.compile runs torch's kernels"):
        resolve_plan(config_of(dtype="float32", quantization=None, compile=True, batch_invariant=True), model)
    with pytest.raises(ValueError, match=r"max_kernel_rows=8 changes a row's matmul past that many rows"):
        resolve_plan(config_of(dtype="float32", quantization="int4", max_kernel_rows=8, batch_invariant=True), model)
    with pytest.raises(ValueError, match=r"int8 per channel runs on torch's kernels"):
        resolve_plan(config_of(dtype="float32", quantization="int8", batch_invariant=True), model)
    off = resolve_plan(config_of(dtype="float32", quantization="int4", batch_invariant=False), model)
    assert off.mixed == "torch" and not off.is_batch_invariant
    asked = resolve_plan(config_of(dtype="float32", quantization=None, batch_invariant=True), model)
    assert not asked.exact and asked.is_batch_invariant and asked.mixed == "c-one-call"
    assert {m.form.name for m in asked.matrices} == {"dense-panels"}
    gemma2 = resolve_plan(config_of(dtype="float32", quantization="int4"),
                          nanoserve_model_from_hf(tiny_model("gemma2", attn_logit_softcapping=2.0)))
    assert not gemma2.is_batch_invariant and any("no C decode" in choice for choice, _, _ in gemma2.batch_invariant)
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant="yes")


# ---- the default model -----------------------------------------------------------------------------

DEFAULT_SYSTEM = "You are a helpful assistant. Answer briefly and precisely. "
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
             "What is 12 times 7?", "Explain what a CPU cache is.", "Give a synonym for happy.",
             "Why is the sky blue?", "Translate 'good morning' into Spanish."]
LONG = "Summarise this: " + " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(60))


@pytest.mark.slow
@needs_build
def test_the_default_models_answers_do_not_change_with_the_load(default_model_dir):
    # The default precision's plan (what `nanoserve serve` runs): each question alone, then all of
    # them at once beside a long prompt cut into 64-token chunks, in a pool that preempts, greedy
    # and seeded. Before the invariant plan, 2 of 144 such outputs differed from the solo run.
    prompts = [DEFAULT_SYSTEM + q for q in QUESTIONS] + [LONG]
    kinds = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1),
             SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True, logprobs=1, seed=7)]
    alone = Engine.from_pretrained(default_model_dir, EngineConfig(max_num_seqs=1, enable_prefix_caching=False))
    assert alone.plan.is_batch_invariant, alone.plan.render()
    expected = [answer(alone.generate([p], sp)[0]) for sp in kinds for p in prompts]
    del alone
    for width, blocks in ((3, None), (16, 40)):
        busy = Engine.from_pretrained(default_model_dir, EngineConfig(max_num_seqs=width, max_num_batched_tokens=64,
                                                                      num_kv_blocks=blocks))
        outputs = busy.generate(prompts * 2, [sp for sp in kinds for _ in prompts])
        busy.check_invariants()
        differing = [i for i, out in enumerate(outputs) if answer(out) != expected[i]]
        assert differing == [], (width, differing)
        if blocks is not None:
            assert sum(out.num_preemptions for out in outputs) > 0


@needs_build
@pytest.mark.parametrize("path_name", ["float32-dense", "bf16-int4-int16"])
def test_k_tokens_scored_as_one_chunk_get_a_decodes_logits(path_name):
    # What speculative decoding's verification rests on: tokens forwarded k at a time (a proposal
    # scored as k rows over the cache) get, bit for bit, the logits each gets decoded one a step.
    from nanoserve.instruments.accuracy import teacher_forced_logits

    model = engine(tiny_model(), PATHS[path_name]).model
    token_ids = PROMPTS[5][:90]
    one_a_step = teacher_forced_logits(model, token_ids, chunk=1)
    for k in (2, 5, 90):
        assert torch.equal(teacher_forced_logits(model, token_ids, chunk=k), one_a_step), k


# A mixture of experts (Qwen3-MoE, 8 experts, top 2, its layers' MLPs one sparse and one dense): the
# rows of a step choose different experts, so each expert's matmul takes a different subset of them
# at every step; a row's answer must not move.
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
       "mlp_only_layers": [1], "initializer_range": 0.2}


@needs_build
@pytest.mark.parametrize("path_name", ["float32-dense", "bf16-int4-int16"])
def test_a_mixture_of_experts_answer_is_the_same_under_the_hard_load(path_name):
    hf, path = tiny_model("qwen3_moe", **MOE), PATHS[path_name]
    busy = engine(hf, path, max_num_seqs=6, max_num_batched_tokens=5, num_kv_blocks=POOL["small"],
                  deferred_output=True)
    assert any(m.name == "experts.gate_up" for m in busy.plan.matrices)
    # every step, its sparse layer included, in fused_decode.c's one call
    assert busy.plan.drivers == {"c-one-call"} and all(
        (table is None) == (layer.moe is None) for table, layer in zip(busy.model.fused_layers.moe, busy.model.layers,
                                                                         strict=True))
    finals = run_load(busy, HARD_LOAD)
    assert sum(f.num_preemptions for f in finals.values()) > 0
    assert_as_quiet(hf, path_name, path, HARD_LOAD, finals)
