"""How device values come home: a :class:`TokenBatch` of sampled tokens resolves at most once,
through a :class:`Readback` that counts every journey, by a :class:`HostCopy` started right after
sampling.

A readback is not a copy, it is a stop. CUDA launches are asynchronous, so the host queues
kernels and runs on; reading a value back ends that, because the number does not exist until
the kernels producing it have finished. The sampler therefore returns a ``[rows]`` int64 tensor
that stays on the forward's device, wrapped in a TokenBatch together with the request id that
owns each row. On a GPU its journey starts at once (a non-blocking copy into pinned host memory
and an event) and the output stage waits only on that event, so with deferred output step N's
tokens travel while step N+1's kernels run. On a CPU there is nothing to overlap: the copy is a
plain ``.tolist()`` at resolve time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


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
    # Prompt logprobs (SamplingParams.prompt_logprobs): each scored run's (request, first position,
    # count) and per row [the next prompt token's, k values, k ids] on the device; None: no run.
    prompt_logprobs: tuple[list[tuple[Any, int, int]], torch.Tensor] | None = None
    # Embedding requests (PoolingParams): each scheduled one's (request, rows pooled, whether its
    # prompt is done) and per request the sum of its pooled rows [N, E] float32 on the device; None: none.
    pooled: tuple[list[tuple[Any, int, bool]], torch.Tensor] | None = None
    _token_ids: list[int] | None = field(default=None, init=False)  # the memo: None until resolved
    _copies: tuple[HostCopy | None, ...] | None = field(default=None, init=False)  # started at build

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
        self._copies = (HostCopy(self.tokens), HostCopy(self.logprobs[1].flatten()) if self.logprobs else None,
                        HostCopy(self.prompt_logprobs[1].flatten()) if self.prompt_logprobs else None,
                        HostCopy(self.pooled[1].flatten()) if self.pooled else None)

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

    def resolve_prompt_logprobs(self) -> list[tuple[Any, int, dict[int, float]]]:
        """(request, prompt position p, {token id: logprob}) for each scored row: prompt token p's
        own logprob and its request's top k at that position (one more journey home, counted); []
        when no run was scored."""
        if self.prompt_logprobs is None:
            return []
        scored, packed = self.prompt_logprobs
        values = self.readback.fetch(self._copies[2])
        width = packed.shape[1]
        k = (width - 1) // 2
        entries, row = [], 0
        for request, first, count in scored:
            own_k = request.params.prompt_logprobs
            for p in range(first, first + count):
                chunk = values[row * width:(row + 1) * width]
                top = {int(i): v for i, v in zip(chunk[1 + k:1 + k + own_k], chunk[1:1 + own_k], strict=True)}
                entries.append((request, p + 1, top | {request.prompt_token_ids[p + 1]: chunk[0]}))
                row += 1
        return entries

    def resolve_pooled(self) -> list[tuple[Any, int, bool, list[float]]]:
        """(request, rows pooled, prompt done, the rows' sum [E]) for each embedding request of the
        step (one more journey home, counted); [] when there was none."""
        if self.pooled is None:
            return []
        runs, sums = self.pooled
        values = self.readback.fetch(self._copies[3])
        width = sums.shape[1]
        return [(request, count, done, values[n * width:(n + 1) * width])
                for n, (request, count, done) in enumerate(runs)]


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
