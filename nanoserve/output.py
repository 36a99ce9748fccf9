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

import math
import statistics
import time
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


# ---------------------------------------------------------------------------------------------
# The arithmetic
# ---------------------------------------------------------------------------------------------

# per_row:    Day 40's sampler. One int(tensor) per sampled (non-greedy) row, plus one .tolist()
#             for the greedy rows, which were already a single batched argmax.
# one_tensor: Day 47. The sampler returns [rows] on the device; collect reads it home once.
# deferred:   Day 48's plan (arithmetic only, the engine does not do it yet). Step N's tokens are
#             resolved after step N+1 has been launched, so the device always has work queued
#             while the host waits: no blocking synchronisation is left on the critical path.
STRATEGIES = ("per_row", "one_tensor", "deferred")


def _check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {STRATEGIES}")


def syncs_per_step(rows: int, strategy: str, window: int = 1, *, num_greedy: int = 0) -> float:
    """Blocking synchronisations one step makes on the critical path.

    A blocking sync is a readback that leaves the device with nothing queued while the host
    waits; it is what makes the step ``overhead + device`` instead of ``max(overhead, device)``.

    - ``per_row``: one per sampled row plus one for the greedy group if there is one, so
      eight top-p rows are 8, eight greedy rows are 1, and eight top-p rows beside greedy ones
      are 9 (the seed's "nine times a step").
    - ``one_tensor``: 1 whenever any row was sampled.
    - ``deferred``: 0. With ``window=k`` step N is resolved while steps N+1 .. N+k are already
      in flight, so the wait never idles the device. The journey still happens (Readback still
      counts one a step), it is just off the critical path; it assumes the device-to-host copy
      is issued on a side stream, since a plain ``.tolist()`` would queue behind step N+1. The
      price is paid in tokens, not syncs: see :func:`overshoot_tokens`.

    Args:
        rows: rows sampled this step (>= 0); a step that sampled nothing reads nothing back.
        strategy: one of :data:`STRATEGIES`.
        window: steps in flight ahead of the resolve (>= 1); only ``deferred`` uses it.
        num_greedy: how many of ``rows`` are greedy (0 .. rows); only ``per_row`` uses it.

    Returns:
        Blocking synchronisations per step.

    Raises:
        ValueError: for an unknown strategy or a count outside its range.
    """
    _check_strategy(strategy)
    if rows < 0:
        raise ValueError(f"rows={rows} must be >= 0")
    if not 0 <= num_greedy <= rows:
        raise ValueError(f"num_greedy={num_greedy} must be in [0, rows={rows}]")
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    if rows == 0 or strategy == "deferred":
        return 0.0
    if strategy == "one_tensor":
        return 1.0
    return float(rows - num_greedy + (1 if num_greedy else 0))


def overshoot_tokens(strategy: str, window: int = 1) -> int:
    """Tokens a request may generate past its stop condition before the host sees the stop.

    A stop rule needs a Python int, so a request whose tokens come home ``window`` steps late
    runs ``window`` steps too many; those tokens are computed and discarded.

    Args:
        strategy: one of :data:`STRATEGIES`.
        window: steps in flight ahead of the resolve (>= 1).

    Returns:
        ``window`` for ``deferred``, 0 for the synchronous strategies.

    Raises:
        ValueError: for an unknown strategy or ``window`` < 1.
    """
    _check_strategy(strategy)
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    return window if strategy == "deferred" else 0


