"""nanoserve.instruments.sync_gates: measuring one journey (on a clock the test scripts), and each gate
refusing the number it names; on a GPU, the transfer is measurable and the batch stays resident."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import process_batch
from test_output_processor import _batch

from nanoserve.instruments.sync_gates import (
    MIN_MEASURABLE_S,
    NotDeviceResident,
    NotMeasurable,
    NotSingleTransfer,
    check_device_resident,
    check_measurable,
    check_single_transfer,
    measure_transfer_s,
)
from nanoserve.output_processor import OutputProcessor
from nanoserve.readback import TokenBatch


def _fake_clock(readings: list[float]):
    it = iter(readings)
    return lambda: next(it)


def test_measure_transfer_s_is_the_median_round_trip():
    # round trips of 7, 1 and 2 s: median 2 (the mean would be 10/3, one outlier dragging it).
    assert measure_transfer_s("cpu", n=3, warmup=0, clock=_fake_clock([0, 7, 10, 11, 20, 22])) == 2.0
    # 1, 9, 2, 3: median of an even count is the mean of the middle two, 2.5 (the mean is 3.75).
    clock = _fake_clock([0, 1, 10, 19, 20, 22, 30, 33])
    assert measure_transfer_s("cpu", n=4, warmup=0, clock=clock) == 2.5


def test_measure_transfer_s_makes_warmup_plus_n_round_trips(counted_tolist):
    measure_transfer_s("cpu", n=5, warmup=2, rows=4)
    assert counted_tolist["tolist"] == 7  # 2 untimed + 5 timed


def test_measure_transfer_s_on_cpu_is_small():
    per_transfer_s = measure_transfer_s("cpu", n=9)
    assert 0.0 <= per_transfer_s < 1e-3


@pytest.mark.parametrize("kwargs", [{"n": 0}, {"rows": 0}, {"warmup": -1}])
def test_measure_transfer_s_refuses_bad_input(kwargs):
    with pytest.raises(ValueError, match=r"must be >= "):
        measure_transfer_s("cpu", **kwargs)


@pytest.mark.parametrize("gate_error", [NotSingleTransfer, NotDeviceResident, NotMeasurable])
def test_every_gate_error_is_a_value_error(gate_error):
    assert issubclass(gate_error, ValueError)


def test_check_single_transfer_passes_exactly_one():
    check_single_transfer(1.0)
    processor = OutputProcessor()
    for step in range(3):
        process_batch(processor, _batch([step], ("a",), processor.readback))
    check_single_transfer(processor)


@pytest.mark.parametrize("rate", [0.0, 0.5, 1.25, 2.0, 9.0])
def test_check_single_transfer_refuses_any_other_rate(rate):
    with pytest.raises(NotSingleTransfer, match=rf"transfers_per_step={rate} must be exactly 1.0"):
        check_single_transfer(rate)


def test_check_single_transfer_refuses_a_processor_with_no_steps():
    with pytest.raises(NotSingleTransfer, match=r"applied 0 steps"):
        check_single_transfer(OutputProcessor())


def test_check_single_transfer_refuses_one_extra_journey():
    processor = OutputProcessor()
    for step in range(4):
        process_batch(processor, _batch([step], ("a",), processor.readback))
    processor.readback.fetch(torch.tensor([0]))  # somebody's debug line
    with pytest.raises(NotSingleTransfer, match=r"transfers_per_step=1.25 \(5 journeys over 4 steps\)"):
        check_single_transfer(processor)


def test_check_device_resident_passes_a_rows_int64_tensor_on_the_device():
    check_device_resident(torch.tensor([1, 2, 3]), "cpu")
    check_device_resident(torch.tensor([1, 2, 3]), torch.device("cpu"))
    check_device_resident(torch.tensor([1, 2, 3]), "cpu:0")  # a CPU tensor's device has no index
    check_device_resident(torch.empty(0, dtype=torch.int64), "cpu")


@pytest.mark.parametrize(
    "output, device, pattern",
    [
        ([1, 2, 3], "cpu", r"sampler output is a list, must be a torch.Tensor"),
        (
            torch.tensor([1, 2, 3]),
            "cuda",
            r"sampler output is on cpu, must stay on the forward's device cuda",
        ),
        (torch.empty(3, dtype=torch.int64, device="meta"), "cpu", r"sampler output is on meta"),
        (torch.tensor([1, 2], dtype=torch.int32), "cpu", r"dtype torch.int32, must be torch.int64"),
        (torch.tensor([[1, 2]]), "cpu", r"shape \(1, 2\), must be 1-D \[rows\]"),
        (torch.tensor(5), "cpu", r"shape \(\), must be 1-D"),
    ],
    ids=["list", "cpu-not-cuda", "meta-not-cpu", "int32", "2-D", "0-D"],
)
def test_check_device_resident_refuses(output, device, pattern):
    with pytest.raises(NotDeviceResident, match=pattern):
        check_device_resident(output, device)


def test_check_measurable_refuses_a_cpu_whatever_it_measured():
    with pytest.raises(NotMeasurable, match=r"device=cpu has no bus"):
        check_measurable(1e-3, "cpu")
    with pytest.raises(NotMeasurable, match=r"device=cpu"):
        check_measurable(0.0, torch.device("cpu"))


def test_check_measurable_refuses_a_cost_below_resolution():
    assert MIN_MEASURABLE_S == 1e-6
    with pytest.raises(
        NotMeasurable, match=r"per_transfer_s=5e-07 is below the measurable resolution_s=1e-06"
    ):
        check_measurable(5e-7, "cuda")
    with pytest.raises(NotMeasurable, match=r"resolution_s=0.0001"):
        check_measurable(5e-5, "cuda", resolution_s=1e-4)


def test_check_measurable_passes_a_measured_device_cost():
    check_measurable(20e-6, "cuda")
    check_measurable(1e-6, "cuda:0")  # exactly at the resolution is measurable


@pytest.mark.parametrize("per_transfer_s", [-1e-6, math.nan, math.inf])
def test_check_measurable_refuses_nonsense_as_bad_input_not_as_a_gate(per_transfer_s):
    with pytest.raises(ValueError, match=r"must be finite and >= 0") as info:
        check_measurable(per_transfer_s, "cuda")
    assert not isinstance(info.value, NotMeasurable)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_transfer_is_measurable_and_the_batch_stays_resident():
    per_transfer_s = measure_transfer_s("cuda", n=25)
    check_measurable(per_transfer_s, "cuda")
    tokens = torch.tensor([3, 1, 2], dtype=torch.int64, device="cuda")
    check_device_resident(tokens, "cuda")
    check_device_resident(tokens, f"cuda:{tokens.device.index}")
    processor = OutputProcessor()
    seen: list[tuple[str, int]] = []
    seen += process_batch(processor, TokenBatch(tokens, ("a", "b", "c"), processor.readback))
    assert seen == [("a", 3), ("b", 1), ("c", 2)]
    check_single_transfer(processor)
