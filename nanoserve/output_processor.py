"""The output stage: one step's sampled tokens come home once, in row order, and become outputs.

:class:`OutputProcessor` resolves a step's :class:`~nanoserve.readback.TokenBatch` (one journey
home, counted by its Readback), then does everything that needs the token as a Python int: append
it, apply stop ids, stop strings and ``min_tokens``, detokenize, attach logprobs and build each
:class:`RequestOutput`. It returns the outputs and the requests that finished; it never calls back
into the engine. The sync-cost arithmetic and its gates are instruments: ``nanoserve.instruments.sync``
and ``nanoserve.instruments.sync_gates``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nanoserve.readback import Readback, TokenBatch, check_in_row_order
from nanoserve.request import FinishReason, ListView, Request, RequestOutput
from nanoserve.speculative import observe
from nanoserve.step_rows import RowSpan, StepRows


@dataclass
class StepOutputs:
    """What one step's tokens did, in row order."""

    outputs: list[RequestOutput]  # the embeddings finished, then one per request still live, in row order
    finished: list[Request]  # requests this step finished: the engine releases their blocks
    # Speculative decoding: (span, drafts it forwarded that were rejected) for each live request
    # that verified drafts; the engine rolls their K/V back (Scheduler.rollback).
    rejected: list[tuple[RowSpan, int]] = field(default_factory=list)
    num_accepted: int = 0  # drafts kept this step, all requests together (the step profile's count)


class OutputProcessor:
    """Turns each step's :class:`TokenBatch` into :class:`RequestOutput` s with one readback.

    ``num_steps`` counts the batches processed that carried at least one row; an empty batch
    makes no journey and is not a step here, so ``transfers_per_step`` reads 1.0 exactly for
    the synchronous loop whatever the scheduler did. The journeys are read from the shared
    :class:`Readback`, so a readback made anywhere else through it (a log line, a second
    resolve path) shows up in the rate, which is the point: the gate
    ``check_single_transfer`` reads the rate rather than inspecting code.

    Args:
        readback: the counter the engine's batches are built with; a fresh one if None.
    """

    __slots__ = ("readback", "num_steps")

    def __init__(self, readback: Readback | None = None) -> None:
        self.readback = readback if readback is not None else Readback()
        self.num_steps = 0  # batches processed that carried at least one row

    def process(self, batch: TokenBatch, rows: StepRows) -> StepOutputs:
        """Resolves ``batch`` (one transfer) and applies each span's tokens to its request.

        A request already finished (stopped or aborted after its token was launched, in the
        deferred loop) gets nothing: its token is overshoot and is dropped. Each live request
        appends its token, which applies stop token ids, ``min_tokens`` and ``max_tokens``; a
        request with a grammar feeds it the token and stops when the grammar is complete; then
        its text grows, stop strings are searched in the new text, logprobs are attached.

        Speculative decoding gives a request several consecutive rows: one per draft it verified
        and a last one. Its tokens are applied in row order up to and including the first row whose
        token is not its draft (a rejection: that token is the target's own), or until a stop rule
        ends the request; the rows after that are dropped. One output per request.

        Args:
            batch: the step's tokens; must count on this processor's ``readback``.
            rows: the step's rows (nanoserve.step_rows): the spans that own them.

        Raises:
            ValueError: if ``batch`` counts its journey on a different :class:`Readback`, which
                would leave this processor's rate reading 0 while the step still synced.
            RowOrderMismatch: if the batch's rows are not owned by ``rows`` in that order.
        """
        if batch.readback is not self.readback:
            raise ValueError(
                "batch counts its readback on a different Readback than this processor reads: "
                "build TokenBatch with processor.readback"
            )
        check_in_row_order(batch, rows.request_ids)
        token_ids = batch.resolve()
        for request, position, entry in batch.resolve_prompt_logprobs():  # once each: a recomputed prompt skips
            if request.prompt_logprobs is not None and len(request.prompt_logprobs) == position:
                request.prompt_logprobs.append(entry)
        now = time.perf_counter()  # the tokens of one step arrive together, after its one readback
        outputs, finished = self._pool(batch, now)
        if not token_ids:
            self.num_steps += batch.pooled is not None  # embedding rows only: their sums made the journey
            return StepOutputs(outputs, finished)
        self.num_steps += 1
        logprobs = batch.resolve_logprobs()
        rejected: list[tuple[RowSpan, int]] = []
        total_accepted = 0
        for span in rows.spans:
            request = span.request
            if request.is_finished:
                continue
            num_accepted, done = 0, False
            for j, row in enumerate(span.rows):
                done = self._apply(request, token_ids[row], logprobs.get(row), now)
                kept = j < len(span.drafts) and token_ids[row] == span.drafts[j]  # it sampled its draft
                num_accepted += kept
                if done or not kept:
                    break
            if span.drafts:
                observe(request, len(span.drafts), num_accepted)
                total_accepted += num_accepted
                if not done:
                    rejected.append((span, len(span.drafts) - num_accepted))
            if done:
                finished.append(request)
            outputs.append(make_output(request))
        return StepOutputs(outputs, finished, rejected, total_accepted)

    @staticmethod
    def _pool(batch: TokenBatch, now: float) -> tuple[list[RequestOutput], list[Request]]:
        """Adds each embedding request's pooled sum to its own; one whose prompt is done gets its
        vector (PoolingParams.finish) and finishes. A request already finished (aborted after its
        rows were launched) gets nothing."""
        outputs, finished = [], []
        for request, num_rows, done, part in batch.resolve_pooled():
            if request.is_finished:
                continue
            request.add_pooled(part, num_rows)
            if done:
                request.embedding = request.pooling.finish(request.pooled_sum, request.num_pooled_rows)
                request.finish(FinishReason.STOP, now)
                finished.append(request)
                outputs.append(make_output(request))
        return outputs, finished

    @staticmethod
    def _apply(request: Request, token_id: int, logprobs: dict[int, float] | None, now: float) -> bool:
        """Appends one token to a live request with everything that follows from it; True: it finished."""
        if request.num_pending_tokens:
            request.num_pending_tokens -= 1
        done = request.append_token(token_id, now)
        if not done and request.grammar is not None and request.grammar.accept(token_id):
            request.finish(FinishReason.STOP, now)  # the grammar is complete: nothing may follow
            done = True
        if request.detokenizer is not None:
            request.detokenizer.add((token_id,))
        if logprobs is not None:
            sampled = {token_id: logprobs[token_id]}
            request.logprobs.append(dict(list(logprobs.items())[:request.params.logprobs]) | sampled)
        if not done and request.params.stop and request.num_output_tokens >= request.params.min_tokens:
            done = check_stop_strings(request, now)
        return done

    @property
    def transfers_per_step(self) -> float:
        """Journeys home per applied step; 0.0 before any step."""
        return self.readback.journeys / self.num_steps if self.num_steps else 0.0

    def reset(self) -> None:
        """Zero the step count and the readback counters."""
        self.num_steps = 0
        self.readback.reset()