def readback_s(syncs: float, per_transfer_s: float) -> float:
    """Seconds a step spends stopped on readbacks: the count times the fixed cost of one.

    The payload is ignored on purpose: a step's tokens are tens of bytes on a bus that moves
    gigabytes a second, so essentially all of the cost is the per-journey part.

    Args:
        syncs: blocking synchronisations per step (>= 0), e.g. from :func:`syncs_per_step`.
        per_transfer_s: seconds one journey costs (>= 0), e.g. from :func:`measure_transfer_s`.

    Returns:
        ``syncs * per_transfer_s``.

    Raises:
        ValueError: if either is negative or not finite.
    """
    if not (math.isfinite(syncs) and syncs >= 0):
        raise ValueError(f"syncs={syncs} must be finite and >= 0")
    if not (math.isfinite(per_transfer_s) and per_transfer_s >= 0):
        raise ValueError(f"per_transfer_s={per_transfer_s} must be finite and >= 0")
    return syncs * per_transfer_s


def saving_per_step(
    rows: int,
    per_transfer_s: float,
    *,
    num_greedy: int = 0,
    before: str = "per_row",
    after: str = "one_tensor",
    window: int = 1,
) -> float:
    """Synchronisation seconds per step saved by moving from ``before`` to ``after``.

    Only the sync saving. The Python saving of the same change (on the greedy path, deleting a
    ``[rows, vocab]`` gather) is a different quantity, measured rather than derived, and is
    never added in here. That is why the greedy path returns 0.0 from per_row to one_tensor:
    greedy rows were already one batched ``.tolist()``, so 1 sync became 1 sync.

    Args:
        rows: rows sampled per step.
        per_transfer_s: seconds one journey costs.
        num_greedy: how many of ``rows`` are greedy.
        before: the strategy being replaced.
        after: the strategy replacing it.
        window: the deferred window, for either side.

    Returns:
        ``readback_s(before) - readback_s(after)``; negative if ``after`` syncs more.
    """
    syncs_before = syncs_per_step(rows, before, window, num_greedy=num_greedy)
    syncs_after = syncs_per_step(rows, after, window, num_greedy=num_greedy)
    return readback_s(syncs_before, per_transfer_s) - readback_s(syncs_after, per_transfer_s)


def strategy_speedup(
    step_s: float,
    rows: int,
    per_transfer_s: float,
    *,
    num_greedy: int = 0,
    before: str = "per_row",
    after: str = "one_tensor",
    window: int = 1,
) -> float:
    """Step speedup from the sync saving alone: ``step_s / (step_s - saving)``.

    Args:
        step_s: the measured step time under ``before`` (> 0).
        rows, per_transfer_s, num_greedy, before, after, window: as :func:`saving_per_step`.

    Returns:
        The speedup factor; 1.0 when nothing is saved.

    Raises:
        ValueError: if ``step_s`` is not positive, or is shorter than the readbacks it is said
            to contain (the step cannot have paid for syncs it had no time for).
    """
    if not step_s > 0:
        raise ValueError(f"step_s={step_s} must be > 0")
    syncs_before = syncs_per_step(rows, before, window, num_greedy=num_greedy)
    spent_s = readback_s(syncs_before, per_transfer_s)
    if spent_s >= step_s:
        raise ValueError(
            f"step_s={step_s} must exceed the {syncs_before:g} readbacks it contains "
            f"({spent_s}s at per_transfer_s={per_transfer_s})"
        )
    saving = saving_per_step(
        rows, per_transfer_s, num_greedy=num_greedy, before=before, after=after, window=window
    )
    return step_s / (step_s - saving)


def sample_ceiling(step_s: float, sample_s: float) -> float:
    """The most a step can speed up by making the sample phase free (the profiler's
    ``speedup_if(profile, eliminate=("sample",))`` for one phase, as two floats).

    Amdahl with the phase removed outright: whatever sampling becomes, the step cannot get
    faster than ``step_s - sample_s``.

    Args:
        step_s: seconds per step (> 0); a whole step, or just its host loop.
        sample_s: seconds of it in the sample phase, in ``[0, step_s)``.

    Returns:
        ``step_s / (step_s - sample_s)``.

    Raises:
        ValueError: if ``step_s`` is not positive or ``sample_s`` is outside ``[0, step_s)``;
            a phase as long as the whole step is a missing measurement, not an infinite ceiling.
    """
    if not step_s > 0:
        raise ValueError(f"step_s={step_s} must be > 0")
    if not 0 <= sample_s < step_s:
        raise ValueError(f"sample_s={sample_s} must be in [0, step_s={step_s})")
    return step_s / (step_s - sample_s)


