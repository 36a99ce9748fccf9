"""n > 1: several completions of one prompt, the copies sharing the prompt's full blocks."""

from __future__ import annotations

import pytest
from conftest import make_tiny_engine

from nanoserve import SamplingParams

PROMPT = [7 + (i * 5) % 80 for i in range(22)]  # 5 full blocks of 4 before the last token


def test_greedy_copies_share_the_prompt_blocks_and_equal_a_single_completion():
    single = make_tiny_engine().generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6))[0]
    engine = make_tiny_engine()
    outs = engine.generate([PROMPT, [3, 4, 5]], [SamplingParams(temperature=0.0, max_tokens=6, n=3),
                                                  SamplingParams(temperature=0.0, max_tokens=2)])
    assert [o.request_id for o in outs] == ["0.0", "0.1", "0.2", "1"]
    assert [(o.parent_id, o.index) for o in outs[:3]] == [("0", 0), ("0", 1), ("0", 2)]
    assert all(o.token_ids == single.token_ids for o in outs[:3])
    # The first copy computes the prompt; the others find its 5 full blocks in the cache.
    assert [o.num_cached_tokens for o in outs[:3]] == [0, 20, 20]
    engine.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_blocks and not engine.scheduler.groups


def test_seeded_copies_differ_from_each_other_and_repeat_across_runs():
    params = SamplingParams(temperature=1.0, max_tokens=8, n=4, seed=11, ignore_eos=True)
    first = [o.token_ids for o in make_tiny_engine().generate([PROMPT], params)]
    again = [o.token_ids for o in make_tiny_engine().generate([PROMPT], params)]
    assert first == again
    assert len({tuple(t) for t in first}) > 1
    # Copy i is seeded with seed + i: copy 2 equals a single request seeded 13.
    alone = make_tiny_engine().generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=8, seed=13,
                                                                  ignore_eos=True))[0]
    assert first[2] == alone.token_ids


def test_aborting_the_group_aborts_every_copy_including_held_ones():
    engine = make_tiny_engine()
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, n=3))
    assert engine.stats().num_waiting == 1  # the other two wait for the first copy's prefill
    outs = engine.abort(rid)
    assert [(o.request_id, o.finish_reason) for o in outs] == [(f"{rid}.{i}", "abort") for i in range(3)]
    assert not engine.has_unfinished() and not engine.requests and not engine.scheduler.groups
    assert engine.allocator.num_free == engine.allocator.num_blocks
    with pytest.raises(ValueError, match="not an unfinished request"):
        engine.abort(rid)
