"""Deferred output: step N's tokens come home after step N+1 is launched; outputs equal the
synchronous loop's, a stop found one step late discards its one token of overshoot."""

from __future__ import annotations

import pytest
from conftest import greedy, make_tiny_engine

from nanoserve import SamplingParams
from nanoserve.profiler import OVERLAPPED, SERIAL, StepRecorder, recommended_model

PROMPTS = [[5, 9, 13, 22, 7, 41, 3, 8], [17, 4], [30 + i % 50 for i in range(23)], [11, 12, 13, 14, 15], [60, 61]]


def run(deferred: bool, params, aborts: dict[int, int] | None = None, **config):
    """Drives the engine by hand; aborts maps step number -> prompt index to abort then."""
    engine = make_tiny_engine(deferred_output=deferred, **config)
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    final = {}
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check_invariants()
        step += 1
        if aborts and step in aborts and ids[aborts[step]] in engine.requests:
            (final[ids[aborts[step]]],) = engine.abort(ids[aborts[step]])
    engine.step()  # a last step flushes whatever is still in flight
    assert engine.allocator.num_free == engine.allocator.num_blocks
    return [(final[i].token_ids, final[i].finish_reason, final[i].text) for i in ids], engine


@pytest.mark.parametrize("config", [
    {},
    {"num_kv_blocks": 14},  # preemption
    {"max_num_batched_tokens": 6},  # chunked prefill
    {"max_num_seqs": 2},
    {"block_size": 1, "num_kv_blocks": 200},
])
def test_greedy_outputs_equal_the_synchronous_loop(config):
    params = [greedy(max_tokens=n) for n in (10, 3, 7, 1, 12)]
    sync, _ = run(False, params, **config)
    deferred, _ = run(True, params, **config)
    assert deferred == sync


def test_stops_found_one_step_late_discard_the_overshoot():
    reference, _ = run(False, [greedy()] * 5)
    # Stop each request on a token it produces midway, by id and by string.
    params = [greedy(stop_token_ids=[toks[3]]) for toks, _, _ in reference[:3]]
    params += [greedy(stop=(reference[3][2][2:4],)), greedy(min_tokens=4, stop_token_ids=[reference[4][0][1]])]
    sync, _ = run(False, params)
    deferred, engine = run(True, params)
    assert deferred == sync
    assert [reason for _, reason, _ in deferred] == ["stop"] * 4 + [sync[4][1]]
    assert all(len(toks) < 10 for toks, _, _ in deferred[:4])


def test_seeded_sampling_and_aborts_equal_the_synchronous_loop():
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=9, ignore_eos=True) for s in range(5)]
    sync, _ = run(False, params, aborts={3: 1, 5: 4})
    deferred, _ = run(True, params, aborts={3: 1, 5: 4})
    # An abort lands between steps; deferred holds one step's tokens back, so the aborted requests
    # may have one token fewer, but never a different one.
    for (d_toks, d_reason, _), (s_toks, s_reason, _) in zip(deferred, sync, strict=True):
        assert s_toks[:len(d_toks)] == d_toks and d_reason == s_reason
        assert len(s_toks) - len(d_toks) <= (1 if s_reason == "abort" else 0)


def test_recorder_sees_an_overlapped_loop_with_one_transfer_per_step():
    engine = make_tiny_engine(deferred_output=True)
    engine.recorder = StepRecorder()
    engine.generate(PROMPTS, greedy())
    profile = engine.recorder.profile(warmup=1)
    assert recommended_model(profile) == OVERLAPPED
    assert engine.output.transfers_per_step == 1.0
    sync_engine = make_tiny_engine()
    sync_engine.recorder = StepRecorder()
    sync_engine.generate(PROMPTS, greedy())
    assert recommended_model(sync_engine.recorder.profile(warmup=1)) == SERIAL


def test_no_token_is_forwarded_past_max_tokens():
    # A request's last token is known to be last by count: no step forwards it, so no overshoot.
    engine = make_tiny_engine(deferred_output=True)
    forwarded = []
    original = engine.model.forward

    def spy(inputs, kv):
        forwarded.append(inputs.input_ids.shape[0])
        return original(inputs, kv)

    engine.model.forward = spy
    engine.generate([PROMPTS[0]], greedy(max_tokens=4))
    assert forwarded == [8, 1, 1, 1]  # prefill, then decodes of tokens 1..3; token 4 is never forwarded