def check_stop_strings(request: Request, now: float) -> bool:
    """Ends the request at the first stop string in its text; the text is cut before the match."""
    text = request.detokenizer.text
    # Only a match that ends in the newest text is new: earlier text was checked already.
    start = max(0, request.num_stop_scanned_chars - max(len(s) for s in request.params.stop) + 1)
    request.num_stop_scanned_chars = len(text)
    found = [(idx, stop) for stop in request.params.stop if (idx := text.find(stop, start)) >= 0]
    if not found:
        return False
    idx, stop = min(found)
    request.stop_text, request.stop_reason = text[:idx], stop
    request.finish(FinishReason.STOP, now)
    return True


def make_output(request: Request) -> RequestOutput:
    """The caller's view of a request now: its tokens, text, stamps and logprobs so far.

    The token ids, stamps and logprobs are views of the request's own lists fixed at their
    present length (ListView), not copies: one output costs O(1) in the request's length, and a
    step O(rows) however long its requests have run.
    """
    detokenizer = request.detokenizer
    if request.stop_text is not None:
        text = request.stop_text
    elif detokenizer is not None:
        if request.is_finished:
            detokenizer.flush()  # the held-back tail of a half character, as the full decode has it
        text = detokenizer.text
    else:
        text = ""
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        token_ids=ListView(request.token_ids, request.num_prompt_tokens),
        text=text,
        finished=request.is_finished,
        finish_reason=request.finish_reason.value if request.finish_reason else None,
        arrival_time=request.arrival_time,
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
        finished_time=request.finished_time,
        token_times=ListView(request.token_times),
        running_s=request.running_s,
        num_preemptions=request.num_preemptions,
        num_cached_tokens=request.num_cached_tokens,
        stop_reason=request.stop_reason,
        logprobs=ListView(request.logprobs) if request.logprobs is not None else None,
        prompt_logprobs=ListView(request.prompt_logprobs) if request.prompt_logprobs is not None else None,
        parent_id=request.parent_id,
        index=request.index,
        num_drafts=request.num_drafts,
        num_draft_tokens=request.num_draft_tokens,
        num_accepted_tokens=request.num_accepted_tokens,
        embedding=request.embedding,
    )
