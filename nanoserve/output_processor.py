"""The output stage: one step's sampled tokens come home once, in row order, and become outputs.

A readback is not a copy, it is a stop. CUDA launches are asynchronous, so the host queues
kernels and runs on; reading a value back ends that, because the number does not exist until
the kernels producing it have finished. The sampler therefore returns a ``[rows]`` int64 tensor
that stays on the forward's device, wrapped in a :class:`TokenBatch` together with the request
id that owns each row. :class:`OutputProcessor` reads it home exactly once per step through a
:class:`Readback` (which counts every deliberate journey home), then does everything that needs
the token as a Python int: append it, apply stop ids, stop strings and ``min_tokens``,
detokenize, attach logprobs and build each :class:`RequestOutput`. It returns the outputs and
the requests that finished; it never calls back into the engine.

On a GPU the journey starts right after sampling (a non-blocking copy into pinned host memory
and an event) and collect waits only on that event, so with deferred output step N's tokens
travel while step N+1's kernels run. On a CPU there is nothing to overlap: the copy is a plain
``.tolist()`` at resolve time.

The sync-cost arithmetic and its gates are instruments: ``nanoserve.instruments.sync``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nanoserve.request import FinishReason, Request, RequestOutput

# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------


class HostCopy:
    """A device tensor on its way home. On CUDA: a non-blocking copy into pinned host memory,
    started at construction, and the event that marks its end; elsewhere the tensor itself
    (a CPU has no bus to cross, so there is nothing to start early)."""

    __slots__ = ("source", "host", "event")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.source = tensor
        self.host: torch.Tensor | None = None
        self.event: Any = None
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> torch.Tensor:
        """The values on the host: waits for the copy's event only, not for later kernels."""
        if self.event is None:
            return self.source
        self.event.synchronize()
        return self.host


@dataclass(slots=True)
class Readback:
    """Counts deliberate journeys of device values home.

    A synchronisation leaves nothing in a return value, and on a box with no accelerator it
    does not even show up as time, so the only honest way to know how many a step made is to
    count them where they happen.
    """

    journeys: int = 0  # .tolist() calls made through fetch: each one is a host stop on a GPU
    elements: int = 0  # values those journeys carried (reported, never priced: the cost is per trip)

    def fetch(self, tensor: torch.Tensor | HostCopy) -> list:
        """Read ``tensor`` home with exactly one ``.tolist()`` and count the journey.

        Args:
            tensor: a ``[rows]`` tensor on any device, or a :class:`HostCopy` of one already
                on its way (then only its copy is waited for).

        Returns:
            Its values as Python numbers, in row order.
        """
        values = (tensor.wait() if isinstance(tensor, HostCopy) else tensor).tolist()
        # Counted after the call so a failed transfer is not reported as one that happened.
        self.journeys += 1
        self.elements += len(values)
        return values

    def reset(self) -> None:
        """Zero both counters."""
        self.journeys = 0
        self.elements = 0