def measure_transfer_s(
    device: str | torch.device,
    n: int = 25,
    *,
    rows: int = 8,
    warmup: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median seconds of one ``[rows]`` int64 ``.tolist()`` round trip on ``device``.

    The tensor is ready before the clock starts, so this is the fixed cost of a journey (copy
    setup, the wait, the conversion) with no compute to wait for. On a CPU there is no bus to
    cross and it comes out near a microsecond; :func:`check_measurable` refuses to price that.

    Args:
        device: where the tensor lives.
        n: timed round trips (>= 1); the median is returned.
        rows: elements per round trip (>= 1).
        warmup: untimed round trips first (>= 0), for context creation and allocator growth.
        clock: seconds as a float; injectable so the median can be tested exactly.

    Returns:
        The median seconds per round trip.

    Raises:
        ValueError: if ``n`` or ``rows`` < 1 or ``warmup`` < 0.
    """
    if n < 1 or rows < 1 or warmup < 0:
        raise ValueError(f"n={n} and rows={rows} must be >= 1, warmup={warmup} must be >= 0")
    device = torch.device(device)
    tokens = torch.arange(rows, dtype=torch.int64, device=device)
    for _ in range(warmup):
        tokens.tolist()
    if device.type == "cuda":
        # The arange must be finished, or the first timed trip also waits for it.
        torch.cuda.synchronize(device)
    times = []
    for _ in range(n):
        start = clock()
        tokens.tolist()
        times.append(clock() - start)
    return statistics.median(times)


@dataclass(frozen=True)
class SyncMeasurement:
    """The sample phase timed both ways over one logits tensor: one row of syncbench."""

    slots: int  # rows sampled
    params: str  # what the rows sampled with: "greedy", "top-p", ...
    per_row_s: float  # median sample-phase seconds with the per-row readback
    one_tensor_s: float  # median sample-phase seconds with one [rows] readback
    syncs_before: int  # readbacks per step under per_row
    syncs_after: int  # readbacks per step under one_tensor

    def __post_init__(self) -> None:
        if not (self.per_row_s > 0 and self.one_tensor_s > 0):
            raise ValueError(
                f"per_row_s={self.per_row_s} and one_tensor_s={self.one_tensor_s} must both be > 0"
            )

    @property
    def speedup(self) -> float:
        """How many times faster the one-tensor sample phase is."""
        return self.per_row_s / self.one_tensor_s


_HEADER = "slots   params      per row    one tensor    faster    syncs before/after"


def render(measurements: Sequence[SyncMeasurement]) -> str:
    """The syncbench table: one line per measurement under a header, times in ms.

    Args:
        measurements: rows in the order they should print.

    Returns:
        The table, newline-joined, no trailing newline.
    """
    lines = [_HEADER]
    for m in measurements:
        lines.append(
            f"{m.slots:>3}     {m.params:<6}{m.per_row_s * 1e3:>10.3f}ms{m.one_tensor_s * 1e3:>12.3f}ms"
            f"{m.speedup:>10.2f}x{m.syncs_before:>12} / {m.syncs_after}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The gates: each refuses a believable number that would mean nothing
# ---------------------------------------------------------------------------------------------


class NotSingleTransfer(ValueError):
    """The synchronous loop read back more (or fewer) than once per step."""


class NotDeviceResident(ValueError):
    """The sampler's output already came home, or is not a [rows] int64 tensor on the device."""


class RowOrderMismatch(ValueError):
    """A batch's rows are not owned by the requests, in the order, the caller expects."""


class NotMeasurable(ValueError):
    """A sync saving was asked to be priced from a machine that cannot see it."""


# Below this a per-journey cost is not something a per-step wall clock can resolve: it is the
# size of one Python call, and the step-to-step jitter on a shared box is larger.
MIN_MEASURABLE_S = 1e-6


def check_single_transfer(source: OutputProcessor | float) -> None:
    """Refuse a synchronous loop that does not read back exactly once per step.

    Reads a rate rather than inspecting code, which is the only form of this check that
    survives a future commit (a log line that calls an accessor, a second resolve path).

    Args:
        source: an :class:`OutputProcessor` after some steps, or its ``transfers_per_step``.

    Raises:
        NotSingleTransfer: if the rate is not exactly 1.0, including before any step.
    """
    if isinstance(source, OutputProcessor):
        if source.num_steps == 0:
            raise NotSingleTransfer("transfers_per_step is undefined: the processor has applied 0 steps")
        rate = source.transfers_per_step
        detail = f" ({source.readback.journeys} journeys over {source.num_steps} steps)"
    else:
        rate, detail = float(source), ""
    if rate != 1.0:
        raise NotSingleTransfer(
            f"transfers_per_step={rate}{detail} must be exactly 1.0 for the synchronous loop"
        )


def check_device_resident(tensor: object, device: str | torch.device) -> None:
    """Refuse sampler output that is not a ``[rows]`` int64 tensor on the forward's device.

    Args:
        tensor: what the sampler returned.
        device: the device the forward ran on; ``"cuda"`` accepts any CUDA index.

    Raises:
        NotDeviceResident: for a list (it has already been read back), another device, another
            dtype or another shape.
    """
    if not isinstance(tensor, torch.Tensor):
        raise NotDeviceResident(
            f"sampler output is a {type(tensor).__name__}, must be a torch.Tensor: "
            "anything else has already been read back"
        )
    expected = torch.device(device)
    actual = tensor.device
    # An index only disagrees when both sides name one: "cuda" means any card, and a CPU
    # tensor's device carries no index even when the forward's is written "cpu:0".
    indices_differ = None not in (expected.index, actual.index) and expected.index != actual.index
    if actual.type != expected.type or indices_differ:
        raise NotDeviceResident(
            f"sampler output is on {actual}, must stay on the forward's device {expected}"
        )
    if tensor.dtype != torch.int64:
        raise NotDeviceResident(f"sampler output has dtype {tensor.dtype}, must be torch.int64")
    if tensor.dim() != 1:
        raise NotDeviceResident(f"sampler output has shape {tuple(tensor.shape)}, must be 1-D [rows]")


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


def check_measurable(
    per_transfer_s: float, device: str | torch.device, *, resolution_s: float = MIN_MEASURABLE_S
) -> None:
    """Refuse to price a synchronisation saving from a machine that cannot see one.

    On a CPU there is no bus to cross and no asynchronous queue to drain, so removing a sync
    saves nothing there; reporting that nothing as the result would be true and would be a lie
    about a different machine.

    Args:
        per_transfer_s: the measured cost of one journey (>= 0).
        device: where the tokens live.
        resolution_s: the smallest per-journey cost a step's clock resolves.

    Raises:
        NotMeasurable: if ``device`` is a CPU or ``per_transfer_s`` is below ``resolution_s``.
        ValueError: if ``per_transfer_s`` is negative or not finite.
    """
    if not (math.isfinite(per_transfer_s) and per_transfer_s >= 0):
        raise ValueError(f"per_transfer_s={per_transfer_s} must be finite and >= 0")
    device = torch.device(device)
    if device.type == "cpu":
        raise NotMeasurable(
            f"device={device} has no bus between host and device: per_transfer_s={per_transfer_s} "
            "is not the cost a GPU would pay, and a sync saving cannot be priced from it"
        )
    if per_transfer_s < resolution_s:
        raise NotMeasurable(
            f"per_transfer_s={per_transfer_s} is below the measurable resolution_s={resolution_s}"
        )
