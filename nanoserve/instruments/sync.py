"""What a readback costs: the sync arithmetic of the collect phase, and syncbench's record and table.

The bill is per journey, not per byte (one step's tokens are 64 bytes at eight rows), so the
arithmetic here prices the count of journeys and ignores the payload: ``syncs_per_step``,
``overshoot_tokens``, ``readback_s``, ``saving_per_step``, ``strategy_speedup`` and
``sample_ceiling``; ``SyncMeasurement`` and ``render`` are syncbench's row and table. Measuring a
journey and the gates that refuse a number this machine cannot honestly produce are in
``nanoserve.instruments.sync_gates``. Nothing here needs torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# per_row:    the per-row sampler: one int(tensor) per sampled (non-greedy) row, plus one .tolist()
#             for the greedy rows, which were already a single batched argmax.
# one_tensor: the sampler returns [rows] on the device; collect reads it home once a step.
# deferred:   EngineConfig.deferred_output: step N's tokens are resolved after step N+1 has been
#             launched, so the device always has work queued while the host waits and no blocking
#             synchronisation is left on the critical path.
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
