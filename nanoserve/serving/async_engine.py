"""AsyncEngine: the front a server needs. Any number of coroutines submit at once, and one
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
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import TYPE_CHECKING

from nanoserve.params import SamplingParams
from nanoserve.request import RequestOutput
from nanoserve.serving.streaming import DeltaMaker, StreamDelta, group_of

if TYPE_CHECKING:
    from nanoserve.engine import Engine, EngineStats

logger = logging.getLogger(__name__)


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
        self._makers = [DeltaMaker(params) for _ in range(params.n)]
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
                for out in self.engine.abort(rid) if self.engine.is_unfinished(rid) else []:
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
            first = rid if params.n == 1 else f"{rid}.0"  # an n > 1 group's copies are rid.0 .. rid.{n-1}
            return list(self.engine.requests[first].prompt_token_ids)

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
            outputs = [out for rid in aborts if self.engine.is_unfinished(rid) for out in self.engine.abort(rid)]
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
                queue = self._queues.get(group_of(out))
                if queue is not None:
                    queue.put_nowait(out)
                if out.finished:
                    self._finish(out)

    def _finish(self, out: RequestOutput) -> None:
        rid = group_of(out)
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
