"""A think block before the answer: the grammar starts after it, and a budget can end it.

A reasoning model writes its thinking between two markers (Qwen3's and DeepSeek-R1's `<think>`
and `</think>`) and then its answer. A request that names the end marker's token ids
(SamplingParams.reasoning_end_token_ids) holds a `ReasoningGrammar` in place of its plain grammar:
the tokens inside the block are unconstrained, its structured output (or tool-call grammar)
applies from the token after the end marker, and with `max_reasoning_tokens` the block is ended
for it. The markers are matched on token ids, as the tokenizer encodes them, and may be several
tokens long.

Where the block starts:
- no start marker given: the output starts inside the block (DeepSeek-R1's template writes
  `<think>` into the prompt), so everything before the end marker is thinking;
- a start marker given: the output starts inside the block where the prompt opened one and did not
  close it (its last start marker comes after its last end marker); otherwise the output may open
  one with its first tokens (Qwen3 with thinking on). Under a grammar its first token is then one
  the grammar allows or the start marker's first, and a started marker must be finished; without
  one, an output that does not begin with the marker is all answer.

The budget (llama.cpp's `--reasoning-budget` rule): each token taken inside the block counts,
those of a partly written end marker included, the token that completes it not; once `N` have
been taken and the block is still open, the next tokens are forced, one a step, to the whole end
marker (budget 0: at once, on opening), by a bitmask that allows that one token. A forced token is
sampled, appended, detokenized and counted as any other; the logprob it reports is the model's own
for it, read before the mask (as for every constrained token).

Like a grammar, the gate must see each token before it can say what may follow, so such a request
(SamplingParams.needs_resolved_output) is brought home every step in the deferred loop; drafts of
speculative decoding are walked and rolled back through it as through a grammar.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from enum import Enum
from typing import Any

import torch

from nanoserve.params import SamplingParams
from nanoserve.structured import allow_token, longest_allowed

logger = logging.getLogger("nanoserve")


class Phase(Enum):
    IDLE = "idle"  # the output may open a block with its next token (its first)
    OPENING = "opening"  # the start marker is partly written
    THINKING = "thinking"  # inside the block: unconstrained, counted against the budget
    FORCING = "forcing"  # the budget is spent: the end marker is being forced
    ANSWER = "answer"  # after the block (or with none): the grammar applies


def prompt_opens_block(prompt_token_ids: Sequence[int], start_ids: Sequence[int], end_ids: Sequence[int]) -> bool:
    """Whether the prompt's last start marker comes after its last end marker (no start: False)."""
    start, end = _last_index(prompt_token_ids, start_ids), _last_index(prompt_token_ids, end_ids)
    return start >= 0 and start > end


def _last_index(ids: Sequence[int], marker: Sequence[int]) -> int:
    n = len(marker)
    if n == 0:
        return -1
    marker = list(marker)
    return next((i for i in range(len(ids) - n, -1, -1) if list(ids[i:i + n]) == marker), -1)


