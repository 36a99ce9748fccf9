"""The collect half of a step: sampled tokens come home once, counted, in row order.

A readback is not a copy, it is a stop. CUDA launches are asynchronous, so the host queues
kernels and runs on; reading a value back ends that, because the number does not exist until
the kernels producing it have finished. The sampler therefore returns a ``[rows]`` int64 tensor
that stays on the forward's device, wrapped in a :class:`TokenBatch` together with the request
id that owns each row, and :class:`OutputProcessor` reads it home exactly once per step through
a :class:`Readback`, which turns every deliberate journey home into an integer the gates read.

The bill is per journey, not per byte (one step's tokens are 64 bytes at eight rows), so the
arithmetic here prices the count of journeys and ignores the payload.

Three groups of names:
  - the layer: ``Readback``, ``TokenBatch``, ``OutputProcessor``;
  - the arithmetic: ``STRATEGIES``, ``syncs_per_step``, ``overshoot_tokens``, ``readback_s``,
    ``saving_per_step``, ``strategy_speedup``, ``sample_ceiling``, ``measure_transfer_s``,
    ``SyncMeasurement`` and ``render``;
  - the gates, each raising its own ``ValueError`` subclass: ``check_single_transfer``,
    ``check_device_resident``, ``check_in_row_order``, ``check_measurable``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Readback:
    """Counts deliberate journeys of device values home.

    A synchronisation leaves nothing in a return value, and on a box with no accelerator it
    does not even show up as time, so the only honest way to know how many a step made is to
    count them where they happen.
    """

    journeys: int = 0  # .tolist() calls made through fetch: each one is a host stop on a GPU
    elements: int = 0  # values those journeys carried (reported, never priced: the cost is per trip)

    def fetch(self, tensor: torch.Tensor) -> list[int]:
        """Read ``tensor`` home with exactly one ``.tolist()`` and count the journey.

        Args:
            tensor: a ``[rows]`` integer tensor on any device.

        Returns:
            Its values as Python ints, in row order.
        """
        values = tensor.tolist()
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
    _token_ids: list[int] | None = field(default=None, init=False)  # the memo: None until resolved

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
            self._token_ids = self.readback.fetch(self.tokens) if self.request_ids else []
        return self._token_ids


class OutputProcessor:
    """Applies each step's :class:`TokenBatch` to its owners with one readback per step.

    ``num_steps`` counts the batches applied that carried at least one row; an empty batch
    makes no journey and is not a step here, so ``transfers_per_step`` reads 1.0 exactly for
    the synchronous loop whatever the scheduler did. The journeys are read from the shared
    :class:`Readback`, so a readback made anywhere else through it (a log line, a second
    resolve path) shows up in the rate, which is the point: :func:`check_single_transfer` reads
    the rate rather than inspecting code.

    Args:
        readback: the counter the engine's batches are built with; a fresh one if None.
    """

    __slots__ = ("readback", "num_steps")

    def __init__(self, readback: Readback | None = None) -> None:
        self.readback = readback if readback is not None else Readback()
        self.num_steps = 0  # batches applied that carried at least one row

    def apply(self, batch: TokenBatch, sink: Callable[[str, int], None]) -> None:
        """Resolve ``batch`` (one transfer) and hand each row's token to its owner, in row order.

        On the engine's hot path, once per step: no copies, no per-row checks.

        Args:
            batch: the step's tokens; must count on this processor's ``readback``.
            sink: called as ``sink(request_id, token_id)`` for every row, row 0 first.

        Raises:
            ValueError: if ``batch`` counts its journey on a different :class:`Readback`, which
                would leave this processor's rate reading 0 while the step still synced.
        """
        if batch.readback is not self.readback:
            raise ValueError(
                "batch counts its readback on a different Readback than this processor reads: "
                "build TokenBatch with processor.readback"
            )
        token_ids = batch.resolve()
        if not token_ids:
            return
        self.num_steps += 1
        for request_id, token_id in zip(batch.request_ids, token_ids, strict=True):
            sink(request_id, token_id)

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