# eq=False: dataclass equality would compare tensors with ==, whose truth value is a readback.
@dataclass(slots=True, eq=False)
class TokenBatch:
    """One step's sampled tokens, still on the device, plus the request that owns each row.

    The ``[rows]`` tensor is anonymous, so the ids ride with it: once a resolve can be deferred
    across a step boundary, the scheduler may have released and admitted rows in between, and a
    shifted row order would hand one caller another caller's token with every length still
    agreeing. :func:`check_in_row_order` compares ``request_ids`` against the expected order.

    Building, passing and ``repr``-ing a batch never reads the tokens back; only
    :meth:`resolve` does, at most once however many callers ask.

    Raises:
        ValueError: if ``tokens`` is not a 1-D int64 tensor or its rows do not match
            ``request_ids``.
    """

    tokens: torch.Tensor  # [rows] int64 on the forward's device; sampled ids, not yet read back
    request_ids: tuple[str, ...]  # request_ids[i] owns tokens[i]: the row order the sampler saw
    readback: Readback  # counts the one journey resolve() makes
    # Rows that asked for logprobs, and per row [sampled, k values, k ids] on the device; None: no row asked.
    logprobs: tuple[list[int], torch.Tensor] | None = None
    _token_ids: list[int] | None = field(default=None, init=False)  # the memo: None until resolved
    _copies: tuple[HostCopy, HostCopy | None] | None = field(default=None, init=False)  # started at build

    def __post_init__(self) -> None:
        # Shape, dtype and dim are host-side metadata: reading them does not wait on the device.
        if not isinstance(self.tokens, torch.Tensor):
            raise ValueError(f"tokens is a {type(self.tokens).__name__}, must be a torch.Tensor")
        if self.tokens.dim() != 1 or self.tokens.dtype != torch.int64:
            raise ValueError(
                f"tokens has shape {tuple(self.tokens.shape)} and dtype {self.tokens.dtype}, "
                "must be [rows] torch.int64"
            )
        self.request_ids = tuple(self.request_ids)
        if self.tokens.shape[0] != len(self.request_ids):
            raise ValueError(
                f"tokens has {self.tokens.shape[0]} rows but request_ids has {len(self.request_ids)}: "
                "every row needs exactly one owner"
            )
        # The journey home starts now, right after sampling; resolve() waits for it.
        self._copies = (HostCopy(self.tokens), HostCopy(self.logprobs[1].flatten()) if self.logprobs else None)

    def __len__(self) -> int:
        return len(self.request_ids)

    def __repr__(self) -> str:
        # Never the values: printing a tensor calls .item() per element, so a log line would
        # cost a full round trip per row.
        return (
            f"TokenBatch(rows={len(self)}, device={self.tokens.device}, "
            f"request_ids={self.request_ids!r}, resolved={self.resolved})"
        )

    @property
    def resolved(self) -> bool:
        """True once the tokens have been read home."""
        return self._token_ids is not None

    def resolve(self) -> list[int]:
        """The tokens as Python ints, in row order, read home on the first call only.

        Memoised because a recomputing accessor is invisible: the values are identical every
        time and the only symptom is one more round trip per caller. The returned list is the
        cached one and is shared by every caller; do not mutate it.

        Returns:
            ``token_ids[i]`` is the token sampled for ``request_ids[i]``.
        """
        if self._token_ids is None:
            # An empty batch has nothing to wait for, so it makes no journey.
            self._token_ids = self.readback.fetch(self._copies[0]) if self.request_ids else []
        return self._token_ids

    def resolve_logprobs(self) -> dict[int, dict[int, float]]:
        """row -> {token id: logprob} for the sampled token and the top k of each row that asked
        (one more journey home, counted); {} when no row asked."""
        if self.logprobs is None:
            return {}
        rows, packed = self.logprobs
        values = self.readback.fetch(self._copies[1])
        width = packed.shape[1]
        k = (width - 1) // 2
        token_ids = self.resolve()
        entries = {}
        for n, row in enumerate(rows):
            chunk = values[n * width:(n + 1) * width]
            entry = {int(i): v for i, v in zip(chunk[1 + k:], chunk[1:1 + k], strict=True)}
            entry[token_ids[row]] = chunk[0]
            entries[row] = entry
        return entries


