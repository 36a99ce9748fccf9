"""AsyncEngine: the front a server needs. Any number of coroutines submit at once, and one
background loop steps the engine. The step is blocking (a forward pass), so it runs in a worker
thread; a lock makes sure an add or an abort never lands in the middle of one. Each request's
outputs reach its consumer through its own asyncio queue, and a consumer that stops (cancelled,
or its iterator closed) aborts its request so the blocks go back to the pool. An embedding request
(`embed`) has no stream: its one final output is awaited, and a cancelled wait aborts it.

A step that raises fails the requests of that step (`Engine.fail_step`): their consumers get a
StepFailedError and the loop goes on with the others. Where the engine's state cannot be
restored (a fault in schedule, a device error, a tensor-parallel group broken by a worker or by
a fault in rank 0's forward, a pool that fails its invariant check) the front
is dead: every consumer gets an EngineDeadError and so does every later submission.
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

from nanoserve.params import PoolingParams, SamplingParams
from nanoserve.request import RequestOutput
from nanoserve.serving.streaming import DeltaMaker, StreamDelta, group_of

if TYPE_CHECKING:
    from nanoserve.engine import Engine, EngineStats

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """A step raised and the engine's state could not be restored; the front serves no more."""


class StepFailedError(RuntimeError):
    """The step serving this request raised; the request was aborted and the engine goes on."""


class QueueFullError(RuntimeError):
    """`max_waiting` requests are already waiting for a slot."""


