"""Property tests: the allocator and scheduler, alone and inside the engine, under random load.

Random arrivals, prompt and output lengths, aborts and tiny pools. After every step the block
invariant holds (every block free xor owned, counts equal to the owners), no block has two
owners, every request ends within a bounded number of steps and the pool is whole at the end.
Over the real engine, greedy tokens must also be those the prompt produces alone: batching,
chunking and preemption by recompute may change when a token arrives, never which.
"""

from __future__ import annotations

import random

from conftest import make_tiny_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.blocks import BlockAllocator
from nanoserve.request import FinishReason, Request, RequestStatus
from nanoserve.scheduler import Scheduler, cdiv

EOS = 2



# ---- (a) allocator and scheduler alone, the step simulated by hand ------------------------------


@st.composite
def scheduler_scenarios(draw):
    block_size = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(3, 12))
    max_num_seqs = draw(st.integers(1, 4))
    budget = draw(st.integers(1, 16))
    chunked = draw(st.booleans()) if budget >= 2 else True
    # What the engine admits: the whole request fits the pool, and without chunked prefill the
    # budget (EngineConfig checks budget >= max_model_len >= prompt + max_tokens).
    limit = num_blocks * block_size if chunked else min(num_blocks * block_size, budget)
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        total = draw(st.integers(2, limit))
        prompt_len = draw(st.integers(1, total - 1))
        requests.append((draw(st.integers(0, 8)), prompt_len, total - prompt_len))  # (arrival step, prompt, max)
    aborts = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, len(requests) - 1)), max_size=3))
    seed = draw(st.integers(0, 2**16))
    return block_size, num_blocks, max_num_seqs, budget, chunked, requests, aborts, seed


MAX_STEPS = 3000


@settings(max_examples=300, deadline=None, database=None)
@given(scheduler_scenarios())
def test_scheduler_never_leaks_shares_or_stalls(scenario):
    block_size, num_blocks, max_num_seqs, budget, chunked, specs, aborts, seed = scenario
    rng = random.Random(seed)
    allocator = BlockAllocator(num_blocks)
    scheduler = Scheduler(allocator, block_size, max_num_seqs, budget, chunked)
    requests: list[Request] = []
    last_arrival = max(s[0] for s in specs)
    previous_empty = False
    for step in range(MAX_STEPS):
        for i, (arrival, prompt_len, max_tokens) in enumerate(specs):
            if arrival == step:
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
                request = Request(str(i), [10] * prompt_len, params, frozenset({EOS}))
                requests.append(request)
                scheduler.add(request)
        for abort_step, index in aborts:
            target = next((r for r in requests if r.request_id == str(index)), None)
            if abort_step == step and target is not None and not target.is_finished:
                scheduler.finish(target)
                target.finish(FinishReason.ABORT, 0.0)
                assert target.block_ids == []
        allocator.check_invariants(scheduler.owners())
        if step >= last_arrival and not scheduler.has_unfinished():
            break

        out = scheduler.schedule()
        scheduled = [item.request for item in out.scheduled]
        assert len(set(map(id, scheduled))) == len(scheduled)
        assert len(scheduler.running) <= max_num_seqs
        assert out.num_batched_tokens == sum(item.num_new_tokens for item in out.scheduled) <= budget
        for item in out.scheduled:
            r = item.request
            end = r.num_computed_tokens + item.num_new_tokens
            assert item.num_new_tokens >= 1 and end <= r.num_tokens
            assert len(r.block_ids) == cdiv(end, block_size)  # exactly the blocks its tokens need
            assert item.samples == (end == r.num_tokens)
            assert r.status is RequestStatus.RUNNING
            if not chunked:
                assert item.samples  # never a partial chunk
        for r in out.preempted:
            assert r not in scheduled
            assert r.block_ids == [] and r.num_computed_tokens == 0 and r.status is RequestStatus.WAITING
        # No deadlock: a step with work left runs something, or preempts so the next one can.
        if scheduler.has_unfinished():
            assert out.scheduled or (out.preempted and not previous_empty), step
        previous_empty = not out.scheduled

        for item in out.scheduled:  # what the engine's collect does
            item.request.num_computed_tokens += item.num_new_tokens
        for item in out.scheduled:
            if item.samples:
                token = EOS if rng.random() < 0.1 else 7
                if item.request.append_token(token, 0.0):
                    scheduler.finish(item.request)
        owners = scheduler.owners()
        allocator.check_invariants(owners)
        held = [b for ids in owners.values() for b in ids]
        assert len(held) == len(set(held)), "a block has two owners"
        assert len(held) + allocator.num_free == num_blocks
    else:
        raise AssertionError(f"not finished after {MAX_STEPS} steps")

    assert len(requests) == len(specs)
    for r in requests:
        assert r.is_finished
        if r.finish_reason is FinishReason.LENGTH:
            assert r.num_output_tokens == r.params.max_tokens
        elif r.finish_reason is FinishReason.STOP:
            assert r.output_token_ids[-1] == EOS and r.num_output_tokens <= r.params.max_tokens
        assert r.block_ids == []
    assert allocator.num_free == num_blocks
    assert sorted(allocator.free_ids) == list(range(num_blocks))
    allocator.check_invariants({})