class ReasoningGrammar:
    """One request's place around its think block, with RequestGrammar's methods (fill, advance,
    accept, rollback, is_terminated, longest_allowed), so the engine, the bitmask and speculative
    decoding use it as they use a grammar.

    Args:
        params: the request's SamplingParams (reasoning_end_token_ids set).
        prompt_token_ids: its prompt (where a start marker is given: does it open a block?).
        inner: the request's own grammar (a RequestGrammar), applied after the block; None: none.
    """

    def __init__(self, params: SamplingParams, prompt_token_ids: Sequence[int], inner: Any = None) -> None:
        self.start_ids, self.end_ids = params.reasoning_start_token_ids, params.reasoning_end_token_ids
        self.budget = params.max_reasoning_tokens  # None: no limit
        self.inner = inner
        self.phase = Phase.IDLE
        self.num_matched = 0  # OPENING: start tokens written; THINKING: end tokens matched; FORCING: forced
        self.num_reasoning = 0  # tokens taken inside the block (what the budget counts)
        self.history: list[tuple[Phase, int, int, bool]] = []  # per token taken: the state before it, inner took it
        if not self.start_ids or prompt_opens_block(prompt_token_ids, self.start_ids, self.end_ids):
            self._open()

    def _open(self) -> None:
        self.phase, self.num_matched, self.num_reasoning = Phase.THINKING, 0, 0
        if self.budget == 0:
            self.phase = Phase.FORCING

    @property
    def is_thinking(self) -> bool:
        """Inside the block (its end forced or not)."""
        return self.phase in (Phase.THINKING, Phase.FORCING)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes what may come next into row `row` of a host int32 bitmask [rows, W] (all ones
        on entry): nothing ruled out inside the block, the one forced token, or the grammar's."""
        if self.phase is Phase.FORCING:
            allow_token(bitmask, row, self.end_ids[self.num_matched], only=True)
        elif self.inner is None or self.phase is Phase.THINKING:
            return
        elif self.phase is Phase.OPENING:  # under a grammar a started marker is finished
            allow_token(bitmask, row, self.start_ids[self.num_matched], only=True)
        elif self.phase is Phase.IDLE:
            self.inner.fill(bitmask, row)
            allow_token(bitmask, row, self.start_ids[0])
        else:
            self.inner.fill(bitmask, row)

    def is_terminated(self) -> bool:
        return self.phase is Phase.ANSWER and self.inner is not None and self.inner.is_terminated()

    def advance(self, token_id: int) -> bool:
        """Takes one token if it may come next; False (and nothing taken) where it may not."""
        before = (self.phase, self.num_matched, self.num_reasoning)
        inner_took = False
        phase = self.phase
        if phase is Phase.IDLE and token_id == self.start_ids[0]:
            self.phase, self.num_matched = Phase.OPENING, 1
        elif phase is Phase.OPENING and token_id == self.start_ids[self.num_matched]:
            self.num_matched += 1
        elif phase in (Phase.IDLE, Phase.OPENING):
            if self.inner is not None and (phase is Phase.OPENING or not self.inner.advance(token_id)):
                return False
            self.phase, inner_took = Phase.ANSWER, self.inner is not None
        elif phase is Phase.THINKING:
            # llama.cpp's token_matcher: a mismatch restarts the match (at 1 if it is the marker's first)
            if token_id == self.end_ids[self.num_matched]:
                self.num_matched += 1
            else:
                self.num_matched = int(token_id == self.end_ids[0])
            if self.num_matched == len(self.end_ids):
                self.phase = Phase.ANSWER
            else:
                self.num_reasoning += 1
                if self.budget is not None and self.num_reasoning >= self.budget:
                    self.phase, self.num_matched = Phase.FORCING, 0
        elif phase is Phase.FORCING:
            if token_id != self.end_ids[self.num_matched]:
                return False
            self.num_matched += 1
            if self.num_matched == len(self.end_ids):
                self.phase = Phase.ANSWER
        elif self.inner is not None:  # ANSWER
            if not self.inner.advance(token_id):
                return False
            inner_took = True
        if self.phase is Phase.OPENING and self.num_matched == len(self.start_ids):
            self._open()
        self.history.append((*before, inner_took))
        return True

    def accept(self, token_id: int) -> bool:
        """Advances past one sampled token. Returns True when nothing more may follow: the
        grammar after the block terminated, or the token broke it (which the mask prevents)."""
        if not self.advance(token_id):
            logger.error("reasoning: token %d is not allowed in phase %s; ending the request", token_id,
                         self.phase.value)
            return True
        return self.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` tokens taken."""
        if num_tokens <= 0:
            return
        undone = self.history[-num_tokens:]
        del self.history[-num_tokens:]
        self.phase, self.num_matched, self.num_reasoning, _ = undone[0]
        num_inner = sum(took for *_, took in undone)
        if num_inner:
            self.inner.rollback(num_inner)

    def longest_allowed(self, tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` that may come next, taking none of them."""
        return longest_allowed(self, tokens)
