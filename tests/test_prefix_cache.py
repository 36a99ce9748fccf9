"""Prefix caching: full blocks found by a chained hash, shared by reference count, evicted LRU."""

from __future__ import annotations

from conftest import TINY, CharTokenizer, config_of, make_hf_llama, nanoserve_model_from_hf
from test_llama import assert_logits_match, run_and_capture

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.blocks import BlockAllocator, hash_block

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SYSTEM = [7 + (i * 5) % 80 for i in range(21)]  # a shared "system prompt": 5 full blocks of 4, plus 1


def test_hash_chains_over_the_whole_prefix():
    a = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == a
    assert hash_block(a, [5, 6]) != hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6])  # same tokens, other prefix
    assert hash_block(None, [1, 2, 3, 5]) != a


def test_a_freed_cached_block_is_found_until_allocate_evicts_it_least_recently_freed_first():
    alloc = BlockAllocator(4)
    ids = alloc.allocate(2)  # [0, 1]
    h0, h1 = hash_block(None, [1]), hash_block(None, [2])
    alloc.register(ids[0], h0)
    alloc.register(ids[1], h1)
    alloc.free(ids)  # tail first: free list [2, 3, 1, 0]
    assert list(alloc.free_ids) == [2, 3, 1, 0]
    assert (alloc.lookup(h0), alloc.lookup(h1)) == (0, 1)
    alloc.take_cached(0)  # a hit takes block 0 off the free list
    assert list(alloc.free_ids) == [2, 3, 1] and alloc.ref_counts[0] == 1
    assert alloc.allocate(3) == [2, 3, 1]  # block 1 handed out again: its hash is evicted
    assert alloc.lookup(h1) is None and alloc.lookup(h0) == 0
    alloc.check_invariants({"a": [0], "b": [2, 3, 1]})


def _engine(caching: bool, **overrides) -> Engine:
    hf = make_hf_llama(seed=4)
    config = config_of(dtype="float32", quantization=None, **({"block_size": 4, "num_kv_blocks": 64, "max_num_seqs": 4,
                              "enable_prefix_caching": caching} | overrides))
    return Engine(nanoserve_model_from_hf(hf), CharTokenizer(TINY["vocab_size"]), config)


def test_second_request_with_a_shared_prefix_hits_and_outputs_are_identical():
    prompts = [SYSTEM + [40, 41, 42], SYSTEM + [50, 51], SYSTEM[:8], SYSTEM + [40, 41, 42]]
    cold = _engine(False).generate(prompts, GREEDY)
    engine = _engine(True)
    first = engine.generate(prompts[:1], GREEDY)[0]
    assert first.num_cached_tokens == 0
    warm = engine.generate(prompts, GREEDY)
    # 24-token prompt: 5 full blocks before the last token, all cached by the first request.
    assert [o.num_cached_tokens for o in warm] == [20, 20, 4, 20]
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert first.token_ids == cold[0].token_ids
    engine.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_blocks  # cached blocks are free, not leaked


def test_logits_with_cache_hits_equal_transformers():
    hf = make_hf_llama(seed=5)
    engine = Engine(nanoserve_model_from_hf(hf), None, EngineConfig(dtype="float32", quantization=None, block_size=4, num_kv_blocks=64))
    run_and_capture(engine, [SYSTEM + [60]], max_tokens=2)
    captured, outputs = run_and_capture(engine, [SYSTEM + [61, 62], SYSTEM + [63]], max_tokens=5)
    assert [o.num_cached_tokens for o in outputs] == [20, 20]
    assert assert_logits_match(hf, captured, outputs) == 10


def test_eviction_under_pressure_keeps_outputs_identical():
    # 10 blocks of 4: each request needs 7 at full length, so a second prefix evicts the first.
    prompts = [SYSTEM + [40], [30 + i for i in range(21)] + [41], SYSTEM + [42]]
    cold = [_engine(False, num_kv_blocks=10).generate([p], GREEDY)[0].token_ids for p in prompts]
    engine = _engine(True, num_kv_blocks=10)
    warm = [engine.generate([p], GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in warm] == cold
    # The first request freed its 7 blocks tail first, so the second request's allocation (3 never
    # used, then 4 of those) evicted the tail of the shared prefix: blocks 0-2 (12 tokens) survive.
    assert warm[2].num_cached_tokens == 12
    engine.check_invariants()


def test_a_request_that_finishes_at_its_prefill_still_leaves_its_prompt_cached():
    for deferred in (False, True):
        engine = _engine(True, deferred_output=deferred)
        engine.generate([SYSTEM + [40]], SamplingParams(temperature=0.0, max_tokens=1))
        out = engine.generate([SYSTEM + [41]], GREEDY)[0]
        assert out.num_cached_tokens == 20, deferred