# ---- (b) the real engine over a tiny model --------------------------------------------------------

_BASE: list[Engine] = []
_SOLO: dict[tuple[int, ...], list[int]] = {}
MAX_TOKENS = 6


def base_engine() -> Engine:
    if not _BASE:
        _BASE.append(make_tiny_engine())
    return _BASE[0]


def solo_tokens(prompt: list[int]) -> list[int]:
    """Greedy tokens of the prompt alone, in a fresh engine with a big pool."""
    key = tuple(prompt)
    if key not in _SOLO:
        base = base_engine()
        engine = Engine(base.model, base.tokenizer, EngineConfig(dtype="float32", quantization=None, block_size=4, num_kv_blocks=64, max_num_seqs=1))
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        _SOLO[key] = engine.generate([prompt], params)[0].token_ids
    return _SOLO[key]


@st.composite
def engine_scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    requests = []
    for _ in range(draw(st.integers(1, 6))):
        prompt = draw(st.lists(st.integers(3, 96), min_size=1, max_size=8))
        requests.append((draw(st.integers(0, 3)), prompt, draw(st.integers(1, MAX_TOKENS))))
    largest = max(cdiv(len(p) + m, block_size) for _, p, m in requests)
    num_kv_blocks = draw(st.integers(largest, largest + 2))  # tight: preemption is common
    aborts = draw(st.lists(st.tuples(st.integers(0, 12), st.integers(0, len(requests) - 1)), max_size=2))
    config = EngineConfig(dtype="float32", quantization=None, block_size=block_size, num_kv_blocks=num_kv_blocks, max_num_seqs=draw(st.integers(1, 5)),
                          max_num_batched_tokens=draw(st.integers(1, 16)), max_model_len=32)
    return config, requests, aborts


# Derandomized: the token check compares float argmaxes over random weights, where a near tie
# could in principle flip between a batched and a solo forward; a fixed example set keeps a red
# run reproducible and makes a green one mean the same thing every time.
@settings(max_examples=150, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(engine_scenarios())
def test_engine_keeps_invariants_and_tokens_under_preemption_and_aborts(scenario):
    config, specs, aborts = scenario
    base = base_engine()
    engine = Engine(base.model, base.tokenizer, config)
    ids: dict[int, str] = {}
    final = {}
    aborted = set()
    last_arrival = max(s[0] for s in specs)
    for step in range(400):
        for i, (arrival, prompt, max_tokens) in enumerate(specs):
            if arrival == step:
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                ids[i] = engine.add_request(prompt, params)
        for abort_step, index in aborts:
            rid = ids.get(index)
            if abort_step == step and rid is not None and not (rid in final and final[rid].finished):
                (final[rid],) = engine.abort(rid)
                aborted.add(rid)
                engine.check_invariants()
        if step >= last_arrival and not engine.has_unfinished():
            break
        for out in engine.step():
            final[out.request_id] = out
        engine.check_invariants()
    else:
        raise AssertionError("engine did not finish within 400 steps")

    assert engine.stats().num_free_blocks == config.num_kv_blocks
    assert sorted(final) == sorted(ids.values())
    for i, (_, prompt, max_tokens) in enumerate(specs):
        out = final[ids[i]]
        assert out.finished
        expected = solo_tokens(prompt)[:max_tokens]
        if ids[i] in aborted:
            assert out.finish_reason == "abort"
            assert out.token_ids == expected[: len(out.token_ids)]
        else:
            assert out.finish_reason == "length"
            assert out.token_ids == expected, (ids[i], out.num_preemptions)
