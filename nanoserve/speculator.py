"""Speculative decoding in the engine's step: the one component that holds its state from phase to
phase. The engine calls it at named points: `calibrate` at start-up, `propose` before schedule,
`make_drafts` after it (a draft model's forwards), `before_sample`, `after_resolve` (rollback and
the seeded generators' rewind) and `end_step` (the rule's step-time measurement).

What a draft is and who makes it: nanoserve.speculative (the rule, n-gram lookup) and
nanoserve.draft (the draft model); how a step's rows verify drafts: nanoserve.step_rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nanoserve.draft import DraftModel
from nanoserve.output_processor import StepOutputs
from nanoserve.request import Request
from nanoserve.sampling import skip_noise
from nanoserve.scheduler import Scheduler, SchedulerOutput
from nanoserve.speculative import PLACEHOLDER, SpeculationRule, SpeculativeConfig, overhead_rows, row_seconds
from nanoserve.step_rows import StepRows

logger = logging.getLogger("nanoserve")
CATCH_UP_ROWS = 64  # a draft model's catch-up is timed as a forward of this many tokens


class Speculator:
    """Speculative decoding's state across a step (module docstring).

    Args:
        config: the engine's speculative config.
        draft: the draft model (method "draft_model"), laid out by the plan's draft plan; None for n-gram.
    """

    def __init__(self, config: SpeculativeConfig, draft: DraftModel | None) -> None:
        self.config = config
        self.rule = SpeculationRule(config)
        self.draft = draft
        self.num_accepted = 0  # drafts the last resolve kept (the step profile's count)
        self.catch_up_s = 0.0  # this step's draft catch-up past steady drafting (make_drafts)
        # Seeded requests verifying drafts this step -> their generator's state before its draws, and
        # the noise rows' (V, dtype): after_resolve rewinds past the rows it discards.
        self._seeded_states: dict[str, torch.Tensor] = {}
        self._noise_row: tuple[int, torch.dtype] = (0, torch.float32)

    def calibrate(self, forward_seconds: Callable[[int, bool], float]) -> None:
        """Fits the rule's cost model where it asks for one: forward_seconds(num_rows, draft) times a
        forward of a lone sequence scoring num_rows tokens, by the target or the draft model."""
        if not self.rule.needs_calibration:
            return
        wide = max(2, min(16, 1 + 2 * self.config.num_speculative_tokens))
        one, many = forward_seconds(1, False), forward_seconds(wide, False)
        self.rule.overhead_rows = overhead_rows(one, many, wide)
        logger.info("nanoserve: speculation: a step of 1 row %.2f ms, of %d rows %.2f ms: overhead %.1f rows",
                    1e3 * one, wide, 1e3 * many, self.rule.overhead_rows)
        if self.draft is not None:
            drafting = forward_seconds(1, True)
            self.rule.draft_rows = drafting / row_seconds(one, many, wide)
            catch_up = forward_seconds(CATCH_UP_ROWS, True) / CATCH_UP_ROWS
            self.rule.catch_up_seconds = catch_up
            logger.info("nanoserve: speculation: a draft token %.2f ms: %.1f rows; catching up %.3f ms a token",
                        1e3 * drafting, self.rule.draft_rows, 1e3 * catch_up)

    def propose(self, running: Sequence[Request]) -> None:
        """Before schedule: which running requests draft, and their n-gram drafts or placeholders."""
        self.catch_up_s = 0.0
        self.rule.assign(running)

    def needs_drafts(self, sched: SchedulerOutput) -> bool:
        """Whether the draft model has placeholders to fill in this step."""
        return self.draft is not None and any(item.draft_token_ids for item in sched.scheduled)

    def make_drafts(self, sched: SchedulerOutput, scheduler: Scheduler, vocab_size: int, grammars: Any) -> None:
        """The draft model's proposals over the placeholders the schedule budgeted; what a stop token
        left unproposed the scheduler takes back."""
        self.catch_up_s = self.draft.propose(sched.scheduled, vocab_size, grammars)
        for item in sched.scheduled:
            if PLACEHOLDER in item.draft_token_ids:
                scheduler.drop_drafts(sched, item, item.draft_token_ids.index(PLACEHOLDER))

    def before_sample(self, rows: StepRows, generators: dict[str, torch.Generator], noise_row: tuple[int, torch.dtype]
                      ) -> None:
        """Keeps each seeded sampled request's generator state, where it verifies drafts."""
        self._noise_row = noise_row
        self._seeded_states = {
            span.request.request_id: generators[span.request.request_id].get_state() for span in rows.spans
            if span.drafts and span.request.params.temperature > 0.0 and span.request.request_id in generators}

    def after_resolve(self, result: StepOutputs, scheduler: Scheduler, generators: dict[str, torch.Generator]) -> None:
        """Rolls back the K/V of the drafts the step rejected and rewinds a seeded request's noise."""
        self.num_accepted = result.num_accepted
        for span, num_rejected in result.rejected:
            scheduler.rollback(span.request, num_rejected)
            state = self._seeded_states.get(span.request.request_id)
            if state is not None and num_rejected:
                # Its rows past the first rejection drew noise for nothing. Drawn again, only the kept
                # rows', its next token gets the noise it gets without speculation: a seeded request's
                # tokens never depend on how many drafts the batch left it (max_step_rows, the budget).
                generator = generators[span.request.request_id]
                generator.set_state(state)
                skip_noise(generator, span.num_rows - num_rejected, *self._noise_row)

    def end_step(self, num_requests: int, decode_only: bool, drafted: bool, seconds: float) -> None:
        """The rule's measurement of a decode-only step: its seconds, less the draft's catch-up, over
        the tokens it kept (a token for each of its num_requests and each draft they kept)."""
        if decode_only:
            self.rule.observe_step(drafted, num_requests + self.num_accepted, seconds - self.catch_up_s)
