"""Measuring one readback journey, and the gates that refuse a sync number this machine cannot
honestly produce, each raising its own ``ValueError`` subclass: ``check_single_transfer``,
``check_device_resident`` and ``check_measurable`` (``check_in_row_order`` lives with the batch it
checks, in ``nanoserve.readback``). The arithmetic they guard is ``nanoserve.instruments.sync``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from nanoserve.output_processor import OutputProcessor

# Below this a per-journey cost is not something a per-step wall clock can resolve: it is the
# size of one Python call, and the step-to-step jitter on a shared box is larger.
MIN_MEASURABLE_S = 1e-6


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


class NotSingleTransfer(ValueError):
    """The synchronous loop read back more (or fewer) than once per step."""


class NotDeviceResident(ValueError):
    """The sampler's output already came home, or is not a [rows] int64 tensor on the device."""


class NotMeasurable(ValueError):
    """A sync saving was asked to be priced from a machine that cannot see it."""


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
