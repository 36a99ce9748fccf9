"""A step's rows: which request owns each row of the step's logits, the position of the token the
row follows, and whether the row verifies a speculative draft.

A sampling request owns a span of consecutive rows: one for its last token, and, with speculative
decoding, one more for each draft it verifies (nanoserve.speculative). Row j of a span samples the
token after drafts 0 .. j-1; where j < k it verifies draft j, which is kept while the row samples
exactly it. The sampler, the grammar bitmask and the output stage read the spans of one `StepRows`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanoserve.request import Request
    from nanoserve.scheduler import ScheduledRequest


@dataclass(frozen=True)
class RowSpan:
    """One sampling request's rows of a step."""

    request: Request
    first: int  # its first row of the step's logits
    position: int  # the position of its last token, whose row is its first
    drafts: tuple[int, ...] = ()  # row first + j verifies drafts[j]; its last row verifies none

    @property
    def num_rows(self) -> int:
        return 1 + len(self.drafts)

    @property
    def rows(self) -> range:
        return range(self.first, self.first + self.num_rows)


@dataclass(frozen=True)
class StepRows:
    """Every sampling request's span, in row order (the order of the step's logits)."""

    spans: tuple[RowSpan, ...]
    num_rows: int

    @classmethod
    def of(cls, scheduled: Sequence[ScheduledRequest]) -> StepRows:
        """The rows of a scheduled step, before its forward (num_computed_tokens not yet advanced)."""
        spans, row = [], 0
        for item in scheduled:
            if item.samples:
                drafts, request = tuple(item.draft_token_ids), item.request
                position = request.num_computed_tokens + item.num_new_tokens - 1 - len(drafts)
                spans.append(RowSpan(request, row, position, drafts))
                row += 1 + len(drafts)
        return cls(tuple(spans), row)

    @classmethod
    def one_each(cls, requests: Sequence[Request]) -> StepRows:
        """A row for each request, in order, none verifying a draft (positions: their last tokens')."""
        return cls(tuple(RowSpan(r, i, r.num_tokens - 1) for i, r in enumerate(requests)), len(requests))

    @functools.cached_property
    def requests(self) -> tuple[Request, ...]:
        """Each row's request: a span's request once per row."""
        return tuple(span.request for span in self.spans for _ in range(span.num_rows))

    @functools.cached_property
    def request_ids(self) -> tuple[str, ...]:
        """Each row's request id (TokenBatch's rows)."""
        return tuple(request.request_id for request in self.requests)

    @functools.cached_property
    def has_drafts(self) -> bool:
        return any(span.drafts for span in self.spans)

    def drafts_before(self) -> Iterator[tuple[RowSpan, tuple[int, ...]]]:
        """Each row's span and the drafts of its span's earlier rows (what row j follows), row 0 first."""
        for span in self.spans:
            for j in range(span.num_rows):
                yield span, span.drafts[:j]
