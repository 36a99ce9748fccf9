"""Streaming: a request's tokens and text as they are produced, for one caller or many.

`stream(engine, prompt, params)` drives the engine synchronously from the caller's own loop.
`AsyncEngine` is the front a server needs: any number of coroutines submit at once, and one
background loop steps the engine. The step is blocking (a forward pass), so it runs in a worker
thread; a lock makes sure an add or an abort never lands in the middle of one. Each request's
outputs reach its consumer through its own asyncio queue, and a consumer that stops (cancelled,
or its iterator closed) aborts its request so the blocks go back to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoserve.detokenize import IncrementalDetokenizer
from nanoserve.params import SamplingParams
from nanoserve.request import RequestOutput

if TYPE_CHECKING:
    from nanoserve.engine import Engine, EngineStats

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


class _DeltaMaker:
    """Cuts cumulative RequestOutputs of one completion into deltas.

    With stop strings the engine ends the text before the match, possibly in a later step than
    the one that produced the match's first characters. So the last len(longest stop) - 1
    characters are held back until the next step (vLLM does the same), and the final delta is cut
    from the engine's own text: whatever was handed out is always a prefix of it.
    """

    def __init__(self, tokenizer, params: SamplingParams | None) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop = tuple(getattr(params, "stop", ()) or ())
        self.num_held_chars = max((len(s) for s in self.stop), default=1) - 1
        self.num_seen = 0  # output tokens already handed out
        self.num_emitted = 0  # characters of text already handed out

    def make(self, out: RequestOutput, request_id: str) -> StreamDelta:
        new_ids = list(out.token_ids[self.num_seen :])
        logprobs = None if out.logprobs is None else list(out.logprobs[self.num_seen :])
        self.num_seen = len(out.token_ids)
        self.detokenizer.add(new_ids)
        if out.finished:
            self.detokenizer.flush()
            final = out.text if self.stop else self.detokenizer.text
            text, self.num_emitted = final[self.num_emitted :], len(final)
        else:
            safe = len(self.detokenizer.text) - self.num_held_chars
            text = self.detokenizer.text[self.num_emitted : safe] if safe > self.num_emitted else ""
            self.num_emitted += len(text)
        return StreamDelta(request_id, out.index, new_ids, text, logprobs, out.finished, out.finish_reason, out)


def _group_of(out: RequestOutput) -> str:
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
    makers: dict[int, _DeltaMaker] = {}
    num_unfinished = params.n
    try:
        while num_unfinished:
            if not engine.has_unfinished():
                raise RuntimeError(f"request {rid!r} left the engine without a final output")
            for out in engine.step():
                if _group_of(out) == rid:
                    maker = makers.setdefault(out.index, _DeltaMaker(engine.tokenizer, params))
                    num_unfinished -= out.finished
                    yield maker.make(out, rid)
    finally:
        for child in _unfinished_ids(engine, rid):  # the caller stopped early: give the blocks back
            engine.abort(child)


def _unfinished_ids(engine: Engine, rid: str) -> list[str]:
    """The engine ids still unfinished of request `rid`: itself, or its n > 1 copies in index order
    (aborting copy 0 first, as Engine.abort of a group does, so its held copies are released)."""
    if rid in engine.requests:
        return [rid]
    copies = [r for r in engine.requests.values() if r.parent_id == rid]
    return [r.request_id for r in sorted(copies, key=lambda r: r.index)]


class EngineDeadError(RuntimeError):
    """The background loop's step raised; the engine's state can no longer be trusted."""


class RequestStream:
    """One request submitted to an AsyncEngine: iterate it (once) for its StreamDeltas.

    With n > 1 the n completions' deltas interleave, told apart by `index`. Stopping early (the
    consuming task cancelled, the iterator closed, `abort()`) aborts the request; the abort lands
    between two steps.
    """

    def __init__(self, owner: AsyncEngine, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, queue: asyncio.Queue) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids  # as the engine tokenized the prompt
        self.params = params
        self._owner = owner
        self._queue = queue  # RequestOutput per step, or an exception when the loop died
        self._makers = [_DeltaMaker(owner.engine.tokenizer, params) for _ in range(params.n)]
        self._num_unfinished = params.n
        self._abort_scheduled = False

    @property
    def finished(self) -> bool:
        """Every completion's final output (stop, length or abort) has been handed out."""
        return self._num_unfinished == 0

    def __aiter__(self) -> AsyncIterator[StreamDelta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[StreamDelta]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine loop failed: {item!r}") from item
                delta = self._makers[item.index].make(item, self.request_id)
                self._num_unfinished -= delta.finished
                yield delta
        finally:
            self.abort()

    def abort(self) -> None:
        """Asks the loop to abort this request unless it already finished. Never blocks."""
        if not self.finished and not self._abort_scheduled:
            self._abort_scheduled = True
            self._owner._schedule_abort(self.request_id)


class AsyncEngine:
    """An asyncio front over one Engine: many submitters, one stepping loop.

    Bound to the event loop of its first `add_request`. `on_finished`, if given, is called in the
    event loop with the final RequestOutput of every request that finishes, aborts included (the
    server counts its metrics there).
    """

    def __init__(self, engine: Engine, on_finished: Callable[[RequestOutput], None] | None = None) -> None:
        self.engine = engine
        self.on_finished = on_finished
        self._lock = threading.Lock()  # held by every engine mutation: add, abort, step
        self._queues: dict[str, asyncio.Queue] = {}  # unfinished requests' output queues
        self._num_unfinished: dict[str, int] = {}  # completions still running per request (n > 1)
        self._pending_aborts: list[str] = []  # applied by the loop before its next step
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoserve-step")
        self.error: BaseException | None = None  # set when a step raised; the engine is dead
        self._closed = False  # shutdown() ran

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done() and self.error is None

    async def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                          request_id: str | None = None) -> RequestStream:
        """Validates and queues one request; returns the stream of its deltas.

        Raises:
            ValueError: whatever `Engine.add_request` rejects.
            EngineDeadError: the loop has failed.
        """
        if self.error is not None:
            raise EngineDeadError(f"the engine loop failed: {self.error!r}")
        if self._closed:
            raise EngineDeadError("the AsyncEngine was shut down")
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if rid in self._queues:
            raise ValueError(f"request_id {rid!r} is already in use")
        params = params or SamplingParams()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue  # before the add: the first output may follow at once
        self._num_unfinished[rid] = params.n
        try:
            prompt_ids = await asyncio.to_thread(self._add_locked, prompt, params, rid)
        except BaseException as e:
            self._queues.pop(rid, None)
            self._num_unfinished.pop(rid, None)
            if not isinstance(e, ValueError):  # cancelled while the add ran: it may have landed
                self._schedule_abort(rid)
            raise
        self._ensure_loop()
        self._wakeup.set()
        return RequestStream(self, rid, prompt_ids, params, queue)

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """`async for delta in async_engine.generate(prompt, params)`; stopping early aborts."""
        request = await self.add_request(prompt, params, request_id)
        async with aclosing(request._deltas()) as deltas:
            async for delta in deltas:
                yield delta

    async def abort(self, request_id: str) -> None:
        """Aborts a request if it is still unfinished (no error otherwise)."""
        self._schedule_abort(request_id)

    async def stats(self) -> EngineStats:
        """The engine's stats, read between steps."""
        return await asyncio.to_thread(self._locked, self.engine.stats)

    async def shutdown(self) -> None:
        """Stops the loop and aborts every unfinished request."""
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        with self._lock:
            for rid in list(self._num_unfinished):
                for child in _unfinished_ids(self.engine, rid):
                    out = self.engine.abort(child)
                    queue = self._queues.get(rid)
                    if queue is not None:
                        queue.put_nowait(out)
                    self._finish(out)
        self._executor.shutdown(wait=True)

    # ---- inside --------------------------------------------------------------------------------

    def _locked(self, fn, *args):
        with self._lock:
            return fn(*args)

    def _add_locked(self, prompt, params, rid: str) -> list[int]:
        with self._lock:
            self.engine.add_request(prompt, params, request_id=rid)
            return list(self.engine.requests[_unfinished_ids(self.engine, rid)[0]].prompt_token_ids)

    def _schedule_abort(self, rid: str) -> None:
        self._pending_aborts.append(rid)
        if self.error is not None or self._closed:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # called outside the event loop: the loop's next turn applies it
            return
        self._ensure_loop()  # an add cancelled before it started the loop still gets its abort
        self._wakeup.set()

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            if self._wakeup is None:
                self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="nanoserve-engine-loop")

    def _step_locked(self, aborts: list[str]) -> list[RequestOutput]:
        with self._lock:
            outputs = [self.engine.abort(child) for rid in aborts for child in _unfinished_ids(self.engine, rid)]
            if self.engine.has_unfinished():
                outputs += self.engine.step()
            return outputs

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending_aborts and not self.engine.has_unfinished():
                self._wakeup.clear()  # nothing to do: sleep until an add or an abort sets it
                await self._wakeup.wait()
                continue
            aborts, self._pending_aborts = self._pending_aborts, []
            try:
                outputs = await loop.run_in_executor(self._executor, self._step_locked, aborts)
            except Exception as e:  # a failed step leaves the engine half-updated: stop serving
                self.error = e
                for queue in self._queues.values():
                    queue.put_nowait(e)
                self._queues.clear()
                self._num_unfinished.clear()
                return
            for out in outputs:
                queue = self._queues.get(_group_of(out))
                if queue is not None:
                    queue.put_nowait(out)
                if out.finished:
                    self._finish(out)

    def _finish(self, out: RequestOutput) -> None:
        rid = _group_of(out)
        left = self._num_unfinished.get(rid, 1) - 1
        if left > 0:
            self._num_unfinished[rid] = left
        else:
            self._num_unfinished.pop(rid, None)
            self._queues.pop(rid, None)
        if self.on_finished is not None:
            try:
                self.on_finished(out)
            except Exception:  # a broken observer must not stop the loop that serves everyone
                logger.exception("on_finished failed for request %s", out.request_id)
