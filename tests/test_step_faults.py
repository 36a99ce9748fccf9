"""A step that raises fails the requests of that step and nothing else (Engine.fail_step, AsyncEngine).

Faults are injected by wrapping one phase's callee (the model's forward, the output stage, the
scheduler) to raise on a chosen call. The reference for the requests that survive is the same
workload on a fresh engine that never faults; the pool is checked block by block
(check_invariants) and counted free at the end.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import Injected, fail_on_call, greedy, make_tiny_engine

from nanoserve import SamplingParams
from nanoserve.output_processor import OutputProcessor
from nanoserve.serving.async_engine import AsyncEngine, EngineDeadError, StepFailedError

PROMPTS = ["the cat", "a dog ran", "one two three", "blue sky"]


def run_to_end(engine) -> dict[str, list[int]]:
    """Steps until the engine is idle; the final token ids by request id."""
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.token_ids
    return final


def assert_pool_empty(engine) -> None:
    engine.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_blocks
    assert not engine.requests and not engine.has_unfinished()


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("phase", ["forward", "collect"])
def test_a_faulted_step_fails_its_requests_and_the_queued_ones_match_a_clean_run(monkeypatch, deferred, phase):
    # Two slots: requests 0 and 1 run, 2 and 3 wait until the fault frees the slots.
    engine = make_tiny_engine(max_num_seqs=2, deferred_output=deferred)
    ids = [engine.add_request(p, greedy(8)) for p in PROMPTS]
    if phase == "forward":
        fail_on_call(monkeypatch, engine.model, "forward", call=3)
    else:  # the output stage's readback and stop rules (in deferred mode: the step before's tokens);
        # patched on the class, as its instances have __slots__
        fail_on_call(monkeypatch, OutputProcessor, "process", call=2 if deferred else 3)  # step 1 resolves nothing
    for _ in range(2):
        engine.step()
    with pytest.raises(Injected):
        engine.step()
    failed = engine.fail_step(Injected())
    assert [(o.request_id, o.finish_reason, o.finished) for o in failed] == [(ids[0], "abort", True),
                                                                            (ids[1], "abort", True)]
    engine.check_invariants()
    assert sorted(engine.requests) == ids[2:]  # the queued ones are untouched
    journeys = engine.output.readback.journeys
    rest = run_to_end(engine)

    clean = make_tiny_engine(max_num_seqs=2, deferred_output=deferred)
    want = clean.generate(PROMPTS[2:], greedy(8))
    assert [rest[i] for i in ids[2:]] == [w.token_ids for w in want]
    # The failed requests' tokens still in flight were dropped, never brought home after the fault.
    assert engine.output.readback.journeys - journeys == clean.output.readback.journeys
    assert all(len(w.token_ids) == 8 for w in want)
    assert_pool_empty(engine)


def test_a_request_the_failed_step_finished_keeps_its_output(monkeypatch):
    # Deferred output with a penalty: each step first brings the previous step's tokens home (a
    # flush). In step 3 the flush gives request 0 its 2nd and last token, then the forward fails:
    # request 0 finished before the fault ("length", both tokens), request 1 is aborted.
    engine = make_tiny_engine(deferred_output=True)
    short = engine.add_request("the cat", greedy(2, repetition_penalty=1.2))
    long = engine.add_request("a dog ran", greedy(8))
    fail_on_call(monkeypatch, engine.model, "forward", call=3)
    for _ in range(2):
        engine.step()
    with pytest.raises(Injected):
        engine.step()
    failed = {o.request_id: o for o in engine.fail_step(Injected())}
    (want,) = make_tiny_engine(deferred_output=True).generate(["the cat"], greedy(2, repetition_penalty=1.2))
    assert (failed[short].finish_reason, failed[short].token_ids) == ("length", want.token_ids)
    assert failed[long].finish_reason == "abort"
    assert_pool_empty(engine)


def test_an_n_group_fails_whole_and_shared_prefix_blocks_are_released(monkeypatch):
    # n = 2 shares the prompt's full blocks by prefix hash; the fault lands in the copies' first
    # joint decode: both copies (and the group) go, and a later request with the same prompt
    # still matches a clean run (the cached blocks it hits hold correct K/V).
    engine = make_tiny_engine(block_size=4)
    prompt = "one two three four"  # 18 tokens: 4 full blocks
    group = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2))
    fail_on_call(monkeypatch, engine.model, "forward", call=3)
    engine.step(), engine.step()
    with pytest.raises(Injected):
        engine.step()
    failed = engine.fail_step(Injected())
    assert sorted((o.request_id, o.finish_reason) for o in failed) == [(f"{group}.0", "abort"), (f"{group}.1", "abort")]
    assert group not in engine.scheduler.groups
    later = engine.add_request(prompt, greedy(6))
    got = run_to_end(engine)[later]
    (want,) = make_tiny_engine(block_size=4).generate([prompt], greedy(6))
    assert got == want.token_ids
    assert_pool_empty(engine)


def test_a_fault_in_schedule_is_not_recoverable(monkeypatch):
    engine = make_tiny_engine()
    engine.add_request("the cat", greedy(4))
    fail_on_call(monkeypatch, engine.scheduler, "schedule", call=2)
    engine.step()
    with pytest.raises(Injected):
        engine.step()
    with pytest.raises(RuntimeError, match="cannot recover"):
        engine.fail_step(Injected())


def test_a_device_error_is_not_recoverable(monkeypatch):
    engine = make_tiny_engine()
    engine.add_request("the cat", greedy(4))
    engine.step()
    with pytest.raises(RuntimeError, match="cannot recover"):
        engine.fail_step(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))


def test_a_pool_left_inconsistent_is_not_recoverable(monkeypatch):
    engine = make_tiny_engine()
    engine.add_request("the cat", greedy(4))

    def leak(*_):
        engine.allocator.allocate(1)  # a block nobody owns: the invariant check must catch it

    fail_on_call(monkeypatch, engine.model, "forward", call=2, before=leak)
    engine.step()
    with pytest.raises(Injected):
        engine.step()
    with pytest.raises(RuntimeError, match="inconsistent"):
        engine.fail_step(Injected())


# ---- through the AsyncEngine ----------------------------------------------------------------------------


async def tokens_of(stream) -> list[int]:
    return [t async for d in stream for t in d.token_ids]


def test_async_engine_fails_the_steps_streams_and_serves_the_next(monkeypatch):
    engine = make_tiny_engine(max_num_seqs=2)
    faults = []
    front = AsyncEngine(engine, on_step_fault=faults.append)
    fail_on_call(monkeypatch, engine.model, "forward", call=3)

    async def main():
        first = [await front.add_request(p, greedy(8)) for p in PROMPTS[:2]]
        queued = await front.add_request(PROMPTS[2], greedy(8))
        results = await asyncio.gather(*(tokens_of(s) for s in [*first, queued]), return_exceptions=True)
        after = await tokens_of(await front.add_request(PROMPTS[3], greedy(8)))
        assert front.is_running and front.error is None
        await front.shutdown()
        return results, after

    results, after = asyncio.run(main())
    assert [type(r) for r in results[:2]] == [StepFailedError, StepFailedError]
    assert "Injected" in str(results[0])
    want = make_tiny_engine(max_num_seqs=2).generate(PROMPTS[2:], greedy(8))
    assert [results[2], after] == [w.token_ids for w in want]
    assert [type(f) for f in faults] == [Injected]
    assert_pool_empty(engine)


def test_async_engine_dies_on_a_fault_it_cannot_recover_from(monkeypatch):
    engine = make_tiny_engine()
    front = AsyncEngine(engine)
    fail_on_call(monkeypatch, engine.scheduler, "schedule", call=2)

    async def main():
        with pytest.raises(EngineDeadError, match="cannot recover"):
            await tokens_of(await front.add_request("the cat", greedy(8)))
        with pytest.raises(EngineDeadError):
            await front.add_request("abc", greedy(4))
        assert not front.is_running

    asyncio.run(main())
