"""Scheduler: exact admissions, token budgets, block ids, preemption and resumption.

Pure Python: requests are built directly and a step is simulated by hand, as the engine's
collect phase does it (num_computed_tokens += num_new_tokens, one token appended to each row
that samples). Every expected block id follows from the allocator's FIFO free list and the
rule that a request holds ceil(tokens / block_size) blocks for the tokens it forwards.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from nanoserve.blocks import BlockAllocator
from nanoserve.params import SamplingParams
from nanoserve.request import FinishReason, Request, RequestStatus
from nanoserve.scheduler import Scheduler, SchedulerOutput

EOS = frozenset({2})
TOKEN = 7  # what the simulated model samples: never EOS, so requests end on max_tokens


def make_request(request_id: str, prompt_len: int, max_tokens: int = 8) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(request_id, [10 + i for i in range(prompt_len)], params, EOS, arrival_time=0.0)


def make_scheduler(num_blocks: int, block_size: int = 4, max_num_seqs: int = 4, max_num_batched_tokens: int = 64,
                   enable_chunked_prefill: bool = True) -> Scheduler:
    return Scheduler(BlockAllocator(num_blocks), block_size, max_num_seqs, max_num_batched_tokens,
                     enable_chunked_prefill)


def run_step(scheduler: Scheduler, out: SchedulerOutput) -> list[str]:
    """What the engine does after the forward; returns the ids that finished."""
    for item in out.scheduled:
        item.request.num_computed_tokens += item.num_new_tokens
    finished = []
    for item in out.scheduled:
        if item.samples and item.request.append_token(TOKEN, now=1.0):
            scheduler.finish(item.request)
            finished.append(item.request.request_id)
    scheduler.allocator.check_invariants(scheduler.owners())
    return finished


def plan(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.scheduled]


def test_admission_allocates_exact_block_ids_fcfs():
    scheduler = make_scheduler(num_blocks=8)
    a, b, c = make_request("a", 5), make_request("b", 3), make_request("c", 9)
    for r in (a, b, c):
        scheduler.add(r)
    out = scheduler.schedule()
    assert plan(out) == [("a", 5, True), ("b", 3, True), ("c", 9, True)]
    assert out.num_batched_tokens == 17
    # ceil(5/4)=2, ceil(3/4)=1, ceil(9/4)=3 blocks, off the front of [0..7].
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0, 1], [2], [3, 4, 5])
    assert list(scheduler.allocator.free_ids) == [6, 7]
    assert [r.status for r in (a, b, c)] == [RequestStatus.RUNNING] * 3
    assert not scheduler.waiting and scheduler.running == [a, b, c]
    run_step(scheduler, out)

    # Step 2: decodes. a has 6 tokens (2 blocks), b 4 (1 block), c 10 (3 blocks): nothing new.
    out = scheduler.schedule()
    assert plan(out) == [("a", 1, True), ("b", 1, True), ("c", 1, True)]
    assert list(scheduler.allocator.free_ids) == [6, 7]
    run_step(scheduler, out)

    # Step 3: b forwards its 5th token, which starts its second block: the next free id, 6.
    out = scheduler.schedule()
    assert plan(out) == [("a", 1, True), ("b", 1, True), ("c", 1, True)]
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0, 1], [2, 6], [3, 4, 5])
    assert list(scheduler.allocator.free_ids) == [7]
    run_step(scheduler, out)

    # finish() returns every block, tail first, to the back of the free list.
    scheduler.finish(a)
    assert list(scheduler.allocator.free_ids) == [7, 1, 0]
    scheduler.finish(b)
    assert list(scheduler.allocator.free_ids) == [7, 1, 0, 6, 2]
    scheduler.finish(c)
    assert list(scheduler.allocator.free_ids) == [7, 1, 0, 6, 2, 5, 4, 3]
    assert a.block_ids == b.block_ids == c.block_ids == []
    assert not scheduler.has_unfinished()
    scheduler.allocator.check_invariants({})


def test_max_num_seqs_limits_slots_and_fcfs_fills_the_freed_one():
    scheduler = make_scheduler(num_blocks=16, max_num_seqs=2)
    a, b, c, d = (make_request(x, 2, max_tokens=n) for x, n in zip("abcd", (2, 3, 3, 3), strict=True))
    for r in (a, b, c, d):
        scheduler.add(r)
    out = scheduler.schedule()
    assert plan(out) == [("a", 2, True), ("b", 2, True)]
    assert list(scheduler.waiting) == [c, d]
    assert run_step(scheduler, out) == []

    out = scheduler.schedule()  # both decode; a reaches max_tokens=2
    assert plan(out) == [("a", 1, True), ("b", 1, True)]
    assert run_step(scheduler, out) == ["a"]

    out = scheduler.schedule()  # a's slot goes to c, the oldest waiter, never to d
    assert plan(out) == [("b", 1, True), ("c", 2, True)]
    assert list(scheduler.waiting) == [d]
    assert scheduler.running == [b, c]


def test_chunked_prefill_splits_a_long_prompt_over_the_budget():
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=4)
    a = make_request("a", 10, max_tokens=2)
    scheduler.add(a)
    expected = [  # (plan, blocks held after scheduling)
        ([("a", 4, False)], [0]),
        ([("a", 4, False)], [0, 1]),
        ([("a", 2, True)], [0, 1, 2]),  # last chunk: 10 tokens, the first output is sampled
        ([("a", 1, True)], [0, 1, 2]),  # decode of token 11: still 3 blocks
    ]
    for step, (want_plan, want_blocks) in enumerate(expected):
        out = scheduler.schedule()
        assert plan(out) == want_plan, step
        assert a.block_ids == want_blocks, step
        assert out.num_batched_tokens == sum(n for _, n, _ in want_plan)
        finished = run_step(scheduler, out)
        assert a.num_output_tokens == (1 if step == 2 else 2 if step == 3 else 0)
    assert finished == ["a"]
    assert scheduler.allocator.num_free == 8


def test_budget_is_shared_decodes_first_then_a_prefill_chunk():
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=6)
    a, b = make_request("a", 2), make_request("b", 8)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert plan(out) == [("a", 2, True), ("b", 4, False)]  # 6 - 2 = 4 left for b
    assert (a.block_ids, b.block_ids) == ([0], [1])
    assert out.num_batched_tokens == 6
    run_step(scheduler, out)
    out = scheduler.schedule()
    assert plan(out) == [("a", 1, True), ("b", 4, True)]  # b's last 4 prompt tokens, then it samples
    assert (a.block_ids, b.block_ids) == ([0], [1, 2])
    assert out.num_batched_tokens == 5
    run_step(scheduler, out)
    assert (a.num_output_tokens, b.num_output_tokens) == (2, 1)


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=6, enable_chunked_prefill=False)
    a, b = make_request("a", 2, max_tokens=2), make_request("b", 6)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert plan(out) == [("a", 2, True)]  # b needs 6 tokens, only 4 are left: no partial chunk
    run_step(scheduler, out)
    out = scheduler.schedule()
    assert plan(out) == [("a", 1, True)]  # a's decode leaves 5 < 6
    assert run_step(scheduler, out) == ["a"]
    out = scheduler.schedule()
    assert plan(out) == [("b", 6, True)]


def test_admission_is_refused_when_blocks_do_not_fit_and_blocks_the_queue():
    scheduler = make_scheduler(num_blocks=3, block_size=4)
    a, b, c = make_request("a", 8, max_tokens=1), make_request("b", 8), make_request("c", 2)
    for r in (a, b, c):
        scheduler.add(r)
    out = scheduler.schedule()
    # a takes [0, 1]; b needs 2 blocks with 1 free, and c, though it would fit, is behind b.
    assert plan(out) == [("a", 8, True)]
    assert a.block_ids == [0, 1]
    assert list(scheduler.waiting) == [b, c]
    assert b.block_ids == [] and b.status is RequestStatus.WAITING
    assert run_step(scheduler, out) == ["a"]  # free list now [2, 1, 0]

    out = scheduler.schedule()
    assert plan(out) == [("b", 8, True), ("c", 2, True)]
    assert (b.block_ids, c.block_ids) == ([2, 1], [0])


def test_preemption_takes_the_newest_request_and_it_resumes_later():
    # 4 blocks of 2 tokens. a and b have 3-token prompts: 2 blocks each, the pool is full.
    scheduler = make_scheduler(num_blocks=4, block_size=2)
    a, b = make_request("a", 3, max_tokens=3), make_request("b", 3, max_tokens=4)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert plan(out) == [("a", 3, True), ("b", 3, True)]
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    run_step(scheduler, out)
    out = scheduler.schedule()  # 4th token of each: still 2 blocks
    assert plan(out) == [("a", 1, True), ("b", 1, True)]
    assert out.preempted == []
    run_step(scheduler, out)
    assert b.token_ids == [10, 11, 12, TOKEN, TOKEN]

    # a's 5th token needs a 3rd block and none is free: b, admitted last, is preempted.
    out = scheduler.schedule()
    assert out.preempted == [b]
    assert plan(out) == [("a", 1, True)]  # b never re-enters in the step that preempted it
    assert a.block_ids == [0, 1, 3]  # b's blocks came back tail first: [3, 2]
    assert list(scheduler.allocator.free_ids) == [2]
    assert b.block_ids == [] and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.status is RequestStatus.WAITING
    assert list(scheduler.waiting) == [b] and scheduler.running == [a]
    assert b.token_ids == [10, 11, 12, TOKEN, TOKEN]  # its output is kept, recomputed later
    scheduler.allocator.check_invariants(scheduler.owners())
    assert run_step(scheduler, out) == ["a"]  # a's 3rd token: done; free list [2, 3, 1, 0]

    # b resumes: all 5 tokens are recomputed in one go (3 blocks), then it samples its 3rd token.
    out = scheduler.schedule()
    assert plan(out) == [("b", 5, True)]
    assert b.block_ids == [2, 3, 1]
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    run_step(scheduler, out)
    out = scheduler.schedule()
    assert plan(out) == [("b", 1, True)]
    assert run_step(scheduler, out) == ["b"]
    assert b.output_token_ids == [TOKEN] * 4
    assert scheduler.allocator.num_free == 4
    assert not scheduler.has_unfinished()


def test_a_preempted_request_goes_back_ahead_of_later_arrivals():
    # 5 blocks of 2 tokens; a (3 tokens, 2 blocks), b and c (2 tokens, 1 block each) leave 1 free.
    scheduler = make_scheduler(num_blocks=5, block_size=2)
    a, b, c, d = make_request("a", 3), make_request("b", 2), make_request("c", 2), make_request("d", 1)
    for r in (a, b, c):
        scheduler.add(r)
    out = scheduler.schedule()
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0, 1], [2], [3])
    scheduler.add(d)  # arrives after the first step
    run_step(scheduler, out)
    # a: 4 tokens (2 blocks); b, c: 3 tokens each, 1 more block each; only block 4 is free.
    # b takes block 4; c, the newest, needs one more and preempts itself; a and b run.
    out = scheduler.schedule()
    assert plan(out) == [("a", 1, True), ("b", 1, True)]
    assert out.preempted == [c]
    assert b.block_ids == [2, 4]
    assert list(scheduler.waiting) == [c, d]  # c goes back to the head, ahead of d
    assert list(scheduler.allocator.free_ids) == [3]


def test_a_request_that_needs_a_block_when_it_is_the_newest_preempts_itself():
    scheduler = make_scheduler(num_blocks=4, block_size=2)
    a, b = make_request("a", 3), make_request("b", 4)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    run_step(scheduler, out)
    # a (4 tokens) fits in its 2 blocks; b (5 tokens) needs a 3rd: it is the newest, so it goes.
    out = scheduler.schedule()
    assert plan(out) == [("a", 1, True)]
    assert out.preempted == [b]
    assert list(scheduler.allocator.free_ids) == [3, 2]
    run_step(scheduler, out)
    # a takes block 3; b (5 tokens, 3 blocks) does not fit in the 1 left and keeps waiting.
    out = scheduler.schedule()
    assert plan(out) == [("a", 1, True)]
    assert a.block_ids == [0, 1, 3]
    assert list(scheduler.waiting) == [b]


def test_finish_of_a_waiting_request_removes_it_from_the_queue():
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=1)
    a, b = make_request("a", 2), make_request("b", 2)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    scheduler.finish(b)
    assert list(scheduler.waiting) == [] and scheduler.running == [a]
    scheduler.finish(a)
    assert not scheduler.has_unfinished()
    assert scheduler.allocator.num_free == 4


def test_owners_lists_only_requests_that_hold_blocks():
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=1)
    a, b = make_request("a", 5), make_request("b", 2)
    scheduler.add(a)
    scheduler.add(b)
    assert scheduler.owners() == {}
    scheduler.schedule()
    assert scheduler.owners() == {"a": [0, 1]}


def test_scheduler_and_allocator_import_no_torch():
    # Load the two modules (and whatever they import from nanoserve) under a bare package, so
    # nanoserve/__init__, which imports the engine and torch, does not run.
    package_dir = Path(__file__).resolve().parent.parent / "nanoserve"
    code = (
        "import sys, types\n"
        "pkg = types.ModuleType('nanoserve')\n"
        f"pkg.__path__ = [{str(package_dir)!r}]\n"
        "sys.modules['nanoserve'] = pkg\n"
        "import nanoserve.scheduler, nanoserve.blocks\n"
        "assert nanoserve.scheduler.__file__.startswith(pkg.__path__[0])\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(len(bad), bad[:3])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0 []"


def test_n_copies_are_held_until_the_first_copys_prefill_then_share_its_cached_blocks():
    scheduler = Scheduler(BlockAllocator(16), 4, 4, 64, True, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=2, n=3, seed=5)
    copies = scheduler.add(Request("g", [10 + i for i in range(9)], params, EOS, arrival_time=0.0))
    assert [(c.request_id, c.parent_id, c.index, c.params.n, c.params.seed) for c in copies] == [
        ("g.0", "g", 0, 1, 5), ("g.1", "g", 1, 1, 6), ("g.2", "g", 2, 1, 7)]
    assert scheduler.groups == {"g": ["g.0", "g.1", "g.2"]}
    assert list(scheduler.waiting) == [copies[0]] and scheduler.held == {"g.0": copies[1:]}
    out = scheduler.schedule()
    assert plan(out) == [("g.0", 9, True)]  # alone: the others wait for its prompt
    scheduler.advance(out)  # counters move, held copies are queued, full blocks registered
    assert scheduler.held == {} and list(scheduler.waiting) == copies[1:]
    copies[0].append_token(TOKEN, now=1.0)
    out = scheduler.schedule()
    # g.0 decodes; the copies' 9 tokens: two full blocks (8 tokens) come from the cache, the last is forwarded.
    assert plan(out) == [("g.0", 1, True), ("g.1", 1, True), ("g.2", 1, True)]
    assert [c.num_cached_tokens for c in copies] == [0, 8, 8]
    assert copies[1].block_ids[:2] == copies[0].block_ids[:2] == copies[2].block_ids[:2]
    for c in copies:
        c.finish(FinishReason.ABORT, 1.0)
        scheduler.finish(c)
        assert ("g" in scheduler.groups) == (c is not copies[-1])  # the group closes with its last copy
    assert scheduler.allocator.num_free == 16


def test_advance_moves_each_scheduled_counter_by_its_new_tokens():
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=6)
    a, b = make_request("a", 5), make_request("b", 3)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert plan(out) == [("a", 5, True), ("b", 1, False)]  # b's prompt is chunked by the budget
    scheduler.advance(out)
    assert (a.num_computed_tokens, b.num_computed_tokens) == (5, 1)