@dataclass
class StepOutputs:
    """What one step's tokens did, in row order."""

    outputs: list[RequestOutput]  # one per row whose request was still live
    finished: list[Request]  # requests this step finished: the engine releases their blocks


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

    def process(self, batch: TokenBatch, requests: Sequence[Request]) -> StepOutputs:
        """Resolves ``batch`` (one transfer) and applies row i's token to ``requests[i]``.

        A request already finished (stopped or aborted after its token was launched, in the
        deferred loop) gets nothing: its token is overshoot and is dropped. Each live request
        appends its token, which applies stop token ids, ``min_tokens`` and ``max_tokens``; then
        its text grows, stop strings are searched in the new text, logprobs are attached.

        Args:
            batch: the step's tokens; must count on this processor's ``readback``.
            requests: the requests that own the rows, row 0 first.

        Raises:
            ValueError: if ``batch`` counts its journey on a different :class:`Readback`, which
                would leave this processor's rate reading 0 while the step still synced.
            RowOrderMismatch: if the batch's rows are not owned by ``requests`` in that order.
        """
        if batch.readback is not self.readback:
            raise ValueError(
                "batch counts its readback on a different Readback than this processor reads: "
                "build TokenBatch with processor.readback"
            )
        check_in_row_order(batch, tuple(r.request_id for r in requests))
        token_ids = batch.resolve()
        if not token_ids:
            return StepOutputs([], [])
        self.num_steps += 1
        now = time.perf_counter()  # the tokens of one step arrive together, after its one readback
        logprobs = batch.resolve_logprobs()
        outputs: list[RequestOutput] = []
        finished: list[Request] = []
        for row, (request, token_id) in enumerate(zip(requests, token_ids, strict=True)):
            if request.is_finished:
                continue
            if request.num_pending_tokens:
                request.num_pending_tokens -= 1
            done = request.append_token(token_id, now)
            if request.detokenizer is not None:
                request.detokenizer.add((token_id,))
            if row in logprobs:
                want = request.params.logprobs
                entry = logprobs[row]
                sampled = {token_id: entry[token_id]}
                request.logprobs.append(dict(list(entry.items())[:want]) | sampled)
            if not done and request.params.stop and request.num_output_tokens >= request.params.min_tokens:
                done = check_stop_strings(request, now)
            if done:
                finished.append(request)
            outputs.append(make_output(request))
        return StepOutputs(outputs, finished)

    @property
    def transfers_per_step(self) -> float:
        """Journeys home per applied step; 0.0 before any step."""
        return self.readback.journeys / self.num_steps if self.num_steps else 0.0

    def reset(self) -> None:
        """Zero the step count and the readback counters."""
        self.num_steps = 0
        self.readback.reset()



class RowOrderMismatch(ValueError):
    """A batch's rows are not owned by the requests, in the order, the caller expects."""



def check_in_row_order(batch: TokenBatch, expected_request_ids: Sequence[str]) -> None:
    """Refuse a batch whose rows are not owned by ``expected_request_ids``, in that order.

    The guard for deferring a resolve across a step boundary: a shifted order hands one caller
    another's token and no length check fires. A tuple comparison per step.

    Args:
        batch: the batch about to be applied.
        expected_request_ids: the owners, row 0 first, as the caller believes them.

    Raises:
        RowOrderMismatch: naming the first row that differs, or the two lengths.
    """
    expected = tuple(expected_request_ids)
    if batch.request_ids == expected:
        return
    if len(batch.request_ids) != len(expected):
        raise RowOrderMismatch(f"batch has {len(batch.request_ids)} rows, expected {len(expected)}")
    row = next(i for i, (a, b) in enumerate(zip(batch.request_ids, expected, strict=True)) if a != b)
    raise RowOrderMismatch(
        f"row {row} belongs to request {batch.request_ids[row]!r}, expected {expected[row]!r}: "
        "applying it would hand one request another's token"
    )


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
    """The caller's view of a request now: its tokens, text, stamps and logprobs so far."""
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
        token_ids=request.output_token_ids,
        text=text,
        finished=request.is_finished,
        finish_reason=request.finish_reason.value if request.finish_reason else None,
        arrival_time=request.arrival_time,
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
        finished_time=request.finished_time,
        token_times=list(request.token_times),
        running_s=request.running_s,
        num_preemptions=request.num_preemptions,
        num_cached_tokens=request.num_cached_tokens,
        stop_reason=request.stop_reason,
        logprobs=list(request.logprobs) if request.logprobs is not None else None,
        parent_id=request.parent_id,
        index=request.index,
    )
