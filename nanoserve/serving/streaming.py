"""Streaming: a request's tokens and text as they are produced, as StreamDeltas.

`stream(engine, prompt, params)` drives the engine synchronously from the caller's own loop; for
many callers at once see `nanoserve.serving.async_engine.AsyncEngine`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoserve.params import SamplingParams
from nanoserve.request import RequestOutput

if TYPE_CHECKING:
    from nanoserve.engine import Engine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamDelta:
    """What one step added to one completion of a request."""

    request_id: str  # the id add_request returned (for n > 1, the group's; output.request_id is the copy's)
    index: int  # which of the n completions this is; 0 when n == 1
    token_ids: list[int]  # output token ids new since the previous delta (usually one)
    text: str  # text new since the previous delta; "" while a character (or a possible stop string) is unfinished
    logprobs: list[dict[int, float]] | None  # per new token, when the request asked for logprobs
    finished: bool  # this completion is done
    finish_reason: str | None  # "stop" | "length" | "abort" on the completion's last delta, else None
    output: RequestOutput  # the engine's cumulative output this delta was cut from (all ids, stamps)


class DeltaMaker:
    """Cuts cumulative RequestOutputs of one completion into deltas: the new token ids, and the
    part of the output's text not handed out yet (the engine's own incremental text).

    With stop strings the engine ends the text before the match, possibly in a later step than
    the one that produced the match's first characters. So the last len(longest stop) - 1
    characters are held back until the next step (vLLM does the same), and the final delta is cut
    from the final text: whatever was handed out is always a prefix of it.
    """

    def __init__(self, params: SamplingParams | None) -> None:
        stop = tuple(getattr(params, "stop", ()) or ())
        self.num_held_chars = max((len(s) for s in stop), default=1) - 1
        self.num_seen = 0  # output tokens already handed out
        self.num_emitted = 0  # characters of text already handed out

    def make(self, out: RequestOutput, request_id: str) -> StreamDelta:
        new_ids = list(out.token_ids[self.num_seen :])
        logprobs = None if out.logprobs is None else list(out.logprobs[self.num_seen :])
        self.num_seen = len(out.token_ids)
        if out.finished:
            text, self.num_emitted = out.text[self.num_emitted :], len(out.text)
        else:
            safe = len(out.text) - self.num_held_chars
            text = out.text[self.num_emitted : safe] if safe > self.num_emitted else ""
            self.num_emitted += len(text)
        return StreamDelta(request_id, out.index, new_ids, text, logprobs, out.finished, out.finish_reason, out)


def group_of(out: RequestOutput) -> str:
    """The id add_request returned for the request this output belongs to."""
    return out.parent_id or out.request_id


def stream(engine: Engine, prompt: str | Sequence[int], params: SamplingParams | None = None,
           request_id: str | None = None) -> Iterator[StreamDelta]:
    """Adds one request and steps the engine until it finishes, yielding a delta per new token.

    For a single caller: other requests already in the engine advance too, but their outputs are
    dropped here (use AsyncEngine to serve many). With n > 1 the completions' deltas interleave,
    told apart by `index`. Closing the iterator early aborts the request.

    Raises:
        ValueError: at the call, whatever `Engine.add_request` rejects.
    """
    params = params or SamplingParams()
    rid = engine.add_request(prompt, params, request_id=request_id)
    return _drive(engine, rid, params)


def _drive(engine: Engine, rid: str, params: SamplingParams) -> Iterator[StreamDelta]:
    makers: dict[int, DeltaMaker] = {}
    num_unfinished = params.n
    try:
        while num_unfinished:
            if not engine.has_unfinished():
                raise RuntimeError(f"request {rid!r} left the engine without a final output")
            for out in engine.step():
                if group_of(out) == rid:
                    maker = makers.setdefault(out.index, DeltaMaker(params))
                    num_unfinished -= out.finished
                    yield maker.make(out, rid)
    finally:
        if engine.is_unfinished(rid):  # the caller stopped early: give the blocks back
            engine.abort(rid)
