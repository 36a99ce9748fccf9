"""What a readback costs: the sync arithmetic of the collect phase and the gates that refuse a
number this machine cannot honestly produce.

The bill is per journey, not per byte (one step's tokens are 64 bytes at eight rows), so the
arithmetic here prices the count of journeys and ignores the payload.

  - the arithmetic: ``STRATEGIES``, ``syncs_per_step``, ``overshoot_tokens``, ``readback_s``,
    ``saving_per_step``, ``strategy_speedup``, ``sample_ceiling``, ``measure_transfer_s``,
    ``SyncMeasurement`` and ``render``;
  - the gates, each raising its own ``ValueError`` subclass: ``check_single_transfer``,
    ``check_device_resident``, ``check_measurable`` (``check_in_row_order`` lives with the batch
    it checks, in ``nanoserve.output_processor``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from nanoserve.output_processor import OutputProcessor

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

