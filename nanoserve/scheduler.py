"""Scheduler: which requests run this step, how many tokens each, which blocks they own.

Plain Python over request counters and block ids, no torch. One rule covers prefill, chunked
prefill, decode and recompute after preemption: a scheduled request forwards the tokens from
`num_computed_tokens` up to at most `num_tokens`, within the step's token budget. An embedding
request (`request.pooling`) is a prompt that never samples: it is scheduled, chunked and preempted
like any other, and once its prompt is forwarded it waits, scheduled no more, for its vector.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace

from nanoserve.blocks import BlockAllocator, hash_block
from nanoserve.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens forwarded this step, from request.num_computed_tokens on
    samples: bool  # True when this step reaches the request's last token: a new token is sampled (never an embedding's)
    # Speculative decoding: drafts forwarded after the last token (counted in num_new_tokens); each
    # of their rows samples too, so the step samples 1 + len(draft_token_ids) rows for this request.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """What one step runs, in row order. Decodes of running requests come first."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # sent back to the queue this step
    num_batched_tokens: int = 0  # sum of num_new_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def without_finished(self) -> SchedulerOutput:
        """The same step less the requests that finished since it was scheduled (a deferred
        token that came home with a stop): nothing of theirs is forwarded."""
        scheduled = [item for item in self.scheduled if not item.request.is_finished]
        return SchedulerOutput(scheduled, self.preempted, sum(item.num_new_tokens for item in scheduled))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """Continuous batching over a fixed pool of KV blocks.

    Running requests are served first, in admission order; when one needs a block and none
    is free, the most recently admitted running request is preempted by recompute (its blocks
    are freed and it goes back to the head of the queue with its tokens kept). Waiting
    requests are then admitted first come, first served while a slot, budget and blocks remain.

    n > 1 completions of one prompt arrive as a group: the first copy is queued alone and the
    others are held until its prompt is in the cache, so they find its full blocks by prefix
    hash instead of recomputing them.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, enable_prefix_caching: bool = False) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is preempted first
        self.held: dict[str, list[Request]] = {}  # first copy's id -> the copies waiting for its prefill
        self.groups: dict[str, list[str]] = {}  # group id -> its copies' ids, while any is unfinished
        self._num_unfinished: dict[str, int] = {}  # group id -> copies not yet finished

    def add(self, request: Request) -> list[Request]:
        """Queues a request; returns what the scheduler will run for it: the request itself, or
        for n > 1 its n copies (ids f"{id}.{i}", seeds seed + i), of which the first is queued and
        the rest are held until its prefill is done (see advance)."""
        params = request.params
        if params.n == 1:
            self.waiting.append(request)
            return [request]
        copies = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            copy = Request(f"{request.request_id}.{i}", request.prompt_token_ids, replace(params, n=1, seed=seed),
                           request.eos_token_ids, request.arrival_time)
            copy.parent_id, copy.index = request.request_id, i
            copies.append(copy)
        self.groups[request.request_id] = [c.request_id for c in copies]
        self._num_unfinished[request.request_id] = len(copies)
        self.held[copies[0].request_id] = copies[1:]
        self.waiting.append(copies[0])
        return copies

    def _release_held(self, request: Request) -> None:
        held = self.held.pop(request.request_id, None)
        if held:
            self.add_next(held)

    def add_next(self, requests: list[Request]) -> None:
        """Puts requests at the head of the queue, in order: they are admitted before any other."""
        self.waiting.extendleft(reversed(requests))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(request.block_ids))

    def _preempt(self, request: Request, now: float) -> None:
        self.allocator.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        request.num_draft_computed = 0  # its blocks, and the draft model's K/V in them, are gone
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        request.mark_not_running(now)
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        now = time.perf_counter()
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # 1. Running requests, oldest admission first.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_pending_tokens and request.is_length_capped:
                i += 1  # its last token is on its way home; forwarding it would only overshoot
                continue
            if request.num_computed_tokens == request.num_tokens:
                i += 1  # an embedding whose prompt is forwarded: its vector is on its way home (deferred output)
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            # Drafts take what budget the running requests after this one do not need for a token each.
            spare = budget - num_new - (len(self.running) - i - 1)
            drafts = request.draft_token_ids[:max(0, spare)] if num_new == 1 and request.pooling is None else []
            need = self._blocks_needed(request, num_new + len(drafts))
            if drafts and not self.allocator.can_allocate(need):  # drafts never preempt anyone
                drafts, need = [], self._blocks_needed(request, num_new)
            while not self.allocator.can_allocate(need):
                victim = self.running.pop()  # most recently admitted
                self._preempt(victim, now)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break  # preempted itself: every later request has been preempted too
            request.block_ids.extend(self.allocator.allocate(need))
            samples = request.num_computed_tokens + num_new == request.num_tokens and request.pooling is None
            out.scheduled.append(ScheduledRequest(request, num_new + len(drafts), samples, drafts))
            budget -= num_new + len(drafts)
            i += 1

        # 2. Waiting requests, first come first served, while slots, budget and blocks remain.
        # A preempted request never re-enters in the step that preempted it.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[0]
            # prompt logprobs, mean or cls pooling need every prompt row: a cached prefix has none
            hits = self._cache_hits(request) if self.enable_prefix_caching and not request.forwards_whole_prompt else []
            num_computed = len(hits) * self.block_size
            remaining = request.num_tokens - num_computed
            if remaining > budget and not self.enable_chunked_prefill:
                break
            num_new = min(remaining, budget)
            need = cdiv(num_computed + num_new, self.block_size) - len(hits)
            reclaimed = sum(1 for block_id in hits if self.allocator.ref_counts[block_id] == 0)
            if not self.allocator.can_allocate(need + reclaimed):  # hits on the free list leave it too
                break
            self.waiting.popleft()
            for block_id in hits:
                self.allocator.take_cached(block_id)
            request.block_ids = hits + self.allocator.allocate(need)
            request.num_computed_tokens = num_computed
            request.num_cached_tokens = num_computed
            request.mark_running(now)
            self.running.append(request)
            samples = num_computed + num_new == request.num_tokens and request.pooling is None
            out.scheduled.append(ScheduledRequest(request, num_new, samples))
            budget -= num_new

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def _cache_hits(self, request: Request) -> list[int]:
        """The cached blocks that hold this request's leading full blocks, in order.

        At most (num_tokens - 1) // block_size blocks: the last token is always forwarded, since
        its logits are what the next token is sampled from. The request's block_hashes keeps the
        hashes of the hits only, so the blocks it computes itself are registered when they fill.
        """
        hashes, bs = request.block_hashes, self.block_size
        hits: list[int] = []
        for i in range((request.num_tokens - 1) // bs):
            if i == len(hashes):
                hashes.append(hash_block(hashes[-1] if hashes else None, request.token_ids[i * bs:(i + 1) * bs]))
            block_id = self.allocator.lookup(hashes[i])
            if block_id is None:
                break
            hits.append(block_id)
        del hashes[len(hits):]
        return hits

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the request's blocks that became full of computed tokens, so others can hit them.

        A token still in flight (deferred output) is computed but not yet known: its block waits
        for the next call.
        """
        hashes, bs = request.block_hashes, self.block_size
        for i in range(len(hashes), min(request.num_computed_tokens, len(request.token_ids)) // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, request.token_ids[i * bs:(i + 1) * bs]))
            self.allocator.register(request.block_ids[i], hashes[i])

    def advance(self, out: SchedulerOutput) -> None:
        """After a forward: the scheduled tokens are in the cache. Held copies of a group whose
        first copy just finished its prompt are queued, and blocks that became full are
        registered for the prefix cache (before anything finishing frees them)."""
        for item in out.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
            if item.samples and self.held:
                self._release_held(item.request)
        if self.enable_prefix_caching:
            for item in out.scheduled:
                self.cache_full_blocks(item.request)

    def rollback(self, request: Request, num_rejected: int) -> None:
        """After a verification: the last `num_rejected` tokens forwarded were drafts the target
        rejected. Their K/V is garbage to be overwritten: num_computed_tokens moves back over them,
        and the blocks past the last accepted token return to the pool (never registered in the
        prefix cache: cache_full_blocks registers only blocks of tokens the request holds)."""
        request.num_computed_tokens -= num_rejected
        self._free_past(request, request.num_computed_tokens)

    def drop_drafts(self, out: SchedulerOutput, item: ScheduledRequest, num_kept: int) -> None:
        """Before the forward: `item` forwards only its first `num_kept` drafts (a draft model stopped
        proposing at a stop token), and the blocks that only the dropped ones needed go back."""
        num_dropped = len(item.draft_token_ids) - num_kept
        if num_dropped <= 0:
            return
        del item.draft_token_ids[num_kept:]
        item.num_new_tokens -= num_dropped
        out.num_batched_tokens -= num_dropped
        self._free_past(item.request, item.request.num_computed_tokens + item.num_new_tokens)

    def _free_past(self, request: Request, num_tokens: int) -> None:
        """Returns the request's blocks past those its first `num_tokens` tokens fill."""
        keep = cdiv(num_tokens, self.block_size)
        if len(request.block_ids) > keep:
            self.allocator.free(request.block_ids[keep:])
            del request.block_ids[keep:]

    def finish(self, request: Request) -> None:
        """Releases a finished or aborted request's blocks and slot (and its held copies, which
        no longer wait for it); closes its group when it was the group's last copy."""
        self._release_held(request)
        if request.parent_id is not None:
            left = self._num_unfinished[request.parent_id] - 1
            if left:
                self._num_unfinished[request.parent_id] = left
            else:
                del self._num_unfinished[request.parent_id], self.groups[request.parent_id]
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.allocator.free(request.block_ids)
        request.block_ids = []

    def owners(self) -> dict[str, list[int]]:
        """request id -> blocks held, for the allocator's invariant check."""
        return {r.request_id: r.block_ids for r in [*self.running, *self.waiting] if r.block_ids}