class DrainingError(RuntimeError):
    """The front is draining (shutting down): it takes no new request."""


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
                if isinstance(item, StepFailedError):
                    raise item
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
    server counts its metrics there); `on_step_fault` with the exception of every step that raised.
    With `max_waiting`, an add finding that many requests already waiting for a slot is refused
    (QueueFullError) instead of queued.
    """

    def __init__(self, engine: Engine, on_finished: Callable[[RequestOutput], None] | None = None,
                 max_waiting: int | None = None,
                 on_step_fault: Callable[[Exception], None] | None = None) -> None:
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting} must be None (no bound) or >= 1")
        self.engine = engine
        self.on_finished = on_finished
        self.on_step_fault = on_step_fault
        self.max_waiting = max_waiting
        self._lock = threading.Lock()  # held by every engine mutation: add, abort, step
        self._queues: dict[str, asyncio.Queue] = {}  # unfinished requests' output queues
        self._num_unfinished: dict[str, int] = {}  # completions still running per request (n > 1)
        self._pending_aborts: list[str] = []  # applied by the loop before its next step
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoserve-step")
        self.error: BaseException | None = None  # set when a step raised; the engine is dead
        self._closed = False  # shutdown() ran
        self.is_draining = False  # drain() ran: no new request is taken

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done() and self.error is None

    async def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                          request_id: str | None = None) -> RequestStream:
        """Validates and queues one request; returns the stream of its deltas.

        Raises:
            ValueError: whatever `Engine.add_request` rejects.
            EngineDeadError: the loop has failed.
            DrainingError: drain() or shutdown() ran.
            QueueFullError: `max_waiting` requests are already waiting.
        """
        params = params or SamplingParams()
        rid, queue, prompt_ids = await self._submit(prompt, params, request_id)
        return RequestStream(self, rid, prompt_ids, params, queue)

    async def embed(self, prompt: str | Sequence[int], pooling: PoolingParams,
                    request_id: str | None = None) -> RequestOutput:
        """Queues one embedding request and waits for its final output (`embedding` the vector, or
        None when it was aborted); cancelled while it waits, it aborts the request.

        Raises:
            as add_request does, and StepFailedError when the step serving it raised.
        """
        rid, queue, _ = await self._submit(prompt, pooling, request_id)
        done = False
        try:
            item = await queue.get()
            done = True
            if isinstance(item, StepFailedError):
                raise item
            if isinstance(item, BaseException):
                raise EngineDeadError(f"the engine loop failed: {item!r}") from item
            return item
        finally:
            if not done:
                self._schedule_abort(rid)

    async def _submit(self, prompt: str | Sequence[int], params: SamplingParams | PoolingParams,
                      request_id: str | None) -> tuple[str, asyncio.Queue, list[int]]:
        """Adds one request through the lock: (its id, the queue its outputs arrive on, its prompt ids)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine loop failed: {self.error!r}")
        if self._closed or self.is_draining:
            raise DrainingError("the server is shutting down and takes no new request")
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if rid in self._queues:
            raise ValueError(f"request_id {rid!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue  # before the add: the first output may follow at once
        self._num_unfinished[rid] = params.n if isinstance(params, SamplingParams) else 1
        try:
            prompt_ids = await asyncio.to_thread(self._add_locked, prompt, params, rid)
        except BaseException as e:
            self._queues.pop(rid, None)
            self._num_unfinished.pop(rid, None)
            if not isinstance(e, ValueError | QueueFullError):  # cancelled while the add ran: it may have landed
                self._schedule_abort(rid)
            raise
        self._ensure_loop()
        self._wakeup.set()
        return rid, queue, prompt_ids

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

    def drain(self) -> None:
        """Takes no new request from now on; those already taken run to their end. Never blocks
        (a signal handler calls it)."""
        self.is_draining = True

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
        sampling = isinstance(params, SamplingParams)
        if sampling and params.structured_outputs is not None:  # compiled here, outside the step lock: the add then hits the cache
            self.engine.grammars.compile(params.structured_outputs)
        with self._lock:  # between two steps: the waiting count is exact
            if self.max_waiting is not None and (num := self.engine.stats().num_waiting) >= self.max_waiting:
                raise QueueFullError(f"{num} requests are waiting for a slot, the most this server queues "
                                     f"(max_waiting={self.max_waiting})")
            self.engine.add_request(prompt, params, request_id=rid)
            first = rid if not sampling or params.n == 1 else f"{rid}.0"  # an n > 1 group's copies are rid.0 .. rid.{n-1}
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

    def _step_locked(self, aborts: list[str]) -> tuple[list[RequestOutput], list[RequestOutput], Exception | None]:
        """Applies the pending aborts and runs one step: (outputs, the failed step's outputs, its
        error). Raises what `Engine.fail_step` raises when the state cannot be restored."""
        with self._lock:
            outputs = [out for rid in aborts if self.engine.is_unfinished(rid) for out in self.engine.abort(rid)]
            if not self.engine.has_unfinished():
                return outputs, [], None
            try:
                return outputs + self.engine.step(), [], None
            except Exception as e:
                return outputs, self.engine.fail_step(e), e

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending_aborts and not self.engine.has_unfinished():
                self._wakeup.clear()  # nothing to do: sleep until an add or an abort sets it
                await self._wakeup.wait()
                continue
            aborts, self._pending_aborts = self._pending_aborts, []
            try:
                outputs, failed, fault = await loop.run_in_executor(self._executor, self._step_locked, aborts)
            except Exception as e:  # a step fault the engine could not recover from: stop serving
                logger.exception("the engine loop failed; every request fails and /health turns 503")
                self.error = e
                for queue in self._queues.values():
                    queue.put_nowait(e)
                self._queues.clear()
                self._num_unfinished.clear()
                return
            self._deliver(outputs)
            if fault is not None:
                self._fail(fault, failed)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(group_of(out))
            if queue is not None:
                queue.put_nowait(out)
            if out.finished:
                self._finish(out)

    def _fail(self, fault: Exception, outputs: list[RequestOutput]) -> None:
        """A failed step's requests: those it had finished before the fault are delivered as usual,
        every group it aborted gets a StepFailedError instead of its final output."""
        aborted = [out for out in outputs if out.finish_reason == "abort"]
        logger.error("a step failed; its %d request(s) get an error, the engine goes on: %r",
                     len({group_of(out) for out in aborted}), fault, exc_info=fault)
        self._deliver([out for out in outputs if out.finish_reason != "abort"])
        for rid in dict.fromkeys(group_of(out) for out in aborted):
            self._num_unfinished.pop(rid, None)
            queue = self._queues.pop(rid, None)
            if queue is not None:
                queue.put_nowait(StepFailedError(f"the engine step serving this request failed: {fault!r}"))
        for out in aborted:
            self._finish(out)  # the queue is gone: this only reports it to on_finished
        if self.on_step_fault is not None:
            try:
                self.on_step_fault(fault)
            except Exception:
                logger.exception("on_step_fault failed")

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
